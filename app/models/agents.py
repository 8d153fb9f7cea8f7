"""What lets a node agent talk to the control plane: single-use join tokens an operator makes for
a node, and the node credentials agents trade them for. Only hashes are stored."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, ForeignKey, String, false
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, new_id, utcnow


class NodeJoinToken(Base):
    __tablename__ = "node_join_tokens"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    node_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), index=True
    )
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    # The node's first inventory from the agent that spends it becomes the node's GPUs'
    # record (`Node.adopt_inventory`), rather than a difference to resolve.
    adopt: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class NodeCredential(Base):
    __tablename__ = "node_credentials"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    node_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), index=True
    )
    prefix: Mapped[str] = mapped_column(String(8))  # shown in the audit log, never the secret
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class AgentNode(Base):
    """A node run by an agent (the agent provider's), from its first inventory: what the host
    reported, and the index of the node's desired state that the agent long-polls."""

    __tablename__ = "agent_nodes"

    node_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    node_name: Mapped[str] = mapped_column(String(63), unique=True)
    # Bumped in the transaction of every change to what the node should run (a run to start,
    # to stop, to forget): an agent waiting with an older index is answered.
    desired_index: Mapped[int] = mapped_column(BigInteger, default=1, server_default="1")
    address: Mapped[str] = mapped_column(String(253))
    agent_version: Mapped[str] = mapped_column(String(32))
    runtimes: Mapped[list] = mapped_column(JSON, default=list)
    inventory: Mapped[dict] = mapped_column(JSON)
    # What differs between the host's inventory and the fleet's record, in words; empty: none.
    differences: Mapped[list] = mapped_column(JSON, default=list)
    inventory_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
