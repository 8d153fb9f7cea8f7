"""The fleet file: parsing (YAML or JSON) with line numbers, and whole-document validation.

Nothing here touches the database: a document is either entirely valid (and normalised into
a plain dict the import task applies) or rejected with every error located by line and field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, StrictInt, ValidationError, model_validator

from app.core.errors import format_loc
from app.core.schemas import StrictModel
from app.models.fleet import NodeState
from app.placement.catalog import GPU_MODELS, RACK_KINDS, RackKindSpec

Name = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
]


class NodeSpec(StrictModel):
    name: Name
    gpu_model: str | None = Field(
        None, max_length=32, description="Defaults to the rack's gpu_model."
    )
    gpus: int | None = Field(
        None, ge=1, le=16, description="Defaults to the rack kind's GPUs per node."
    )
    cpus: float | None = Field(None, gt=0, le=4096)
    memory_gib: float | None = Field(None, gt=0, le=65536)
    state: NodeState = NodeState.ready
    mig_gpus: list[Annotated[StrictInt, Field(ge=0, le=71)]] = Field(
        default_factory=list, max_length=72, description="Indices of GPUs in MIG mode."
    )
    pool: Name | None = Field(None, description="Defaults to the rack's pool.")
    agent: bool = Field(
        False,
        description="Run by a node agent: it takes no work until its agent has joined, its "
        "inventory matches (or was adopted: `rackplane fleet join-token NODE --adopt`) and "
        "its bring-up burn-in passed.",
    )


class NodeTemplate(StrictModel):
    count: int = Field(..., ge=1, le=10_000)
    name_prefix: str = Field(
        ..., min_length=1, max_length=59, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
    )
    gpu_model: str | None = Field(None, max_length=32)
    cpus: float | None = Field(None, gt=0, le=4096)
    memory_gib: float | None = Field(None, gt=0, le=65536)
    mig_gpus: list[Annotated[StrictInt, Field(ge=0, le=71)]] = Field(
        default_factory=list, max_length=72
    )
    agent: bool = Field(False, description="Run by node agents (see a node's `agent`).")


class RackSpec(StrictModel):
    name: Name
    kind: Literal["nvl72", "hgx", "pcie"]
    block: Name | None = Field(None, description="Spine group; defaults to the rack's own name.")
    gpu_model: str | None = Field(
        None, max_length=32, description="Default GPU model of the rack's nodes."
    )
    pool: Name | None = Field(
        None, description="The pool of the rack's nodes (stacks and upgrades go by pool)."
    )
    nodes: list[NodeSpec] | None = None
    node_template: NodeTemplate | None = None

    @model_validator(mode="after")
    def _check(self) -> RackSpec:
        # A rack's gpu_model is checked in `validate`, where the error can name that field.
        if self.nodes is not None and self.node_template is not None:
            raise ValueError("give either nodes or node_template, not both")
        if self.kind != "nvl72" and self.nodes is None and self.node_template is None:
            raise ValueError(f"a {self.kind} rack needs nodes or a node_template")
        return self


class RegionSpec(StrictModel):
    name: Name
    racks: list[RackSpec] = Field(default_factory=list)


class FleetDocument(StrictModel):
    """A fleet file: regions -> racks -> nodes (GPUs are derived from each node's count)."""

    regions: list[RegionSpec] = Field(..., min_length=1)


class FleetDocumentError(Exception):
    def __init__(self, errors: list[dict[str, Any]]):
        super().__init__(f"{len(errors)} error(s) in fleet document")
        self.errors = errors


def _line_map(
    node: yaml.Node, path: tuple = (), out: dict | None = None
) -> dict[tuple, tuple[int, int]]:
    """Map every path in a composed YAML tree to its (line, column), 1-based."""
    out = {} if out is None else out
    out[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            k = key.value
            out[path + (k,)] = (key.start_mark.line + 1, key.start_mark.column + 1)
            _line_map(value, path + (k,), out)
            out[path + (k,)] = (key.start_mark.line + 1, key.start_mark.column + 1)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_map(item, path + (i,), out)
    return out


def _locate(lines: dict[tuple, tuple[int, int]], loc: tuple) -> tuple[int, int] | None:
    loc = tuple(loc)
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return lines.get(())


# What a fleet file may be, before anything looks at its content: a fleet nests six levels
# (regions, racks, nodes, their fields, lists in them), and YAML aliases may be reused but not
# multiplied into a document larger than any real fleet (a "billion laughs" file).
MAX_DEPTH = 32
MAX_EXPANDED_NODES = 1_000_000


def _problem(message: str, line: int | None = None, column: int | None = None) -> dict:
    return {"field": "", "line": line, "column": column, "message": message}


def _too_deep() -> FleetDocumentError:
    return FleetDocumentError([_problem(f"the document nests deeper than {MAX_DEPTH} levels")])


def _check_json(data: Any) -> None:
    """Depth of parsed JSON, without recursion."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _check_yaml(root: yaml.Node) -> None:
    """Depth and size of a composed YAML graph as its aliases would expand it, each node
    counted once per place it stands (memoised, so checking costs the graph, not the
    expansion)."""
    size: dict[int, int] = {}
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        children = (
            [v for kv in node.value for v in kv]
            if isinstance(node, yaml.MappingNode)
            else node.value
            if isinstance(node, yaml.SequenceNode)
            else []
        )
        if done:
            size[id(node)] = 1 + sum(size[id(c)] for c in children)
            if size[id(node)] > MAX_EXPANDED_NODES:
                raise FleetDocumentError(
                    [
                        _problem(
                            f"the document expands to more than {MAX_EXPANDED_NODES:,} values "
                            "(through its aliases)",
                            node.start_mark.line + 1,
                            node.start_mark.column + 1,
                        )
                    ]
                )
            continue
        if id(node) in size:
            continue
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in size)


def _compose(text: str) -> yaml.Node | None:
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise _too_deep() from None


def parse(text: str, *, fmt: str | None = None) -> tuple[Any, dict[tuple, tuple[int, int]]]:
    """Parse YAML or JSON text. Returns (data, line map). Raises FleetDocumentError."""
    if fmt == "json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise FleetDocumentError(
                [_problem(f"invalid JSON: {e.msg}", e.lineno, e.colno)]
            ) from None
        except RecursionError:
            raise _too_deep() from None
        _check_json(data)
        try:  # JSON is YAML: recover line numbers where the YAML parser agrees.
            node = _compose(text)
            return data, (_line_map(node) if node is not None else {})
        except (yaml.YAMLError, FleetDocumentError):
            return data, {}
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise _too_deep() from None
        if node is None:
            return None, {}
        _check_yaml(node)
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        raise FleetDocumentError(
            [
                _problem(
                    f"invalid YAML: {e.problem}",
                    mark.line + 1 if mark else None,
                    mark.column + 1 if mark else None,
                )
            ]
        ) from None
    except yaml.YAMLError as e:
        raise FleetDocumentError([_problem(f"invalid YAML: {e}")]) from None
    finally:
        loader.dispose()
    return data, _line_map(node)


class _Errors:
    """The problems found so far, each located by field path and, where the line map knows
    it, by line and column. Called with a field path and a message, it records one."""

    def __init__(self, lines: dict[tuple, tuple[int, int]]):
        self.lines = lines
        self.items: list[dict[str, Any]] = []

    def __call__(self, loc: tuple, message: str) -> None:
        pos = _locate(self.lines, loc)
        self.items.append(
            {
                "field": format_loc(loc),
                "line": pos[0] if pos else None,
                "column": pos[1] if pos else None,
                "message": message,
            }
        )


def validate(data: Any, lines: dict[tuple, tuple[int, int]] | None = None) -> dict[str, Any]:
    """Validate a parsed document whole and return its normalised form (every node explicit).

    Raises FleetDocumentError listing every problem, each with field path and line.
    """
    err = _Errors(lines or {})
    doc = _schema(data, err)
    regions_seen: set[str] = set()
    nodes_seen: dict[str, tuple] = {}
    out_regions = []
    for ri, region in enumerate(doc.regions):
        if region.name in regions_seen:
            err(("regions", ri, "name"), f"region {region.name!r} appears twice")
        regions_seen.add(region.name)
        racks_seen: set[str] = set()
        out_racks = []
        for ki, rack in enumerate(region.racks):
            rloc = ("regions", ri, "racks", ki)
            if rack.name in racks_seen:
                err(rloc + ("name",), f"rack {rack.name!r} appears twice in region {region.name!r}")
            racks_seen.add(rack.name)
            out_racks.append(_rack(rack, rloc, nodes_seen, err))
        out_regions.append({"name": region.name, "racks": out_racks})
    if err.items:
        raise FleetDocumentError(err.items)
    return {"regions": out_regions}


def _schema(data: Any, err: _Errors) -> FleetDocument:
    """The document's shape, field by field; raises FleetDocumentError with every mismatch."""
    if not isinstance(data, dict):
        err((), "the fleet document must be a mapping with a `regions` list")
        raise FleetDocumentError(err.items)
    try:
        return FleetDocument.model_validate(data)
    except ValidationError as e:
        for item in e.errors():
            loc = tuple(
                p for p in item["loc"] if not (isinstance(p, str) and p.startswith("function-"))
            )
            err(loc, item["msg"])
        raise FleetDocumentError(err.items) from None


def _rack(
    rack: RackSpec, rloc: tuple, nodes_seen: dict[str, tuple], err: _Errors
) -> dict[str, Any]:
    """A rack normalised, its nodes made explicit; its problems (and its nodes') recorded."""
    spec = RACK_KINDS[rack.kind]
    rack_model = rack.gpu_model or spec.gpu_models[0]
    rack_model_ok = rack_model in spec.gpu_models
    if not rack_model_ok:
        err(
            rloc + ("gpu_model",),
            f"gpu_model {rack_model!r} is not sold in {rack.kind} racks "
            f"(allowed: {', '.join(spec.gpu_models)})",
        )
    nodes = _rack_nodes(rack, rloc, spec)
    if spec.nodes_per_rack is not None and len(nodes) != spec.nodes_per_rack:
        err(
            rloc + ("nodes",),
            f"an {rack.kind} rack has exactly {spec.nodes_per_rack} compute "
            f"trays; got {len(nodes)}",
        )
    out_nodes = [
        _node(n, nloc, rack.kind, spec, rack_model, rack_model_ok, nodes_seen, err)
        for nloc, n in nodes
    ]
    return {
        "name": rack.name,
        "kind": rack.kind,
        "block": rack.block or rack.name,
        "nodes": out_nodes,
    }


def _rack_nodes(
    rack: RackSpec, rloc: tuple, spec: RackKindSpec
) -> list[tuple[tuple, dict[str, Any]]]:
    """A rack's nodes as (where they are written, fields), from its list, its template, or
    (an nvl72 rack listing none) its compute trays."""
    nodes: list[tuple[tuple, dict[str, Any]]] = []
    if rack.node_template is not None:
        t = rack.node_template
        for i in range(t.count):
            nodes.append(
                (
                    rloc + ("node_template",),
                    {
                        "name": f"{t.name_prefix}{i + 1:03d}",
                        "gpu_model": t.gpu_model,
                        "gpus": None,
                        "cpus": t.cpus,
                        "memory_gib": t.memory_gib,
                        "state": "ready",
                        "mig_gpus": list(t.mig_gpus),
                        "pool": rack.pool,
                        "agent": t.agent,
                    },
                )
            )
    elif rack.nodes is not None:
        for ni, n in enumerate(rack.nodes):
            fields = n.model_dump(mode="json")
            fields["pool"] = fields["pool"] or rack.pool
            nodes.append((rloc + ("nodes", ni), fields))
    else:  # nvl72 with no nodes listed: its 18 compute trays
        for i in range(spec.nodes_per_rack or 0):
            nodes.append(
                (
                    rloc,
                    {
                        "name": f"{rack.name}-tray{i + 1:02d}",
                        "gpu_model": None,
                        "gpus": None,
                        "cpus": None,
                        "memory_gib": None,
                        "state": "ready",
                        "mig_gpus": [],
                        "pool": rack.pool,
                        "agent": False,
                    },
                )
            )
    return nodes


def _node(
    n: dict[str, Any],
    nloc: tuple,
    kind: str,
    spec: RackKindSpec,
    rack_model: str,
    rack_model_ok: bool,
    nodes_seen: dict[str, tuple],
    err: _Errors,
) -> dict[str, Any]:
    """A node normalised against its rack (`kind`, `spec`, the rack's GPU model and whether
    that model was valid); its problems recorded, a name already seen among them."""
    model = n["gpu_model"] or rack_model
    gpus = n["gpus"] or spec.gpus_per_node
    if n["gpu_model"] is None and not rack_model_ok:
        pass  # the rack's gpu_model is wrong, and said so once, at the rack's field
    elif model not in GPU_MODELS:
        err(
            nloc + ("gpu_model",),
            f"unknown GPU model {model!r} (known: {', '.join(GPU_MODELS)})",
        )
    elif model not in spec.gpu_models:
        err(nloc + ("gpu_model",), f"{model} is not sold in {kind} racks")
    if gpus != spec.gpus_per_node and gpus not in spec.other_gpu_counts:
        allowed = sorted((spec.gpus_per_node, *spec.other_gpu_counts))
        counts = (
            f"{allowed[0]} to {allowed[-1]}"
            if len(allowed) > 2 and allowed == list(range(allowed[0], allowed[-1] + 1))
            else " or ".join(str(c) for c in (spec.gpus_per_node, *spec.other_gpu_counts))
        )
        err(
            nloc + ("gpus",),
            f"{kind} nodes have {counts} GPUs; got {gpus}",
        )
    bad_mig = [i for i in n["mig_gpus"] if i >= gpus]
    if bad_mig:
        err(
            nloc + ("mig_gpus",),
            f"GPU indices {bad_mig} do not exist on a {gpus}-GPU node",
        )
    if n["name"] in nodes_seen:
        err(
            nloc + ("name",),
            f"node {n['name']!r} appears twice (first at {format_loc(nodes_seen[n['name']])})",
        )
    nodes_seen.setdefault(n["name"], nloc)
    return {
        "name": n["name"],
        "gpu_model": model,
        "gpus": gpus,
        "cpu_milli": int(round((n["cpus"] or spec.default_cpu_milli / 1000) * 1000)),
        "memory_mib": int(round(n["memory_gib"] * 1024))
        if n["memory_gib"]
        else spec.default_memory_mib,
        "state": n["state"],
        "mig_gpus": sorted(set(n["mig_gpus"])),
        "pool": n["pool"],
        "agent": bool(n.get("agent")),
    }


def load(text: str, *, fmt: str | None = None) -> dict[str, Any]:
    data, lines = parse(text, fmt=fmt)
    return validate(data, lines)


def summarize(doc: dict[str, Any]) -> dict[str, int]:
    racks = [r for reg in doc["regions"] for r in reg["racks"]]
    nodes = [n for r in racks for n in r["nodes"]]
    return {
        "regions": len(doc["regions"]),
        "racks": len(racks),
        "nodes": len(nodes),
        "gpus": sum(n["gpus"] for n in nodes),
    }
