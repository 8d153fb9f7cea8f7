"""One scheduling cycle: the state of state.py with every layer's operations (admission,
preemption, reservations), the one object all phases read and change over the same snapshot
and undo log."""

from __future__ import annotations

from app.placement.queueing.backfill import _Reserving
from app.placement.queueing.preemption import _Evicting


class _Cycle(_Reserving, _Evicting):
    """The cycle every phase runs on: state, admission, eviction and reservations."""

    def finish(self) -> None:
        self.unhold()
        self.result.reconfigurations = list(self.plan.reconfigurations)
        self.result.reservations = [res for res, _ in self.reserved.values()]
