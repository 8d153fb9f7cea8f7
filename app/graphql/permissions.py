"""Who may resolve a field, declared on the field (`permission_classes=[...]`) rather than
called at the top of each resolver. Each checks the caller as REST's dependencies do and
refuses with the same error (and code): a missing key, a key without the scope."""

from __future__ import annotations

from typing import Any

from strawberry.permission import BasePermission
from strawberry.types import Info

from app.tenancy.principal import require_platform, require_reader, require_tenant_scope


class IsOperator(BasePermission):
    """An operator's key (the platform scope)."""

    def has_permission(self, source: Any, info: Info, **kwargs: Any) -> bool:
        require_platform(info.context.auth)
        return True


class TenantRead(BasePermission):
    """A tenant's key with `read` (an active tenant's)."""

    def has_permission(self, source: Any, info: Info, **kwargs: Any) -> bool:
        require_tenant_scope(info.context.auth, "read")
        return True


class TenantReadAnyStatus(BasePermission):
    """A tenant's key with `read`, whatever the tenant's status (what it may still see)."""

    def has_permission(self, source: Any, info: Info, **kwargs: Any) -> bool:
        require_tenant_scope(info.context.auth, "read", allow_inactive=True)
        return True


class ReadsPrices(BasePermission):
    """A tenant's key with `read`, or an operator's (fields both may read: prices, capacity)."""

    def has_permission(self, source: Any, info: Info, **kwargs: Any) -> bool:
        require_reader(info.context.auth)
        return True
