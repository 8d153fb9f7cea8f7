"""A fault signal's row in the table (`actions.py`), and its plain words."""

from __future__ import annotations

from typing import Any

from app.health import actions
from app.health.actions import Action, Rule
from app.models.health import HealthIncident


def rule_of(signal: dict[str, Any]) -> Rule:
    kind, code = signal["signal"], signal.get("code")
    if kind == "xid":
        return actions.rule_for_xid(int(code))
    if kind == "recovery_action":
        return actions.rule_for_recovery(int(code)) or actions.rule_for_recovery(-1)  # type: ignore[return-value]
    rule = actions.SIGNALS.get(kind)
    if rule is None:
        return Rule(kind, None, Action.watch, f"unknown signal {kind}", "unknown")
    return rule


def describe(rule: Rule) -> str:
    """Plain words for a row: "Xid 79 (GPU has fallen off the bus)"."""
    if rule.signal == "xid":
        return f"Xid {rule.code} ({rule.what})"
    return rule.what


def rule_from_incident(inc: HealthIncident) -> Rule:
    if inc.signal == "xid" and inc.code is not None:
        return actions.rule_for_xid(inc.code)
    return Rule(inc.signal, inc.code, Action(inc.action), inc.what, "")
