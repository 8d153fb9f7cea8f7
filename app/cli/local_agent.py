"""The embedded default's local node: `rackplane up` adds `local-0` (four GPUs, described by
examples/local-0.yaml, not real ones) and runs its node agent beside the API and the worker, so
work submitted to region `local` runs as real processes on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import select

from app.agents import service as agents
from app.cli.common import ROOT
from app.core.config import get_settings
from app.core.db import session_scope
from app.fleet import document
from app.fleet.service import apply_document
from app.models.agents import NodeCredential
from app.models.fleet import Node

NODE = "local-0"
FLEET = ROOT / "app" / "fleet" / "local_node.yaml"
INVENTORY = ROOT / "examples" / "local-0.yaml"


def state_dir() -> Path:
    return (get_settings().data_dir / "agent" / NODE).resolve()


def prepare() -> str | None:
    """Add the local node if the fleet lacks it; a join token when its agent has no live
    credential (a fresh data directory, or a database reset under an old one), else None."""
    cred = state_dir() / "credential"
    with session_scope() as session:
        node = session.scalar(select(Node).where(Node.name == NODE))
        if node is None:
            apply_document(session, document.load(FLEET.read_text()))
            node = session.scalar(select(Node).where(Node.name == NODE))
        elif node.pool is None:  # added before it had a pool: the one its work may run in
            node.pool = "local"
        live = session.scalar(
            select(NodeCredential.id).where(
                NodeCredential.node_id == node.id, NodeCredential.revoked_at.is_(None)
            )
        )
        if live is not None and cred.exists():
            return None
        cred.unlink(missing_ok=True)  # refused anyway: join again
        return agents.create_join_token(session, node, ttl_s=900).token


def log_path() -> Path:
    """Where the local node agent's output goes."""
    return state_dir().parent / f"{NODE}.log"


def start(api: str) -> subprocess.Popen:
    """The local node's agent, as a child process in its own session (its runs are in theirs:
    stopping `rackplane up` stops the agent, and the work it runs goes on until it is back)."""
    token = prepare()
    state = state_dir()
    state.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "rackplane_agent", "--api", api, "--state-dir", str(state)]
    # The embedded default's node is this machine, its one user's: runs run as that user (the
    # node says so, and it is no wall between tenants; a real node's agent runs as root).
    argv += ["--inventory", str(INVENTORY), "--address", "127.0.0.1", "--same-user"]
    env = None
    if token:
        env = {**os.environ, "RACKPLANE_JOIN_TOKEN": token}  # not on its command line
    log = open(log_path(), "ab")
    return subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
