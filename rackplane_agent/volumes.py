"""Tenants' volumes on this node: a directory per volume, under its tenant, on the node's own
volume storage (`node`, `--volumes-dir`) or on the fleet's shared storage this host mounts
(`shared`, `--shared-volumes-dir`: an NFS or Lustre mount every node has at the same path).

Layout: `<root>/<tenant>/<volume id>`. With a uid per run (the agent is root), the tenant's
directory is `root:<tenant gid>` 0710 (the tenant's runs pass through, list nothing; every
other tenant's are refused at its door) and each volume's is `root:<tenant gid>` 2770 (the
tenant's runs read and write it; what they make keeps the tenant's group). A `process` run sees
a volume as a link in its own directory; a `podman` run as a bind mount, handed to the
container's own root (podman's `U`: the container has a user namespace of its own, so the files
change hands each time a container takes the volume; a process run takes them back, as
`root:<tenant gid>`; a file's set-uid bit does not survive either). Without a uid per run
(`--same-user`) the directories are the agent's own, 0700: no wall, as the node says.

A volume's directory is named by its id: one deleted and made again under its name starts
empty here. Directories of deleted volumes are not removed by the agent (the operator's
storage policy decides, as for a shared file system's snapshots)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from rackplane_agent.runtimes.base import RunUser, StartError
from rackplane_wire import Assignment, VolumeMount


class Volumes:
    def __init__(self, node_root: Path, shared_root: Path | None, isolating: bool):
        self.node_root = Path(node_root).absolute()
        self.shared_root = Path(shared_root).absolute() if shared_root is not None else None
        self.isolating = isolating

    def prepare(self) -> None:
        """Make the node's volume root (0711: runs pass through to their tenant's); the shared
        one must already be there (a mount). Raises OSError."""
        self.node_root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.node_root, 0o711)
        if self.shared_root is not None and not self.shared_root.is_dir():
            raise OSError(f"--shared-volumes-dir {self.shared_root} is not a directory")

    @property
    def shared(self) -> bool:
        return self.shared_root is not None

    def host_dirs(self, a: Assignment, user: RunUser | None) -> list[tuple[VolumeMount, Path]]:
        """Each volume of `a` with its directory here, made now if new. Raises StartError."""
        return [(v, self._dir(v, a.tenant, a.run_gid, user)) for v in a.volumes]

    def _dir(
        self, v: VolumeMount, tenant: str | None, gid: int | None, user: RunUser | None
    ) -> Path:
        root = self.node_root if v.storage == "node" else self.shared_root
        if root is None:
            raise StartError(f"volume {v.name} is on shared storage, which this node lacks")
        if tenant is None:
            raise StartError(f"volume {v.name}: the run has no tenant")
        walled = self.isolating and user is not None
        if walled and gid is None:
            raise StartError(f"volume {v.name}: the run has no tenant group to share it with")
        owner = root / tenant
        path = owner / v.id
        for d, mode in ((owner, 0o710), (path, 0o2770)):
            try:
                d.mkdir(mode=0o700)
            except FileExistsError:
                pass
            info = os.lstat(d)
            if not stat.S_ISDIR(info.st_mode):
                raise StartError(f"volume {v.name}: {d} is not a directory")
            if walled:
                if d == path and info.st_uid != 0:
                    self.take_back(path, gid)  # type: ignore[arg-type]
                os.chown(d, 0, gid)  # type: ignore[arg-type]
                os.chmod(d, mode)
        return path

    @staticmethod
    def take_back(path: Path, gid: int) -> None:
        """A process run's turn: files a container held (podman's `U`) go back to
        `root:<tenant gid>`, group-writable directories (chown clears set-uid bits)."""
        for here, dirs, files in os.walk(path):
            os.lchown(here, 0, gid)
            os.chmod(here, 0o2770)
            for name in files + [d for d in dirs if os.path.islink(os.path.join(here, d))]:
                os.lchown(os.path.join(here, name), 0, gid)
