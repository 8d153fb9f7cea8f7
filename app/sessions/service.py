"""Portal sign-in and sign-out: the browser's side of app/tenancy/auth.py."""

from __future__ import annotations

import secrets
from datetime import timedelta

from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import utcnow
from app.models.sessions import BrowserSession
from app.sessions.schemas import SessionOut
from app.tenancy.credentials import SESSION_PREFIX, csrf_token, session_hash
from app.tenancy.principal import AuthContext

TOKEN_BYTES = 32


def open_session(session: Session, auth: AuthContext, user_agent: str) -> tuple[str, SessionOut]:
    """A new session acting as `auth`'s key: (its token, for the cookie only; what the page may
    know of it)."""
    if auth.key_id.int == 0:  # the system context is no key
        raise ValueError("the system context cannot sign in")
    s = get_settings()
    now = utcnow()
    token = SESSION_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)
    row = BrowserSession(
        token_hash=session_hash(token),
        key_id=auth.key_id,
        tenant_id=auth.tenant_id,
        created_at=now,
        last_seen_at=now,
        expires_at=now + timedelta(seconds=s.session_max_seconds),
        user_agent=user_agent[:200],
    )
    session.add(row)
    session.flush()
    return token, describe(row, auth, token)


def describe(row: BrowserSession, auth: AuthContext, token: str) -> SessionOut:
    return SessionOut(
        id=row.id,
        tenant_id=row.tenant_id,
        operator=auth.is_platform,
        key_prefix=auth.key_prefix,
        scopes=sorted(auth.scopes),
        created_at=row.created_at,
        expires_at=row.expires_at,
        idle_timeout_seconds=get_settings().session_idle_seconds,
        csrf_token=csrf_token(token),
    )


def find(session: Session, token: str) -> BrowserSession | None:
    return session.scalar(
        select(BrowserSession).where(BrowserSession.token_hash == session_hash(token))
    )


def close(session: Session, token: str) -> bool:
    """Sign out: the session ends now (everywhere at once: the auth cache hears of it)."""
    row = find(session, token)
    if row is None or row.revoked_at is not None:
        return False
    row.revoked_at = utcnow()
    return True


def purge(session: Session) -> int:
    """Forget sessions that ended more than a day ago (their rows only help an audit for so
    long; the audit log keeps the sign-ins)."""
    s = get_settings()
    now = utcnow()
    cutoff = now - timedelta(days=1)
    result = session.execute(
        delete(BrowserSession).where(
            or_(
                BrowserSession.expires_at < cutoff,
                BrowserSession.revoked_at < cutoff,
                BrowserSession.last_seen_at < cutoff - timedelta(seconds=s.session_idle_seconds),
            )
        )
    )
    return result.rowcount or 0
