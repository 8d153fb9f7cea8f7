"""Who a run is on the host, and where it works.

Each run gets a uid of its own from the agent's range and its tenant's gid (the control plane
gives each tenant one, the same on every node; without one, the gid of the uid's number), with
no supplementary groups and umask 007, and a working directory of its own under the work
directory, owned by that uid, mode 0700, with a private `tmp/`. So a run cannot read the
agent's state directory (0700, the agent's), another run's files, or another run's
`/proc/<pid>/environ` (the kernel refuses it across uids), and cannot signal another run's
processes. Another tenant's files are closed to it even in a shared directory (umask 007).
When a run ends, every process still holding its uid is killed (a daemon it left behind, a
process that left the group), before the uid goes back to the pool.

Two agents on one host (tests, a host split between pools) may share a range: each uid is
claimed with a file made exclusively in `/run/rackplane-agent/uids/` naming the claimant's
state directory, so one agent never hands out, or sweeps, a uid another agent's run holds.

Without a range (the agent is not root, or `--same-user`), runs work in their own directories
as the agent's user: that keeps honest runs apart but is no wall, and the node says so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import time
from pathlib import Path

import psutil

from rackplane_agent.logfmt import kv
from rackplane_agent.runtimes.base import RunPlace, RunUser

log = logging.getLogger("rackplane_agent.runusers")


class WorkDirError(Exception):
    """The work directory cannot serve runs (the agent cannot start)."""


CLAIMS_DIR = Path("/run/rackplane-agent/uids")
# A claim younger than this is never taken as stale: its run may not be recorded yet.
CLAIM_GRACE_S = 60.0


def _stale(claim: Path, holder: str, uid: int) -> bool:
    """A claim whose agent's state directory is gone, or records no run with that uid."""
    try:
        if time.time() - claim.stat().st_mtime < CLAIM_GRACE_S:
            return False
    except OSError:
        return False
    runs = Path(holder) / "runs"
    if not runs.is_dir():
        return True
    for record in runs.glob("*/run.json"):
        try:
            if json.loads(record.read_text()).get("uid") == uid:
                return False
        except (OSError, ValueError, AttributeError):
            return False
    return True


class RunUsers:
    def __init__(
        self,
        work_root: Path,
        uid_range: tuple[int, int] | None,
        owner: Path,
        claims_dir: Path = CLAIMS_DIR,
    ):
        self.root = Path(work_root)
        self.uid_range = uid_range
        self.owner = str(Path(owner).absolute())
        self.claims = claims_dir

    def _claim(self, uid: int) -> bool:
        """Claim `uid` for this agent (True), unless another agent holds it."""
        path = self.claims / str(uid)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            try:
                holder = path.read_text()
            except OSError:
                return False
            if holder == self.owner:
                return True  # ours, from before a restart
            if _stale(path, holder, uid):
                path.unlink(missing_ok=True)
                return self._claim(uid)
            return False
        with os.fdopen(fd, "w") as fh:
            fh.write(self.owner)
        return True

    def release(self, uid: int | None) -> None:
        if uid is None or self.uid_range is None:
            return
        path = self.claims / str(uid)
        try:
            if path.read_text() == self.owner:
                path.unlink()
        except OSError:
            pass

    @property
    def isolating(self) -> bool:
        return self.uid_range is not None

    def prepare(self, state_root: Path) -> None:
        """Make the work directory (0711: runs reach their own directory, list none), outside
        the state directory, on a path every run's uid can traverse."""
        state_root = Path(state_root).absolute()
        if self.root == state_root or state_root in self.root.parents:
            raise WorkDirError(f"the work directory {self.root} is inside the state directory")
        if self.root in state_root.parents:
            raise WorkDirError(f"the state directory is inside the work directory {self.root}")
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        if not self.isolating:
            return
        self.claims.mkdir(mode=0o700, parents=True, exist_ok=True)
        for parent in self.root.parents:
            mode = parent.stat().st_mode
            if not mode & stat.S_IXOTH:
                raise WorkDirError(
                    f"runs cannot reach {self.root}: {parent} is not searchable by other users "
                    f"(mode {stat.filemode(mode)}); choose another --work-dir"
                )

    def _busy_uids(self) -> set[int]:
        if self.uid_range is None:
            return set()
        first, last = self.uid_range
        busy = set()
        for proc in psutil.process_iter(["uids"]):
            uids = proc.info.get("uids")
            if uids is not None and first <= uids.real <= last:
                busy.add(uids.real)
        return busy

    def take(
        self, name: str, in_use: set[int], gid: int | None = None, own_uid: bool = True
    ) -> RunPlace:
        """A uid no run holds (nor any process still has), and the run's own directory; the
        run's gid is its tenant's (`gid`) or, without one, its uid's number."""
        user = None
        if self.uid_range is not None and own_uid:
            first, last = self.uid_range
            taken = in_use | self._busy_uids()
            uid = next(
                (u for u in range(first, last + 1) if u not in taken and self._claim(u)), None
            )
            if uid is None:
                raise OSError(f"every uid of {first}-{last} is held by a run")
            user = RunUser(uid=uid, gid=uid if gid is None else gid)
        workdir = self.root / name
        try:
            if workdir.exists():  # a start that failed before it recorded the run
                shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(mode=0o700)
            place = RunPlace(workdir=workdir, user=user)
            place.tmp.mkdir(mode=0o700)
            if user is not None:
                for path in (workdir, place.tmp):
                    os.chown(path, user.uid, user.gid)
        except OSError:
            self.release(user.uid if user else None)
            raise
        return place

    def sweep(self, uid: int | None) -> int:
        """Kill every process that still runs as `uid`; how many there were."""
        if uid is None or self.uid_range is None:
            return 0
        killed = 0
        for _ in range(5):  # again, for what forked while the last round killed
            found = 0
            for proc in psutil.process_iter(["uids"]):
                uids = proc.info.get("uids")
                if uids is None or uid not in (uids.real, uids.effective, uids.saved):
                    continue
                try:
                    proc.send_signal(signal.SIGKILL)
                    found += 1
                except psutil.Error:
                    pass
            killed += found
            if not found:
                break
        if killed:
            log.warning(kv("run_leftovers_killed", uid=uid, processes=killed))
        return killed

    def remove(self, workdir: str | None) -> None:
        if workdir:
            path = Path(workdir)
            if path.parent == self.root:
                shutil.rmtree(path, ignore_errors=True)
