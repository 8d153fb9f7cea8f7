"""GraphQL types made from REST's response models, so both APIs answer with one shape.

A view is a Strawberry type generated from a pydantic model (`strawberry.experimental.pydantic`),
with the few translations GraphQL needs: a `Literal` or an enum is a String, a free-form dict
is JSON, and a ledger quantity or an amount of money, which outgrow GraphQL's 32-bit Int
(a month of one GPU is 2.6e12 milli-GPU-ms), is a BigInt (sent as a decimal string). A resolver
validates its service's answer with the REST model (`shape`) and converts it: a field REST
adds appears here too, and a drift between the two cannot happen unnoticed (the SDL test).
"""

from __future__ import annotations

import enum
import types
import typing
from datetime import datetime
from typing import Any, NewType

import strawberry
from graphql import IntValueNode, StringValueNode
from pydantic import BaseModel, ValidationError
from strawberry.experimental.pydantic import type as pydantic_type
from strawberry.scalars import JSON

from app.core.errors import ValidationFailed
from app.core.schemas import PerCurrencyMarker, text_error

BigInt = NewType("BigInt", int)


# The schema maps it (StrawberryConfig.scalar_map).
def _big(value: Any) -> int:
    """An integer, or its decimal text: never a float, a boolean or anything else (money is
    not rounded on the way in)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit() and value.isascii():
        return int(value)
    raise ValueError(f"BigInt is an integer or its decimal text, not {value!r}.")


def _big_literal(node: Any, _variables: Any = None) -> int:
    if isinstance(node, IntValueNode | StringValueNode):
        return _big(int(node.value) if isinstance(node, IntValueNode) else node.value)
    raise ValueError("BigInt is an integer or its decimal text.")


BIG_INT = strawberry.scalar(
    name="BigInt",
    description="An integer past 32 bits (quantities, money in minor units): a decimal string",
    serialize=str,
    parse_value=_big,
    parse_literal=_big_literal,
)

# Integer fields that count milli-GPU-milliseconds, money or bytes: BigInt wherever they are.
MONEY = frozenset({"amount", "unit_amount", "spent", "spend_limit", "used", "limit", "size_bytes"})


@strawberry.type(description="An amount of money: minor units of one currency")
class Money:
    currency: str
    amount: BigInt  # type: ignore[valid-type]


# Per model, its fields that REST gives as a map of money per currency (`PerCurrency`) and
# GraphQL as a list of Money: `shape` converts them.
_PER_CURRENCY: dict[type[BaseModel], list[str]] = {}


def large(name: str) -> bool:
    return name.endswith("milli_gpu_ms") or name in MONEY


_VIEWS: dict[type[BaseModel], type] = {}
# Nested models whose own name is taken by a hand-written type.
_RENAMED = {"PlacementOut": "PlannedPlacement", "GpuOut": "GpuRow"}


def _annotation(name: str, tp: Any, inputs: bool = False) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _annotation(name, args[0], inputs) if len(args) == 1 else JSON
        return inner | None if len(args) < len(typing.get_args(tp)) else inner
    if origin is typing.Literal:
        return str
    if origin is list:
        return list[_annotation(name, typing.get_args(tp)[0], inputs)]  # type: ignore[misc]
    if origin is dict or tp is dict or tp is Any:
        return JSON
    if typing.get_origin(tp) is typing.Annotated:
        return _annotation(name, typing.get_args(tp)[0], inputs)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return input_view(tp) if inputs else view(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return str
    if getattr(tp, "__module__", "") == "pydantic.types" and "Datetime" in tp.__name__:
        return datetime  # AwareDatetime...: the model checks the offset
    if tp is int and large(name):
        return BigInt
    if tp in (str, int, float, bool, datetime) or isinstance(tp, type):
        return tp
    raise TypeError(f"No GraphQL type for {name}: {tp!r}")


def view(model: type[BaseModel], name: str | None = None, description: str | None = None) -> Any:
    """The Strawberry type for a REST response model (one per model, nested ones included)."""
    if model in _VIEWS:
        return _VIEWS[model]
    gql_name = name or _RENAMED.get(model.__name__) or model.__name__.removesuffix("Out")
    namespace: dict[str, Any] = {"__annotations__": {}}
    for field, info in model.model_fields.items():
        if any(isinstance(m, PerCurrencyMarker) for m in info.metadata):
            _PER_CURRENCY.setdefault(model, []).append(field)
            namespace["__annotations__"][field] = list[Money]
        else:
            namespace["__annotations__"][field] = _annotation(field, info.annotation)
        if info.alias and info.alias != field:
            namespace[field] = strawberry.field(name=info.alias, description=info.description)
    cls = type(gql_name, (), namespace)
    made = pydantic_type(
        model=model,
        all_fields=True,
        name=gql_name,
        description=description or (model.__doc__ or "").strip() or None,
    )(cls)
    _VIEWS[model] = made
    return made


def shape(model: type[BaseModel], value: Any) -> Any:
    """A service's answer (a dict or rows) as REST returns it, then as the GraphQL view."""
    made = view(model)
    valid = model.model_validate(value)
    money = {
        field: [{"currency": c, "amount": a} for c, a in sorted(getattr(valid, field).items())]
        for field in _PER_CURRENCY.get(model, ())
    }
    return made.from_pydantic(valid, money or None)


_INPUTS: dict[type[BaseModel], type] = {}


def input_view(model: type[BaseModel], name: str | None = None) -> Any:
    """The Strawberry input type for a REST request model. Its fields are as loose as GraphQL
    allows (a `Literal` is a String, an optional field may be left out): the pydantic model
    validates (`parse`), so the rules, defaults and messages are REST's."""
    if model in _INPUTS:
        return _INPUTS[model]
    gql_name = name or model.__name__.removesuffix("In").removesuffix("Create") + "Input"
    namespace: dict[str, Any] = {"__annotations__": {}}
    for field, info in model.model_fields.items():
        tp = _annotation(field, info.annotation, inputs=True)
        if not info.is_required():
            tp = tp | None
            namespace[field] = strawberry.field(
                default=strawberry.UNSET, description=info.description
            )
        elif info.description:
            namespace[field] = strawberry.field(description=info.description)
        namespace["__annotations__"][field] = tp
    made = strawberry.input(
        type(gql_name, (), namespace),
        name=gql_name,
        description=(model.__doc__ or "").strip() or None,
    )
    _INPUTS[model] = made
    return made


def _plain(value: Any) -> Any:
    """The input as REST's JSON body would carry it (instants as RFC 3339 text)."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if hasattr(value, "__strawberry_definition__"):
        return {
            k: _plain(v)
            for k, v in vars(value).items()
            if v is not strawberry.UNSET and not k.startswith("_")
        }
    return value


def parse(model: type[BaseModel], value: Any) -> Any:
    """The GraphQL input as the REST model (pydantic's ValidationError if it is not valid)."""
    return model.model_validate(_plain(value))


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def field_errors(exc: ValidationError) -> list[dict[str, Any]]:
    """The input's faults (`parse`'s ValidationError) as REST's 422 names them: each field's
    path from `input` (GraphQL's camelCase names) and what is wrong with it."""
    return [
        {
            "path": ["input", *[camel(p) if isinstance(p, str) else str(p) for p in err["loc"]]],
            "message": err["msg"],
        }
        for err in exc.errors()
    ]


def text_args(**values: Any) -> None:
    """Free-text arguments as REST takes free text: no NUL, no blank at either end (a 422-like
    `validation_error` naming the argument, never the database's refusal)."""
    for name, value in values.items():
        error = text_error(value) if value is not None else None
        if error:
            raise ValidationFailed(f"{camel(name)}: {error}.", code="validation_error")
