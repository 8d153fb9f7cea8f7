"""Software stacks for operators: the same service functions as `/v1/admin/stacks`."""

from __future__ import annotations

import strawberry

from app.graphql.context import Info
from app.graphql.permissions import IsOperator
from app.graphql.results import result_union, run_mutation
from app.graphql.views import input_view, parse, shape, text_args, view
from app.stacks import service
from app.stacks.schemas import StackAssign, StackAssigned, StackCreate, StackList, StackOut
from app.tenancy.principal import require_platform

StackView = view(StackOut, "SoftwareStack", "Pinned driver, CUDA, NCCL, firmware... versions")
StackAssignedView = view(StackAssigned, "StackAssigned")
StackInput = input_view(StackCreate, "SoftwareStackInput")
StackAssignInput = input_view(StackAssign, "StackAssignInput")
StackResult = result_union("SoftwareStackResult", StackView)
StackAssignedResult = result_union("StackAssignedResult", StackAssignedView)


@strawberry.type
class StackQuery:
    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: the software stacks, by name (REST: GET /v1/admin/stacks)",
    )
    def software_stacks(self, info: Info) -> list[StackView]:  # type: ignore[valid-type]
        return shape(StackList, StackList(items=service.list_all(info.context.session))).items


@strawberry.type
class StackMutation:
    @strawberry.mutation(
        description="Operators: declare a software stack (REST: POST /v1/admin/stacks)"
    )
    def create_stack(self, info: Info, input: StackInput) -> StackResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            body = parse(StackCreate, input)
            out = service.create(ctx.session, body)
            return {"body": body}, out, shape(StackOut, out)

        return run_mutation(info, "createStack", act)

    @strawberry.mutation(
        description="Operators: declare that a pool's, a region's or named nodes run a stack "
        "(REST: POST /v1/admin/stacks/{name}/assignments)"
    )
    def assign_stack(
        self,
        info: Info,
        name: str,
        input: StackAssignInput,  # type: ignore[valid-type]
    ) -> StackAssignedResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            text_args(name=name)
            body = parse(StackAssign, input)
            out = service.assign(ctx.session, service.get(ctx.session, name), body)
            return {"stack": name, "body": body}, out, shape(StackAssigned, out)

        return run_mutation(info, "assignStack", act)
