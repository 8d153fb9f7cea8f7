from __future__ import annotations

import uuid
from datetime import datetime

from pydantic import Field

from app.core.schemas import OutModel, StrictModel


class JoinTokenCreate(StrictModel):
    ttl_s: int = Field(
        900, ge=60, le=86400, description="Seconds the token may be used in (once); 15 minutes."
    )


class JoinTokenOut(OutModel):
    node_id: uuid.UUID
    node_name: str
    token: str = Field(description="`rpj_...`: shown once; give it to `rackplane agent --token`.")
    expires_at: datetime


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
