from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator

from app.core.schemas import TEXT_PATTERN, OutModel, StrictModel, strict_schema

NAME = r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$"
Name = Annotated[str, Field(min_length=1, max_length=63, pattern=NAME)]
# A component's version as its vendor writes it: 560.35.03, 12.6, 2.23.4-1, 96.00.9F.00.01
Version = Annotated[
    str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+:~-]*$")
]
CudaVersion = Annotated[str, Field(max_length=8, pattern=r"^[0-9]{1,2}\.[0-9]{1,2}$")]


class StackComponents(StrictModel):
    """The versions a stack pins. Driver and CUDA always; the rest where the fleet has them."""

    driver: Version
    cuda: CudaVersion
    nccl: Version | None = None
    firmware: Version | None = Field(None, description="GPU firmware / VBIOS")
    fabric_manager: Version | None = None
    os_image: Version | None = None


class StackCreate(StrictModel):
    name: Name = Field(description="Unique, and never reused: a new version is a new stack")
    description: str | None = Field(None, max_length=500, pattern=TEXT_PATTERN)
    components: StackComponents


class StackOut(OutModel):
    id: uuid.UUID
    name: str
    description: str | None
    components: dict[str, str] = Field(description="component -> pinned version")
    created_at: datetime
    nodes: int = Field(0, description="Nodes that should run it")
    drifted: int = Field(0, description="Of those, nodes whose agents report other versions")


class StackList(BaseModel):
    items: list[StackOut]


def _one_target(schema: dict[str, Any], model: type) -> None:
    """`StackAssign`'s rule in its JSON Schema, so clients and fuzzers see it: exactly one of
    pool, region or nodes (the others absent or null)."""
    strict_schema(schema, model)
    null = {"type": "null"}
    name = {"type": "string", "pattern": NAME}
    given = {"pool": name, "region": name, "nodes": {"type": "array"}}
    schema["oneOf"] = [
        {"required": [k], "properties": {k: given[k], **{o: null for o in given if o != k}}}
        for k in given
    ]


class StackAssign(StrictModel):
    """Which nodes should run the stack: one pool, one region, or nodes by name."""

    model_config = {**StrictModel.model_config, "json_schema_extra": _one_target}

    pool: Name | None = None
    region: Name | None = None
    nodes: list[Name] | None = Field(None, min_length=1, max_length=10_000)

    @model_validator(mode="after")
    def _one_target(self) -> StackAssign:
        if sum(x is not None for x in (self.pool, self.region, self.nodes)) != 1:
            raise ValueError("give exactly one of pool, region or nodes")
        return self


class StackAssigned(BaseModel):
    stack: str
    nodes: int = Field(description="Nodes now declared to run it")
    drifted: int = Field(description="Of those, nodes whose agents report other versions")


class NodeSoftware(BaseModel):
    """A node's software as the fleet sees it."""

    pool: str | None
    stack: str | None = Field(description="The stack it should run (none declared: null)")
    drift: list[str] = Field(description="Each component that differs from the stack, in words")
    cuda_version: str | None = Field(description="From its agent, else its stack's")
