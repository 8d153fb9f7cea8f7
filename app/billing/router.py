"""The price book (operators write it, everyone reads it) and tenants' bills."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Depends, Query
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.billing import service
from app.billing.models import Price
from app.billing.schemas import BillingSummary, PriceIn, PriceList, PriceOut
from app.core.db import session_dependency, utcnow
from app.metering.service import visible_to
from app.tenancy.auth import AuthContext, platform, tenant_read

router = APIRouter(prefix="/v1", tags=["billing"])
admin = APIRouter(prefix="/v1/admin", tags=["admin: billing"])


def _prices(session: Session) -> dict:
    stmt = select(Price).order_by(
        Price.gpu_model, Price.shape, Price.tier, Price.region, Price.plan, Price.version
    )
    return {"items": list(session.scalars(stmt))}


@router.get("/prices", response_model=PriceList, summary="The price book, every version")
def prices(
    auth: AuthContext = Depends(tenant_read), session: Session = Depends(session_dependency)
) -> dict:
    return _prices(session)


@admin.get("/prices", response_model=PriceList, summary="The price book, every version")
def admin_prices(
    auth: AuthContext = Depends(platform), session: Session = Depends(session_dependency)
) -> dict:
    return _prices(session)


@admin.post(
    "/prices",
    status_code=201,
    response_model=PriceOut,
    summary="Add a price version (effective from a date; earlier versions stay)",
)
def add_price(
    body: PriceIn,
    auth: AuthContext = Depends(platform),
    session: Session = Depends(session_dependency),
) -> Price:
    return service.create_price(session, **body.model_dump())


def _summary(session: Session, auth: AuthContext, period: str, until: datetime | None) -> dict:
    start, end = service.period_window(period)
    now = utcnow()
    accrued = min(end, until or now)
    priced = service.price_usage(session, visible_to(auth), start, end, now=accrued)
    return {
        "period": period,
        "start": start,
        "end": end,
        "accrued_until": accrued,
        "lines": [service.line_out(ln) for ln in priced.lines],
        "totals": priced.totals(),
        "unpriced_milli_gpu_ms": priced.unpriced,
    }


@router.get(
    "/billing/summary",
    response_model=BillingSummary,
    summary="Your bill for a month: line items per SKU, tier, region, plan and price version",
)
def summary(
    period: str = Query(..., description="The month, e.g. 2026-11"),
    auth: AuthContext = Depends(tenant_read),
    session: Session = Depends(session_dependency),
) -> dict:
    return _summary(session, auth, period, None)


@router.get(
    "/billing/upcoming",
    response_model=BillingSummary,
    summary="Upcoming invoice preview: this month so far, running work accrued up to now",
)
def upcoming(
    auth: AuthContext = Depends(tenant_read), session: Session = Depends(session_dependency)
) -> dict:
    now = utcnow()
    return _summary(session, auth, f"{now:%Y-%m}", now)
