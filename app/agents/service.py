"""Joining: an operator's single-use, expiring token for one node, traded by that node's agent
for a node credential. Rotating and revoking credentials touches no running work."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.agents.schemas import CredentialsRevoked, Joined, JoinTokenOut, NodeIdentity
from app.core.db import utcnow
from app.core.errors import Unauthorized
from app.models.agents import NodeCredential, NodeJoinToken
from app.models.fleet import Gpu, Node, Rack, Region
from app.tenancy.credentials import hash_secret
from app.tenancy.nodes import (
    JOIN_PREFIX,
    NODE_PREFIX,
    InvalidNodeCredential,
    NodeCaller,
    new_secret,
    well_formed,
)


class InvalidJoinToken(Unauthorized):
    code = "invalid_join_token"
    title = "Invalid join token"  # not the API key's title it inherited (issue 45 item 16)


def create_join_token(
    session: Session, node: Node, ttl_s: int = 900, adopt: bool = False
) -> JoinTokenOut:
    """A single-use join token for `node`'s agent. `adopt`: the agent's first inventory
    becomes the node's GPUs' record (model, count, MIG mode, UUIDs) instead of a difference,
    where the rack's kind sells that and nothing runs on the node."""
    token, digest = new_secret(JOIN_PREFIX)
    row = NodeJoinToken(
        node_id=node.id,
        token_hash=digest,
        expires_at=utcnow() + timedelta(seconds=ttl_s),
        adopt=adopt,
    )
    session.add(row)
    session.flush()
    return JoinTokenOut(
        node_id=node.id,
        node_name=node.name,
        token=token,
        expires_at=row.expires_at,
        adopt=adopt,
    )


def _issue(session: Session, node: Node) -> Joined:
    credential, digest = new_secret(NODE_PREFIX)
    prefix = credential[len(NODE_PREFIX) : len(NODE_PREFIX) + 8]
    session.add(NodeCredential(node_id=node.id, prefix=prefix, secret_hash=digest))
    session.flush()
    return Joined(
        node_id=node.id, node_name=node.name, credential=credential, credential_prefix=prefix
    )


def join(session: Session, token: str) -> Joined:
    """Trade a join token for a node credential. The token is spent by one conditional UPDATE,
    so two agents racing with it get one credential between them."""
    spent = None
    if well_formed(token, JOIN_PREFIX):
        now = utcnow()
        spent = session.execute(
            update(NodeJoinToken)
            .where(
                NodeJoinToken.token_hash == hash_secret(token),
                NodeJoinToken.used_at.is_(None),
                NodeJoinToken.expires_at > now,
            )
            .values(used_at=now)
            .returning(NodeJoinToken.node_id, NodeJoinToken.adopt)
        ).one_or_none()
    if spent is None:
        raise InvalidJoinToken(
            "This join token is unknown, already used or expired: ask an operator for a new "
            "one (`rackplane fleet join-token NODE`)."
        )
    node = session.get_one(Node, spent.node_id)
    if spent.adopt:
        node.adopt_inventory = True  # its agent's next inventory becomes its record
    return _issue(session, node)


def rotate(session: Session, caller: NodeCaller) -> Joined:
    """A new credential for the calling node; the one it called with stops working. The old
    one is retired by one conditional UPDATE, so rotates racing with one credential (or with
    its revocation) mint one live credential between them; the others get the 401 of a
    retired credential."""
    retired = session.scalar(
        update(NodeCredential)
        .where(NodeCredential.id == caller.credential_id, NodeCredential.revoked_at.is_(None))
        .values(revoked_at=utcnow())
        .returning(NodeCredential.id)
    )
    if retired is None:
        raise InvalidNodeCredential()
    return _issue(session, session.get_one(Node, caller.node_id))


def revoke_all(session: Session, node: Node) -> CredentialsRevoked:
    """Stop a node's agent speaking for it (401 from its next request); its running work and
    the fleet's record of the node are left alone."""
    result = session.execute(
        update(NodeCredential)
        .where(NodeCredential.node_id == node.id, NodeCredential.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )
    return CredentialsRevoked(node_id=node.id, revoked=result.rowcount or 0)


def identity(session: Session, caller: NodeCaller) -> NodeIdentity:
    node, rack, region = session.execute(
        select(Node, Rack.name, Region.name)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .where(Node.id == caller.node_id)
    ).one()
    gpus = session.scalar(select(func.count()).where(Gpu.node_id == node.id)) or 0
    return NodeIdentity(
        node_id=node.id,
        node_name=node.name,
        region=region,
        rack=rack,
        gpu_model=node.gpu_model,
        gpus=gpus,
    )


def node_named(session: Session, name: str) -> Node | None:
    return session.scalar(select(Node).where(Node.name == name))
