"""The node agent's routes (`/v1/agent`, by node credential) and the operator's side of joining
(`/v1/admin/nodes/{id}/join-tokens`, `.../credentials:revoke`)."""

from __future__ import annotations

from fastapi import Request

from app.agents import service
from app.agents.schemas import (
    CredentialsRevoked,
    Joined,
    JoinIn,
    JoinTokenCreate,
    JoinTokenOut,
    NodeIdentity,
)
from app.core.db import get_or_404
from app.core.routing import DbSession, api_router
from app.models.fleet import Node
from app.tenancy.auth import Platform, charge_anonymous
from app.tenancy.nodes import NodeAgent

router = api_router(prefix="/v1/agent", tags=["agent"])
admin = api_router(prefix="/v1/admin", tags=["admin: fleet"])


@admin.post(
    "/nodes/{node_id}/join-tokens",
    status_code=201,
    response_model=JoinTokenOut,
    summary="Make a single-use join token for a node's agent (shown once)",
)
def create_join_token(
    node_id: str, auth: Platform, session: DbSession, body: JoinTokenCreate | None = None
) -> JoinTokenOut:
    node = get_or_404(session, Node, node_id, what="node")
    return service.create_join_token(session, node, (body or JoinTokenCreate()).ttl_s)


@admin.post(
    "/nodes/{node_id}/credentials:revoke",
    response_model=CredentialsRevoked,
    summary="Revoke a node's agent credentials (its running work is left alone)",
)
def revoke_credentials(node_id: str, auth: Platform, session: DbSession) -> CredentialsRevoked:
    return service.revoke_all(session, get_or_404(session, Node, node_id, what="node"))


@router.post(
    "/join",
    status_code=201,
    response_model=Joined,
    summary="Trade a join token for the node's credential (once per token)",
)
def join(body: JoinIn, request: Request, session: DbSession) -> Joined:
    charge_anonymous(request)  # no credential yet: the caller's address pays, as anonymous
    return service.join(session, body.token)


@router.get("/node", response_model=NodeIdentity, summary="The node this credential speaks for")
def node(caller: NodeAgent, session: DbSession) -> NodeIdentity:
    return service.identity(session, caller)


@router.post(
    "/credentials:rotate",
    status_code=201,
    response_model=Joined,
    summary="A new credential for this node; the one presented stops working",
)
def rotate(caller: NodeAgent, session: DbSession) -> Joined:
    return service.rotate(session, caller)
