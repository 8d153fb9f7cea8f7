"""Chaos experiments, for operators: the experiments, one's report (per fault, the times to
detect, quarantine, requeue and run again; the invariants), and stopping one. The same service
calls as REST's /v1/admin/chaos routes."""

from __future__ import annotations

import strawberry

from app.chaos import service as chaos
from app.chaos.inject import stop
from app.chaos.report import experiment_view
from app.chaos.schemas import (
    ExperimentOut,
    ExperimentState,
    ExperimentSummaryOut,
    FaultReport,
    InjectionOut,
    Invariants,
)
from app.core.db import get_or_404
from app.core.errors import ValidationFailed
from app.graphql.context import Info
from app.graphql.pagination import Connection, connection, page_params
from app.graphql.permissions import IsOperator
from app.graphql.results import result_union, run_mutation
from app.graphql.views import shape, view
from app.models.chaos import ChaosExperiment
from app.tenancy.principal import require_platform

# The report's parts first, so their names say whose they are.
view(InjectionOut, "ChaosInjection", "A fault injected on a GPU (or node), and when undone")
view(FaultReport, "ChaosFaultReport", "Per fault: what the health loop did, and how fast")
view(Invariants, "ChaosInvariants", "What must never happen, counted over the experiment")
ChaosExperimentView = view(
    ExperimentOut, "ChaosExperiment", "A chaos experiment, its injections and its report"
)
ChaosExperimentSummaryView = view(
    ExperimentSummaryOut, "ChaosExperimentSummary", "A chaos experiment, without its report"
)
ChaosExperimentResult = result_union("ChaosExperimentResult", ChaosExperimentView)


@strawberry.type
class ChaosQuery:
    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: chaos experiments, oldest first, in one state if asked "
        "(REST: GET /v1/admin/chaos/experiments); each one's report: `chaosExperiment`",
    )
    def chaos_experiments(
        self,
        info: Info,
        first: int = 50,
        after: str | None = None,
        state: str | None = None,
    ) -> Connection[ChaosExperimentSummaryView]:  # type: ignore[valid-type]
        try:
            st = ExperimentState(state).value if state is not None else None
        except ValueError:
            raise ValidationFailed(
                f"No experiment state {state!r}.", code="validation_error"
            ) from None
        rows, nxt = chaos.list_experiments(
            info.context.session, page_params(first, after), state=st
        )
        return connection(rows, lambda x: shape(ExperimentSummaryOut, x), nxt)

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: a chaos experiment and its report: per fault, the times to "
        "detect, quarantine, requeue and run again; the invariants "
        "(REST: GET /v1/admin/chaos/experiments/{id})",
    )
    def chaos_experiment(self, info: Info, id: strawberry.ID) -> ChaosExperimentView:  # type: ignore[valid-type]
        session = info.context.session
        exp = get_or_404(session, ChaosExperiment, str(id), what="experiment")
        return shape(ExperimentOut, experiment_view(session, exp))


@strawberry.type
class ChaosMutation:
    @strawberry.mutation(
        description="Operators: stop a chaos experiment and undo what it injected (stopping a "
        "stopped one changes nothing). REST: POST /v1/admin/chaos/experiments/{id}/stop"
    )
    def stop_chaos_experiment(self, info: Info, id: strawberry.ID) -> ChaosExperimentResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            exp = get_or_404(
                ctx.session, ChaosExperiment, str(id), what="experiment", for_update=True
            )
            stop(ctx.session, exp)
            return {}, exp, shape(ExperimentOut, experiment_view(ctx.session, exp))

        return run_mutation(info, "stopChaosExperiment", act)
