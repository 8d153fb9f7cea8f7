"""MIG layouts: make GPU i's MIG instances what the control plane asks (`Assignments.mig_layouts`).

Level-triggered and per GPU (docs/design/mig-layouts.md §2). For each layout asked for, once:

1. Refuse, without touching the GPU, a layout that does not fit the model's geometry (the table
   below, the agent's own copy: it may not import `app`), or when this host cannot apply one
   (no `nvidia-smi` on PATH, or no NVML to read the result back).
2. Wait while a run the agent holds names the GPU or one of its MIG instances (it is stopping,
   or the control plane's view is late), or while a burn-in step runs.
3. Done at once, with no command run, when the GPU already has the layout: MIG off for a whole
   GPU, else MIG on with the same profiles (the starts asked for are preferences: the driver
   places what `nvidia-smi mig -cgi` creates, and the truth is what NVML reads back).
4. Refuse when `nvidia-smi --query-compute-apps` shows a process on the GPU (one the agent does
   not own).
5. MIG on: `-i N -mig 1` if it is off, then `--query-gpu=mig.mode.current,mig.mode.pending`
   (current != pending: failed, a GPU reset is needed; the agent never resets a GPU itself);
   `mig -i N -dci`, `mig -i N -dgi` (compute instances first: a GPU instance holding one is in
   use) unless MIG was just enabled; then `mig -i N -cgi names -C`. The driver's placement
   policy is not known: the first try creates in the order of the starts asked for (right when
   the driver takes the lowest free start), and when that runs out of room ("Insufficient
   Resources") everything is destroyed and the layout created largest first (right when it
   takes the highest).
   MIG off: destroy as above, `-i N -mig 0`, the mode check.
6. Read the GPU back through NVML and report `applied` (the profiles match) or `failed` (a
   command exited non-zero: its "Unable/Failed to ..." words are the detail), with the
   instances the GPU really has.

State, one file per GPU, `<state>/mig/<gpu>.json` (the layout's id, its status, the report and
whether the control plane acknowledged it): a layout is applied once per id, its report is
sent until acknowledged, and an agent restarted mid-apply starts it again from what the GPU
has (every step is safe to repeat).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rackplane_agent import inventory as inventory_mod
from rackplane_agent.logfmt import kv
from rackplane_agent.state import write_atomic
from rackplane_wire import GpuInfo, MigLayout, MigLayoutReport, MigSlot

log = logging.getLogger("rackplane_agent.mig")

APPLYING, APPLIED, REFUSED, FAILED = "applying", "applied", "refused", "failed"

# --- geometry (shared/reference/gpu.md; tests check it agrees with app/placement/mig.py) ---
COMPUTE_SLICES, MEMORY_SLICES, MAX_INSTANCES = 7, 8, 7
# shape key -> (compute slices, memory slices, valid starts)
SHAPES: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "1g": (1, 1, (0, 1, 2, 3, 4, 5, 6)),
    "1g.2m": (1, 2, (0, 2, 4, 6)),
    "2g": (2, 2, (0, 2, 4)),
    "3g": (3, 4, (0, 4)),
    "4g": (4, 4, (0,)),
    "7g": (7, 8, (0,)),
}
_ORDER = ("1g", "1g.2m", "2g", "3g", "4g", "7g")
_NAMES = {
    "A100-80GB": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H100-80GB": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H200-141GB": ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    "B200": ("1g.23gb", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"),
    "GB200": ("1g.23gb", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb"),
    "H100-PCIe-80GB": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H200-NVL-141GB": ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
}


def shape_key(model: str, profile: str) -> str | None:
    """`3g.40gb` on an H100-80GB -> `3g`; None when it is not one of the model's profiles."""
    names = _NAMES.get(model, ())
    return _ORDER[names.index(profile)] if profile in names else None


def valid_layout(placements: list[tuple[str, int]]) -> bool:
    """Whether (shape key, start) placements can share one GPU."""
    used = compute = 0
    for key, start in placements:
        c, m, starts = SHAPES[key]
        bits = ((1 << m) - 1) << start
        if start not in starts or bits & used:
            return False
        used |= bits
        compute += c
    return compute <= COMPUTE_SLICES and len(placements) <= MAX_INSTANCES


def layout_problem(model: str, layout: MigLayout) -> str | None:
    """Why `layout` cannot be applied to a GPU of `model`, or None."""
    if not layout.mig_mode:
        return "a whole GPU (MIG off) has no instances" if layout.instances else None
    if model not in _NAMES:
        return f"{model} has no MIG profiles"
    keys = []
    for slot in layout.instances:
        key = shape_key(model, slot.profile)
        if key is None:
            return f"{slot.profile} is not a MIG profile of {model}"
        keys.append((key, slot.start))
    if not valid_layout(keys):
        text = ", ".join(f"{s.profile}@{s.start}" for s in layout.instances)
        return f"{text} is not a valid MIG layout on {model}"
    return None


def has_layout(gpu: GpuInfo, layout: MigLayout) -> bool:
    """The GPU already is as asked: MIG off, or on with the same profiles (any starts)."""
    if not layout.mig_mode:
        return not gpu.mig_mode
    return gpu.mig_mode and Counter(m.profile for m in gpu.mig_instances) == Counter(
        s.profile for s in layout.instances
    )


def creation_orders(model: str, slots: list[MigSlot]) -> list[list[MigSlot]]:
    """The orders `-cgi` tries: by start asked for (ties: larger first), then largest first."""

    def memory(s: MigSlot) -> int:
        key = shape_key(model, s.profile)
        return SHAPES[key][1] if key else 0

    by_start = sorted(slots, key=lambda s: (s.start, -memory(s)))
    largest = sorted(slots, key=lambda s: (-memory(s), -s.start))
    return [by_start] if largest == by_start else [by_start, largest]


# --- the applier -------------------------------------------------------------------------


class _Failed(Exception):
    """A command failed; the message is the report's detail."""


@dataclass
class _State:
    id: str
    gpu: int
    status: str = APPLYING
    report: dict | None = None
    version: int = 0
    acked_version: int = 0


def _words(out: str) -> str:
    lines = [x.strip() for x in out.splitlines() if x.strip()]
    said = [x for x in lines if x.startswith(("Unable", "Failed", "Warning", "No "))]
    return "; ".join(said[:2] or lines[-1:]) or "(no output)"


def _nothing_there(out: str) -> bool:
    return (
        "Not Found" in out
        or "No compute instances found" in out
        or ("No GPU instances found" in out)
    )


class MigApplier:
    """Applies `Assignments.mig_layouts`; `advance` once per agent pass (it runs the commands
    itself: seconds), `pending`/`acked` from the reporter."""

    def __init__(
        self,
        root: Path,
        nvml: Any | None,
        *,
        environ: Mapping[str, str] | None = None,
        timeout: float = 300.0,
    ):
        self.root = root
        self.nvml = nvml
        self.environ = dict(os.environ if environ is None else environ)
        self.smi = shutil.which("nvidia-smi", path=self.environ.get("PATH"))
        self.timeout = timeout
        self.states: dict[int, _State] = {}
        self._lock = threading.Lock()  # states: advance (reconciler) vs pending/acked (reporter)
        self._waiting: set[str] = set()
        self._load()

    @property
    def able(self) -> bool:
        """This host can apply layouts: nvidia-smi to change them, NVML to read them back."""
        return self.smi is not None and self.nvml is not None

    # --- persistence ---------------------------------------------------------------------

    def _load(self) -> None:
        if not self.root.is_dir():
            return
        for f in sorted(self.root.glob("*.json")):
            try:
                st = _State(**json.loads(f.read_text()))
            except (OSError, ValueError, TypeError):
                continue
            self.states[st.gpu] = st

    def _save(self, st: _State) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.root / f"{st.gpu}.json", json.dumps(asdict(st)).encode())

    def _forget(self, gpu: int) -> None:
        self.states.pop(gpu, None)
        (self.root / f"{gpu}.json").unlink(missing_ok=True)

    # --- the pass ----------------------------------------------------------------------------

    def advance(self, desired: list[MigLayout], busy: set[str], burn_in_running: bool) -> bool:
        """Apply what is asked for and not yet done. `busy`: the devices named by the agent's
        running runs. True when a GPU was changed (the inventory is to be read again)."""
        wanted: dict[int, MigLayout] = {}
        for layout in desired:
            wanted.setdefault(layout.gpu, layout)
        with self._lock:
            for gpu, st in list(self.states.items()):
                layout = wanted.get(gpu)
                if layout is not None and layout.id == st.id:
                    continue
                if layout is None and st.status != APPLYING and st.version > st.acked_version:
                    continue  # its report is told first
                self._forget(gpu)
        changed = False
        for gpu, layout in sorted(wanted.items()):
            st = self.states.get(gpu)
            if st is not None and st.status != APPLYING:
                continue
            changed |= self._apply(layout, busy, burn_in_running)
        return changed

    def _apply(self, layout: MigLayout, busy: set[str], burn_in_running: bool) -> bool:
        if not self.able:
            missing = "nvidia-smi is not on PATH" if self.smi is None else "NVML did not load"
            self._finish(layout, REFUSED, f"this host cannot apply MIG layouts: {missing}", None)
            return False
        gpu = self._read(layout.gpu)
        if gpu is None:
            self._finish(layout, REFUSED, f"there is no GPU {layout.gpu} on this host", None)
            return False
        problem = layout_problem(gpu.model, layout)
        if problem is not None:
            self._finish(layout, REFUSED, problem, gpu)
            return False
        devices = {gpu.uuid} | {m.uuid for m in gpu.mig_instances}
        if burn_in_running or devices & busy:
            if layout.id not in self._waiting:
                self._waiting.add(layout.id)
                why = "a burn-in step runs" if burn_in_running else "a run uses it"
                log.info(kv("mig_layout_waits", id=layout.id, gpu=layout.gpu, reason=why))
            return False
        self._waiting.discard(layout.id)
        if has_layout(gpu, layout):
            self._finish(layout, APPLIED, "", gpu)
            return False
        with self._lock:
            if layout.gpu not in self.states:
                self.states[layout.gpu] = _State(id=layout.id, gpu=layout.gpu)
                self._save(self.states[layout.gpu])
        log.info(
            kv(
                "mig_layout_applying",
                id=layout.id,
                gpu=layout.gpu,
                mig=layout.mig_mode,
                instances=",".join(f"{s.profile}@{s.start}" for s in layout.instances) or None,
            )
        )
        try:
            pids = self._pids(devices)
            if pids:
                self._finish(layout, REFUSED, f"busy: pid {', '.join(map(str, pids))}", gpu)
                return False
            self._change(gpu, layout)
        except _Failed as exc:
            self._finish(layout, FAILED, str(exc), self._read(layout.gpu))
            return True
        after = self._read(layout.gpu)
        if after is None or not has_layout(after, layout):
            have = ", ".join(
                f"{m.profile}@{m.start}" for m in (after.mig_instances if after else [])
            )
            self._finish(layout, FAILED, f"read back: the GPU has {have or 'no instances'}", after)
        else:
            self._finish(layout, APPLIED, "", after)
        return True

    def _change(self, gpu: GpuInfo, layout: MigLayout) -> None:
        i = str(gpu.index)
        if layout.mig_mode:
            if gpu.mig_mode:
                self._destroy(i)
            else:
                self._run("-i", i, "-mig", "1")
                self._check_mode(i, True)
            if layout.instances:
                self._create(i, gpu.model, layout.instances)
        elif gpu.mig_mode:
            self._destroy(i)
            self._run("-i", i, "-mig", "0")
            self._check_mode(i, False)

    def _create(self, i: str, model: str, slots: list[MigSlot]) -> None:
        orders = creation_orders(model, slots)
        for n, order in enumerate(orders):
            names = ",".join(s.profile for s in order)
            code, out = self._smi("mig", "-i", i, "-cgi", names, "-C")
            if code == 0:
                return
            if n + 1 == len(orders) or "Insufficient Resources" not in out:
                raise _Failed(f"nvidia-smi mig -cgi {names}: {_words(out)}")
            log.info(kv("mig_layout_retry", gpu=i, tried=names, reason=_words(out)))
            self._destroy(i)

    def _destroy(self, i: str) -> None:
        for flag in ("-dci", "-dgi"):
            code, out = self._smi("mig", "-i", i, flag)
            if code != 0 and not _nothing_there(out):
                raise _Failed(f"nvidia-smi mig {flag}: {_words(out)}")

    def _check_mode(self, i: str, want: bool) -> None:
        out = self._run(
            "-i", i, "--query-gpu=mig.mode.current,mig.mode.pending", "--format=csv,noheader"
        )
        modes = (
            [x.strip().lower() for x in out.strip().splitlines()[0].split(",")]
            if out.strip()
            else []
        )
        if len(modes) != 2:
            raise _Failed(f"cannot read MIG mode: {out.strip()[:200]!r}")
        current, pending = modes
        if current != pending:
            raise _Failed(
                f"MIG mode change pending (current {current}, pending {pending}): "
                "a GPU reset is needed"
            )
        if (current == "enabled") != want:
            raise _Failed(f"MIG mode is {current} after asking for {'on' if want else 'off'}")

    def _pids(self, devices: set[str]) -> list[int]:
        out = self._run("--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader")
        pids = []
        for line in out.splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) >= 2 and parts[0] in devices and parts[1].isdigit():
                pids.append(int(parts[1]))
        return sorted(set(pids))

    def _run(self, *args: str) -> str:
        code, out = self._smi(*args)
        if code != 0:
            raise _Failed(f"nvidia-smi {' '.join(args)}: {_words(out)}")
        return out

    def _smi(self, *args: str) -> tuple[int, str]:
        assert self.smi is not None
        try:
            done = subprocess.run(
                [self.smi, *args],
                capture_output=True,
                text=True,
                errors="replace",
                timeout=self.timeout,
                env=self.environ,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise _Failed(f"nvidia-smi {' '.join(args)}: no answer in {self.timeout:g} s") from None
        except OSError as exc:
            raise _Failed(f"cannot run nvidia-smi: {exc.strerror or exc}") from None
        log.debug(kv("nvidia_smi", args=" ".join(args), exit_code=done.returncode))
        return done.returncode, done.stdout + done.stderr

    def _read(self, index: int) -> GpuInfo | None:
        if self.nvml is None:
            return None
        try:
            gpus = inventory_mod.gpus_from_nvml(self.nvml)
        except Exception as exc:  # NVMLError: the report says what the GPU has as unknown
            log.error(kv("mig_read_failed", gpu=index, error=exc))
            return None
        return next((g for g in gpus if g.index == index), None)

    def _finish(self, layout: MigLayout, status: str, detail: str, gpu: GpuInfo | None) -> None:
        report = MigLayoutReport(
            id=layout.id,
            gpu=layout.gpu,
            status=status,  # type: ignore[arg-type]
            detail=detail.replace("\x00", "")[:500],
            mig_mode=gpu.mig_mode if gpu is not None else False,
            instances=list(gpu.mig_instances) if gpu is not None else [],
        )
        with self._lock:
            old = self.states.get(layout.gpu)
            version = (old.version if old is not None and old.id == layout.id else 0) + 1
            st = _State(
                id=layout.id,
                gpu=layout.gpu,
                status=status,
                report=report.model_dump(mode="json"),
                version=version,
            )
            self.states[layout.gpu] = st
            self._save(st)
        (log.info if status == APPLIED else log.warning)(
            kv(
                "mig_layout_done",
                id=layout.id,
                gpu=layout.gpu,
                status=status,
                detail=detail or None,
            )
        )

    # --- reporting -----------------------------------------------------------------------

    def pending(self) -> list[tuple[MigLayoutReport, int, str, int]]:
        """Reports not yet acknowledged: (report, gpu, id, version)."""
        with self._lock:
            return [
                (MigLayoutReport(**st.report), st.gpu, st.id, st.version)
                for st in self.states.values()
                if st.report is not None and st.version > st.acked_version
            ]

    def acked(self, sent: list[tuple[int, str, int]]) -> None:
        with self._lock:
            for gpu, layout_id, version in sent:
                st = self.states.get(gpu)
                if st is not None and st.id == layout_id and version > st.acked_version:
                    st.acked_version = version
                    self._save(st)
