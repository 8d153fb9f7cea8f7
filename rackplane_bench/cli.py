"""`rackplane sim ...` and `rackplane bench ...`: trace replays and speed benchmarks.

The two typer apps, mounted by app/cli through the `rackplane.cli` entry points (pyproject.toml).
Each command is a module of rackplane_bench/commands, imported only when that command runs or
its group's help lists it: app/cli loads these apps on every `rackplane` command, and importing
all the commands (scipy, matplotlib, the benchmarks' clients) would add most of a second of CPU
to each, `rackplane --help` included.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

import typer
from typer.core import TyperGroup

# A group's commands, in the order its help lists them: name -> module of
# rackplane_bench.commands, which has a one-command typer app `cli`.
SIM_COMMANDS = {
    "openb": "sim_openb",
    "philly": "sim_philly",
    "faults": "sim_faults",
    "upgrade": "sim_upgrade",
    "mig": "sim_mig",
}
BENCH_COMMANDS = {
    "placement": "bench_placement",
    "lifecycle": "bench_lifecycle",
    "graphql": "bench_graphql",
    "portal": "bench_portal",
    "api": "bench_api",
    "metering": "bench_metering",
    "telemetry": "bench_telemetry",
    "recovery": "bench_recovery",
    "agents": "bench_agents",
    "failover": "bench_failover",
    "ddp": "bench_ddp",
    "instances": "bench_instances",
    "serve": "bench_serve",
}


class LazyCommands(Mapping[str, Any]):
    """A group's click commands by name; each one's module is imported when it is first asked
    for (the names alone, for a mistyped command's suggestions, import nothing)."""

    def __init__(self, modules: Mapping[str, str]) -> None:
        self.modules = modules
        self.loaded: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self.loaded:
            module = importlib.import_module(f"rackplane_bench.commands.{self.modules[name]}")
            self.loaded[name] = typer.main.get_command(module.cli)
        return self.loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)


class LazyGroup(TyperGroup):
    """A typer group whose commands are COMMANDS, loaded as they are asked for."""

    COMMANDS: Mapping[str, str] = {}

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**{**attrs, "commands": LazyCommands(self.COMMANDS)})


class SimGroup(LazyGroup):
    COMMANDS = SIM_COMMANDS


class BenchGroup(LazyGroup):
    COMMANDS = BENCH_COMMANDS


sim_cli = typer.Typer(
    cls=SimGroup,
    help="Replay public GPU-cluster traces through the placement engine.",
    no_args_is_help=True,
)
bench_cli = typer.Typer(
    cls=BenchGroup, help="Benchmarks: placement, lifecycle, metering.", no_args_is_help=True
)
