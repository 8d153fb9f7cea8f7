from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field

from app.core.schemas import OutModel, StrictModel


class JoinTokenCreate(StrictModel):
    ttl_s: int = Field(
        900, ge=60, le=86400, description="Seconds the token may be used in (once); 15 minutes."
    )
    adopt: bool = Field(
        False,
        description="The joining agent's first inventory becomes the node's GPUs' record "
        "(model, count, MIG mode, UUIDs) instead of a difference to resolve: where the rack's "
        "kind sells that model and count, and nothing runs on the node.",
    )


class JoinTokenOut(OutModel):
    node_id: uuid.UUID
    node_name: str
    token: str = Field(description="`rpj_...`: shown once; give it to `rackplane agent --token`.")
    expires_at: datetime
    adopt: bool = False


class JoinIn(StrictModel):
    token: str = Field(max_length=100, description="The node's join token (`rpj_...`).")


class Joined(OutModel):
    node_id: uuid.UUID
    node_name: str
    credential: str = Field(
        description="`rpn_...`: the node's credential, shown once; the agent keeps it in its "
        "state directory and sends it as `Authorization: Bearer`."
    )
    credential_prefix: str


class NodeIdentity(OutModel):
    node_id: uuid.UUID
    node_name: str
    region: str
    rack: str
    gpu_model: str
    gpus: int


class CredentialsRevoked(OutModel):
    node_id: uuid.UUID
    revoked: int = Field(description="Live credentials revoked; the node's agent gets 401 now.")


class MigLayoutIn(StrictModel):
    """The MIG instances one GPU should have (its model's profile names, e.g. 3g.40gb, or the
    generic keys, 3g), or null for a whole GPU. Applied by the node's agent while the GPU is
    idle; the starts are chosen to keep the most room."""

    profiles: list[Annotated[str, Field(max_length=16, pattern=r"^[0-9a-z.]+$")]] | None = Field(
        description="Profile names, largest first or in any order; null: MIG off", max_length=7
    )


class MigRelayoutSlot(BaseModel):
    profile: str = Field(description="The model's name for it, e.g. 3g.40gb")
    start: int


class MigRelayoutOut(BaseModel):
    id: uuid.UUID
    node: str
    gpu_index: int
    mig_mode: bool
    layout: list[MigRelayoutSlot] = Field(description="The instances asked for, with their starts")
    status: str = Field(description="pending | applied | refused | failed | withdrawn")
    detail: str | None
    requested_at: datetime
    finished_at: datetime | None
