"""cgroup v2 limits for runs, where the host delegates a subtree to the agent.

The agent makes `rackplane-<run>` under its own cgroup when that cgroup's `cgroup.subtree_control`
is writable and has (or takes) the `memory` and `cpu` controllers (systemd's `Delegate=yes`,
with the agent itself in a leaf). Elsewhere (cgroup v1, a container, no delegation) it says so
once and runs without limits.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from rackplane_agent.logfmt import kv

log = logging.getLogger("rackplane_agent.cgroups")

CPU_PERIOD_US = 100_000
MIN_CPU_QUOTA_US = 1_000  # the kernel's floor
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def limits(cpu_milli: int, memory_mib: int) -> dict[str, str]:
    """The files and values for a run's allocation; 0 means unlimited.

    >>> limits(1500, 2048)
    {'memory.max': '2147483648', 'cpu.max': '150000 100000'}
    """
    memory = str(memory_mib * 1024 * 1024) if memory_mib > 0 else "max"
    if cpu_milli > 0:
        quota = max(MIN_CPU_QUOTA_US, cpu_milli * CPU_PERIOD_US // 1000)
        cpu = f"{quota} {CPU_PERIOD_US}"
    else:
        cpu = f"max {CPU_PERIOD_US}"
    return {"memory.max": memory, "cpu.max": cpu}


def own_cgroup(proc_self_cgroup: Path, root: Path) -> Path | None:
    """This process's cgroup v2 directory, or None on a v1 (or hybrid-only-v1) host."""
    if not (root / "cgroup.controllers").exists():
        return None
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return None


class Cgroups:
    def __init__(
        self,
        root: Path = Path("/sys/fs/cgroup"),
        proc_self_cgroup: Path = Path("/proc/self/cgroup"),
    ):
        self._root = root
        self._proc = proc_self_cgroup
        self._base: Path | None = None
        self._checked = False
        self._why = ""

    def available(self) -> bool:
        if not self._checked:
            self._checked = True
            self._base, self._why = self._probe()
            if self._base is None:
                log.info(kv("cgroup_limits_unavailable", reason=self._why))
            else:
                log.info(kv("cgroup_limits_available", base=self._base))
        return self._base is not None

    def _probe(self) -> tuple[Path | None, str]:
        base = own_cgroup(self._proc, self._root)
        if base is None:
            return None, "no cgroup v2 hierarchy for this process"
        control = base / "cgroup.subtree_control"
        if not os.access(base, os.W_OK) or not os.access(control, os.W_OK):
            return None, f"{base} is not delegated to this user"
        try:
            enabled = control.read_text().split()
            missing = [c for c in ("memory", "cpu") if c not in enabled]
            if missing:
                control.write_text(" ".join(f"+{c}" for c in missing))
        except OSError as exc:
            return None, f"cannot enable memory and cpu controllers in {base}: {exc}"
        return base, ""

    def create(self, run: str, cpu_milli: int, memory_mib: int) -> str | None:
        """The run's cgroup directory with its limits written, or None (no limits)."""
        if not self.available():
            return None
        assert self._base is not None
        path = self._base / f"rackplane-{_UNSAFE.sub('_', run)}"
        try:
            path.mkdir(exist_ok=True)
            for name, value in limits(cpu_milli, memory_mib).items():
                (path / name).write_text(value)
        except OSError as exc:
            log.warning(kv("cgroup_create_failed", run=run, error=exc))
            return None
        return str(path)

    @staticmethod
    def remove(path: str | None) -> None:
        if path:
            try:
                os.rmdir(path)
            except OSError:
                pass
