"""GPU and node health: the states, and the only transitions allowed between them.

One table, as `workloads/lifecycle.py` has for workloads. The path of a fault:

    healthy -> suspect -> quarantined -> draining -> repairing -> validating -> healthy
                                  \\-> out_of_service (RMA; repeated faults; failed repairs)

- suspect: a warning (a watched signal). Work keeps running; new gangs avoid it; work that can
  checkpoint moves off at its next checkpoint.
- quarantined: a fatal fault. Nothing new lands on it; the work on it is stopped (draining).
- draining: work is being stopped; the repair starts when nothing holds it.
- repairing: the provider resets the GPU (seconds) or reboots the node (minutes).
- validating: repaired, being checked; a fault now sends it out of service.
- out_of_service: taken out for good until an operator returns it (after an RMA swap).
- unreachable (nodes only): the node agent stopped reporting; whatever its GPUs said last.

Who may move: `SYSTEM` (the health loop) along the fault path; `OPERATOR` too, plus by hand
quarantine, release (back to healthy, or to validating after out_of_service) and retire.
Every transition is an event with its cause (`models.HealthEvent`); a refused one is a 409.
"""

from __future__ import annotations

import enum

from app.core.errors import Conflict
from app.models.health import PLACEABLE as PLACEABLE  # the states placement may use
from app.models.health import Health

H = Health

# Out of the pool because of the health loop (what the circuit breaker counts and caps).
OUT = frozenset({H.quarantined, H.draining, H.repairing, H.validating, H.unreachable})


class Actor(str, enum.Enum):
    system = "system"
    operator = "operator"


SYS = frozenset({Actor.system, Actor.operator})
OPS = frozenset({Actor.operator})

# (from, to) -> who may make that move. A GPU uses every row but those touching `unreachable`.
TRANSITIONS: dict[tuple[Health, Health], frozenset[Actor]] = {
    # A warning: watch it.
    (H.healthy, H.suspect): SYS,
    (H.suspect, H.healthy): SYS,  # no new evidence within the watch window, or by hand
    # A fatal fault (or an operator's quarantine).
    (H.healthy, H.quarantined): SYS,
    (H.suspect, H.quarantined): SYS,
    (H.quarantined, H.draining): SYS,  # work on it is being stopped
    (H.quarantined, H.repairing): SYS,  # nothing held it: straight to repair
    (H.draining, H.repairing): SYS,
    (H.repairing, H.validating): SYS,
    (H.validating, H.healthy): SYS,
    # Repairs that fail, repeated faults, RMA-class faults, retirement.
    (H.healthy, H.out_of_service): SYS,
    (H.suspect, H.out_of_service): SYS,
    (H.quarantined, H.out_of_service): SYS,
    (H.draining, H.out_of_service): SYS,
    (H.repairing, H.out_of_service): SYS,
    (H.validating, H.out_of_service): SYS,
    # A worse fault while already on the way out: the repair starts over (e.g. a GPU reset
    # that turns into a node reboot).
    (H.repairing, H.quarantined): SYS,
    (H.validating, H.quarantined): SYS,
    (H.draining, H.quarantined): SYS,
    # Operators: release what the loop holds (their call: "I checked it"), bring a returned
    # GPU through validation after an RMA swap.
    (H.quarantined, H.healthy): OPS,
    (H.draining, H.healthy): OPS,
    (H.repairing, H.healthy): OPS,
    (H.out_of_service, H.validating): OPS,
    # Bring-up (and an upgrade): a node with an agent is validated (burned in) before it
    # takes work.
    (H.healthy, H.validating): SYS,
    # Nodes: the agent goes silent, and comes back (then validated before use).
    (H.healthy, H.unreachable): SYS,
    (H.suspect, H.unreachable): SYS,
    (H.quarantined, H.unreachable): SYS,
    (H.draining, H.unreachable): SYS,
    (H.validating, H.unreachable): SYS,
    (H.unreachable, H.validating): SYS,
    (H.unreachable, H.repairing): SYS,  # the provider power-cycles it
    (H.unreachable, H.out_of_service): SYS,
}
NODE_ONLY = frozenset({H.unreachable})


class InvalidHealthTransition(Conflict):
    code = "invalid_health_transition"
    title = "Invalid health transition"


def allowed(current: Health | str, to: Health | str, actor: Actor, *, node: bool) -> bool:
    cur, new = Health(current), Health(to)
    if not node and (cur in NODE_ONLY or new in NODE_ONLY):
        return False
    return actor in TRANSITIONS.get((cur, new), frozenset())


def check(current: Health | str, to: Health | str, actor: Actor, *, node: bool) -> None:
    """Raise InvalidHealthTransition unless `actor` may move a GPU (or node) from `current`
    to `to`; the error says what is allowed from here."""
    if allowed(current, to, actor, node=node):
        return
    cur, new = Health(current), Health(to)
    moves = sorted(
        b.value
        for (a, b), who in TRANSITIONS.items()
        if a == cur and actor in who and (node or b not in NODE_ONLY)
    )
    what = "node" if node else "GPU"
    raise InvalidHealthTransition(
        f"A {cur.value} {what} cannot become {new.value} by the {actor.value}; "
        f"allowed: {', '.join(moves) or 'none'}.",
        state=cur.value,
        requested=new.value,
    )
