"""Who is calling from a node: a node agent's credential, never a tenant's or an operator's key.

An operator makes a single-use join token for a node (`rpj_...`); the agent trades it for a node
credential (`rpn_...`) that reads only that node's assignments and writes only its reports.
Both are random, shown once, and stored as keyed hashes (as API keys are)."""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.db import session_scope
from app.core.errors import Unauthorized
from app.models.agents import NodeCredential
from app.models.fleet import Node
from app.ratelimit import service as ratelimit
from app.tenancy.auth import charge_anonymous
from app.tenancy.credentials import hash_secret
from app.tenancy.principals import cache_lookup

JOIN_PREFIX = "rpj_"
NODE_PREFIX = "rpn_"
SECRET_LEN = 40
_ALPHABET = string.ascii_letters + string.digits

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="NodeCredential",
    description="A node agent's credential: `Authorization: Bearer rpn_...`",
)


def new_secret(prefix: str) -> tuple[str, str]:
    """(the secret in clear, shown once; its keyed hash, stored)."""
    full = prefix + "".join(secrets.choice(_ALPHABET) for _ in range(SECRET_LEN))
    return full, hash_secret(full)


def well_formed(value: str, prefix: str) -> bool:
    body = value[len(prefix) :]
    return value.startswith(prefix) and len(body) == SECRET_LEN and body.isalnum()


def is_node_secret(value: str) -> bool:
    """A join token or a node credential (what a replayed answer must never carry)."""
    return well_formed(value, JOIN_PREFIX) or well_formed(value, NODE_PREFIX)


class InvalidNodeCredential(Unauthorized):
    """Not a live node credential: unknown, revoked, or retired by a rotate."""

    code = "invalid_node_credential"

    def __init__(self) -> None:
        super().__init__(
            "Send the node's credential as `Authorization: Bearer rpn_...` (from "
            "`POST /v1/agent/join`); API keys are not accepted here."
        )


@dataclass(frozen=True)
class NodeCaller:
    """A node agent, by the credential it presented."""

    node_id: uuid.UUID
    node_name: str
    credential_id: uuid.UUID


def node_of(session: Session, raw: str | None) -> NodeCaller | None:
    """The node whose live credential `raw` is, or None."""
    if not raw or not well_formed(raw, NODE_PREFIX):
        return None
    row = session.execute(
        select(NodeCredential.id, NodeCredential.node_id, Node.name)
        .join(Node, Node.id == NodeCredential.node_id)
        .where(NodeCredential.secret_hash == hash_secret(raw), NodeCredential.revoked_at.is_(None))
    ).first()
    if row is None:
        return None
    return NodeCaller(node_id=row.node_id, node_name=row.name, credential_id=row.id)


def _lookup(raw: str) -> NodeCaller | None:
    with session_scope() as session:
        return node_of(session, raw)


async def node_caller(
    request: Request, bearer: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> NodeCaller:
    """FastAPI dependency of the agent's routes: a live node credential, else 401 (and the
    caller's address pays for the failure, as for a bad API key), and a token from its node's
    bucket, else 429 (app/ratelimit). Cached as API keys are: a revoked or rotated credential
    leaves every process's cache when its change commits."""
    raw = bearer.credentials if bearer is not None else None
    caller = None
    if raw and well_formed(raw, NODE_PREFIX):
        caller = await cache_lookup("n:" + hash_secret(raw), lambda: _lookup(raw))
    if caller is None:
        charge_anonymous(request)
        raise InvalidNodeCredential()
    await ratelimit.check_async(request.scope, ratelimit.NODE, key=str(caller.node_id))
    return caller


NodeAgent = Annotated[NodeCaller, Depends(node_caller)]
