"""The portal page (portal/, built by Vite into app/portal/dist by `make run` and `make test`),
served by the API itself: one origin, so its session cookie is SameSite=Strict and its
GraphQL, REST session calls and websocket need no CORS. Nothing comes from a CDN."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse, Response

from app.core.errors import AppError, NotFound
from app.portal import DIST

# The page runs only its own scripts and styles and talks only to its origin (fetch and the
# GraphQL websocket); no one may frame it.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}

router = APIRouter(include_in_schema=False)


class PortalNotBuilt(AppError):
    status, code, title = 503, "portal_not_built", "The portal is not built"


def _index() -> Response:
    index = DIST / "index.html"
    if not index.is_file():
        raise PortalNotBuilt(
            "The portal's page is built by `make run` (or `make portal`); this install has none."
        )
    return FileResponse(index, headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})


@router.get("/")
def root() -> Response:
    return RedirectResponse("/portal/", status_code=307)


@router.get("/portal")
@router.get("/portal/")
def portal() -> Response:
    return _index()


@router.get("/portal/{path:path}")
def portal_path(path: str) -> Response:
    """A built asset (hashed names: cached for good), else the page itself: the page routes
    /portal/dashboard, /portal/workloads/<id> and the rest in the browser."""
    if path.startswith("assets/"):
        asset = (DIST / path).resolve()
        if asset.is_file() and asset.is_relative_to(DIST.resolve()):
            return FileResponse(
                asset,
                headers={
                    **SECURITY_HEADERS,
                    "Cache-Control": "public, max-age=31536000, immutable",
                },
            )
        raise NotFound(f"No portal asset {path}.", code="not_found")
    return _index()
