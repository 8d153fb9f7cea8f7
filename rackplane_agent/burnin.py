"""Burn-in: the node's validation suite, run before the node takes work (bring-up, after a
repair, after an upgrade).

The control plane puts a `BurnIn` in the node's desired state; the agent runs its steps in
order, one process at a time in a session of its own, only while the node runs nothing else,
stopping at the first step that fails or runs past its time limit (its process group is then
killed). What each step printed is judged here (`judge`): its exit code, a failing GPU named
by dcgmi diag or by the documented result line, and the bus bandwidth nccl-tests (or the
result line) printed against the step's bound. Results are kept in the state directory and
reported with every status report until acknowledged; an agent restarted mid-step runs that
step again (steps are checks: running one twice is harmless).

    <state>/burn-in/<id>/state.json     the results so far, the step running (pid, start)
    <state>/burn-in/<id>/<n>.log        step n's stdout and stderr

Placeholders in a step's argv: `{gpus}` (how many GPUs the host has), `{devices}` (their
UUIDs, comma-separated).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rackplane_agent.logfmt import kv
from rackplane_agent.state import write_atomic
from rackplane_wire import BurnIn, BurnInReport, BurnInStep, BurnInStepResult

log = logging.getLogger("rackplane_agent.burnin")

RESULT_LINE = re.compile(r"^RACKPLANE-BURNIN\s+(.*)$")
_PAIR = re.compile(r"(\w+)=(\"[^\"]*\"|\S+)")
NCCL_AVG = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([0-9]+(?:\.[0-9]+)?)")
DCGM_FAIL = re.compile(r"\bFail\b[^\n]*?GPU(?:s)?\s*:?\s*(\d+)", re.IGNORECASE)
TAIL_BYTES = 64 * 1024


def judge(step: BurnInStep, exit_code: int | None, output: str, seconds: float) -> BurnInStepResult:
    """A finished step's result from its exit code and what it printed."""
    gpu: int | None = None
    busbw: float | None = None
    said_fail = False
    detail = ""
    for line in output.splitlines():
        m = RESULT_LINE.match(line.strip())
        if m:
            fields = {k: v.strip('"') for k, v in _PAIR.findall(m.group(1))}
            said_fail = said_fail or fields.get("status") == "fail"
            if fields.get("gpu", "").isdigit():
                gpu = int(fields["gpu"])
            if _number(fields.get("busbw_gbps")) is not None:
                busbw = _number(fields.get("busbw_gbps"))
            detail = fields.get("detail", detail)
            continue
        m = NCCL_AVG.search(line)
        if m:
            busbw = float(m.group(1))
            continue
        m = DCGM_FAIL.search(line)
        if m and gpu is None:
            said_fail, gpu = True, int(m.group(1))
            detail = detail or line.strip()[:200]
    status = "passed"
    if exit_code != 0:
        status = "failed"
        detail = detail or f"exited with {exit_code}: {_last_line(output)}"
    elif said_fail:
        status = "failed"
        detail = detail or _last_line(output)
    elif step.min_busbw_gbps is not None:
        if busbw is None:
            status, detail = "failed", "printed no bus bandwidth to compare with its bound"
        elif busbw < step.min_busbw_gbps:
            status = "failed"
            detail = f"bus bandwidth {busbw:g} GB/s is below the bound {step.min_busbw_gbps:g}"
    return BurnInStepResult(
        name=step.name,
        status=status,  # type: ignore[arg-type]
        gpu=gpu if status != "passed" else None,
        busbw_gbps=busbw,
        detail=detail[:500].replace("\x00", ""),
        seconds=round(max(0.0, seconds), 3),
    )


def _number(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _last_line(output: str) -> str:
    lines = [x for x in output.splitlines() if x.strip()]
    return lines[-1].strip()[:200] if lines else "(no output)"


@dataclass
class _State:
    id: str
    results: list[dict] = field(default_factory=list)
    done: bool = False
    pid: int | None = None
    started_at: float | None = None  # wall clock
    version: int = 0
    acked_version: int = 0
    reinventory: bool = False  # read the inventory again when done (the steps changed it)


class BurnInRunner:
    """Runs the desired burn-in, if any, one step per process; `advance` once per agent pass."""

    def __init__(self, root: Path, devices: list[str]):
        self.root = root
        self.devices = devices
        self.state: _State | None = None
        self._proc: subprocess.Popen | None = None
        self._load()

    # --- persistence -------------------------------------------------------------------------

    def _dir(self, burn_id: str) -> Path:
        return self.root / re.sub(r"[^A-Za-z0-9_-]", "_", burn_id)

    def _load(self) -> None:
        if not self.root.is_dir():
            return
        for d in sorted(self.root.iterdir()):
            f = d / "state.json"
            if f.is_file():
                try:
                    self.state = _State(**json.loads(f.read_text()))
                except (ValueError, TypeError):
                    continue
        st = self.state
        if st is not None and st.pid is not None:
            # Restarted mid-step: stop what may still run of it, and run the step again.
            _kill_group(st.pid)
            st.pid, st.started_at = None, None
            self._save()

    def _save(self) -> None:
        st = self.state
        assert st is not None
        d = self._dir(st.id)
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / "state.json", json.dumps(asdict(st)).encode())

    # --- the step loop ---------------------------------------------------------------------

    def advance(self, desired: BurnIn | None, busy: bool, now: float) -> None:
        """Start, watch or stop the desired burn-in's steps. `busy`: the node runs work (a
        step waits until it does not)."""
        st = self.state
        if desired is None:
            if st is not None:
                self._stop_current("no longer asked for")
                if not st.done or st.version <= st.acked_version:
                    self._forget(st)  # nothing left to tell: a finished report is told first
            return
        if st is not None and st.id != desired.id:
            self._stop_current("another burn-in asked for")
            self._forget(st)
            st = None
        if st is None:
            st = self.state = _State(id=desired.id, reinventory=desired.reinventory)
            self._save()
        if st.done:
            return
        if st.pid is not None:
            self._watch(desired, now)
            return
        if busy:
            return
        index = len(st.results)
        if index >= len(desired.steps):
            st.done = True
            st.version += 1
            self._save()
            return
        self._start(desired.steps[index], index, now)

    def _start(self, step: BurnInStep, index: int, now: float) -> None:
        st = self.state
        assert st is not None
        argv = [self._expand(a) for a in step.command]
        out = self._dir(st.id) / f"{index}.log"
        with open(out, "wb") as fh:
            try:
                self._proc = subprocess.Popen(
                    argv,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as exc:
                missing = isinstance(exc, FileNotFoundError) and step.optional
                self._record(
                    BurnInStepResult(
                        name=step.name,
                        status="skipped" if missing else "failed",
                        detail=(
                            f"{argv[0]} is not installed: skipped"
                            if missing
                            else f"cannot start {argv[0]}: {exc.strerror or exc}"
                        )[:500],
                        seconds=0.0,
                    )
                )
                return
        st.pid, st.started_at = self._proc.pid, now
        self._save()
        log.info(kv("burn_in_step_started", burn_in=st.id, step=step.name, pid=st.pid))

    def _watch(self, desired: BurnIn, now: float) -> None:
        st = self.state
        assert st is not None and st.pid is not None and st.started_at is not None
        index = len(st.results)
        step = desired.steps[index]
        code = self._exit_code()
        elapsed = now - st.started_at
        if code is None and elapsed < step.timeout_s:
            return  # still running
        output = self._output(index)
        if code is None:
            _kill_group(st.pid)
            self._reap()
            result = BurnInStepResult(
                name=step.name,
                status="timed_out",
                detail=f"no result within {step.timeout_s:g} s; its processes were killed",
                seconds=round(elapsed, 3),
            )
        else:
            result = judge(step, code, output, elapsed)
        st.pid, st.started_at = None, None
        self._record(result)

    def _record(self, result: BurnInStepResult) -> None:
        st = self.state
        assert st is not None
        st.results.append(result.model_dump(mode="json"))
        st.done = result.status not in ("passed", "skipped") or st.done
        st.version += 1
        self._save()
        log.info(
            kv(
                "burn_in_step_done",
                burn_in=st.id,
                step=result.name,
                status=result.status,
                gpu=result.gpu,
                detail=result.detail or None,
            )
        )

    def _exit_code(self) -> int | None:
        if self._proc is not None:
            return self._proc.poll()
        return None

    def _reap(self) -> None:
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._proc = None

    def _stop_current(self, why: str) -> None:
        st = self.state
        if st is None or st.pid is None:
            return
        _kill_group(st.pid)
        self._reap()
        log.info(kv("burn_in_step_stopped", burn_in=st.id, reason=why))
        st.pid, st.started_at = None, None
        self._save()

    def _forget(self, st: _State | None) -> None:
        if st is not None:
            shutil.rmtree(self._dir(st.id), ignore_errors=True)
        self.state = None

    def _output(self, index: int) -> str:
        st = self.state
        assert st is not None
        path = self._dir(st.id) / f"{index}.log"
        try:
            with open(path, "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(max(0, size - TAIL_BYTES))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _expand(self, arg: str) -> str:
        return arg.replace("{gpus}", str(len(self.devices))).replace(
            "{devices}", ",".join(self.devices)
        )

    # --- reporting ---------------------------------------------------------------------------

    def pending(self) -> tuple[BurnInReport, int] | None:
        """The report to send (and its version) while it has news the server has not acked."""
        st = self.state
        if st is None or st.version <= st.acked_version:
            return None
        report = BurnInReport(
            id=st.id,
            results=[BurnInStepResult(**r) for r in st.results],
            done=st.done,
        )
        return report, st.version

    def acked(self, version: int) -> None:
        st = self.state
        if st is not None and version > st.acked_version:
            st.acked_version = version
            self._save()

    def wants_inventory(self) -> bool:
        """A finished burn-in whose steps changed the host: its report carries a fresh
        inventory."""
        st = self.state
        return st is not None and st.done and st.reinventory

    def running(self) -> bool:
        return self.state is not None and self.state.pid is not None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
