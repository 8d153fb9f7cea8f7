"""The health loop's decisions, carried out in the caller's transaction. This module is the
health package's front door; each room holds one part:

- `incidents.py`: `evaluate` takes a node's new fault signals (from telemetry, or a lost
  heartbeat), groups them into the node's incident (a burst: signals until the window passes
  without one) and classifies the incident by its worst row (`actions.py`, through
  `classify.py`);
- `response.py`: carries out what the incident now asks beyond what was already done: tell the
  owners (application errors), watch the GPU (suspect), or take GPUs out (quarantine), stop the
  work they held (a gang is one unit: every replica stops), requeue it ahead of its peers to
  resume from its last checkpoint, and ask the provider for a reset or a reboot;
- `breaker.py`: the circuit breaker caps what automatic quarantine may take out of a region or
  rack;
- `repairs.py`: repairs (`repair_step`) go repairing -> validating -> healthy, or out of
  service;
- `transitions.py`: every transition goes through `move`, which checks the state table and
  writes the history;
- `operators.py`: operators' quarantine, release and retire;
- `views.py`: what operators see (the fleet's health, a node's history);
- `pace.py`: workloads' step times (slow GPUs, noisy neighbours)."""

from __future__ import annotations

from app.health.breaker import breaker_holds, breaker_limits
from app.health.classify import describe, rule_of
from app.health.incidents import MAX_KEPT_SIGNALS, evaluate
from app.health.operators import OPERATOR_ACTIONS, act, operator_action
from app.health.pace import NOISY_SLOWDOWN, NOISY_UTIL, NoRanks, report_step_times, shared_pace
from app.health.repairs import repair_step, start_repair, start_validation
from app.health.response import Outcome
from app.health.transitions import FLEET_TOPIC, H, Where, move, where
from app.health.views import history, summary

__all__ = [
    "FLEET_TOPIC",
    "H",
    "MAX_KEPT_SIGNALS",
    "NOISY_SLOWDOWN",
    "NOISY_UTIL",
    "OPERATOR_ACTIONS",
    "NoRanks",
    "Outcome",
    "Where",
    "act",
    "breaker_holds",
    "breaker_limits",
    "describe",
    "evaluate",
    "history",
    "move",
    "operator_action",
    "repair_step",
    "report_step_times",
    "rule_of",
    "shared_pace",
    "start_repair",
    "start_validation",
    "summary",
    "where",
]
