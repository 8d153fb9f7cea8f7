"""The control plane's agent API (`/v1/agent`), over httpx, speaking `rackplane_wire`.

Each call is one HTTP request, retried (tenacity: exponential backoff with jitter) on what may
pass: connection errors and timeouts, 5xx, and 429 (after its Retry-After). What will not pass is
raised typed: 401 `CredentialRefused` (the agent stops, its runs left running), a refused join
token `JoinRefused`, 404 `RouteMissing`, other 4xx `ApiError`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

import httpx
import tenacity
from pydantic import BaseModel

from rackplane_agent import __version__
from rackplane_agent.logfmt import kv
from rackplane_wire import (
    Assignments,
    Inventory,
    InventoryVerdict,
    LogAck,
    LogBatch,
    RunEnv,
    StatusAck,
    StatusReport,
)

log = logging.getLogger("rackplane_agent.client")
M = TypeVar("M", bound=BaseModel)

PREFIX = "/v1/agent"
PROMETHEUS_TEXT = "text/plain; version=0.0.4"


class AgentError(Exception):
    pass


class ApiError(AgentError):
    """The control plane answered with a problem (RFC 9457) that retrying will not fix."""

    def __init__(self, status: int, code: str | None, detail: str, path: str = ""):
        self.status, self.code, self.detail, self.path = status, code, detail, path
        super().__init__(f"{status} {code or ''} {detail} ({path})".replace("  ", " "))


class CredentialRefused(ApiError):
    """401 on a node route: the node's credential was revoked (or never was)."""


class JoinRefused(ApiError):
    """401 on join: the join token is unknown, used or expired."""


class RouteMissing(ApiError):
    """404: the control plane has no such route (yet)."""


class TransientError(AgentError):
    """Connection errors, timeouts, 5xx, 429: worth another try, later."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A Retry-After header (seconds, or an HTTP date) in seconds from now."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    now_dt = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    return max(0.0, (when - now_dt).total_seconds())


def wait_duration(seconds: float) -> str:
    """`30` -> `30s`, `0.5` -> `500ms` (a Go duration, as Nomad's `wait`)."""
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{max(1, round(seconds * 1000))}ms"


class _WaitRetryAfter(tenacity.wait.wait_base):
    """Retry-After when the server gave one (capped), else exponential backoff with jitter."""

    def __init__(self, initial: float, maximum: float):
        self._max = maximum
        self._expo = tenacity.wait_exponential(multiplier=initial, max=maximum)
        self._jitter = tenacity.wait_random(0, initial)

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        if isinstance(exc, TransientError) and exc.retry_after is not None:
            return min(exc.retry_after, self._max)
        return min(self._max, self._expo(retry_state) + self._jitter(retry_state))


class Backoff:
    """Exponential backoff with jitter, for loops that retry by going round again."""

    def __init__(self, initial: float, maximum: float):
        self._wait = _WaitRetryAfter(initial, maximum)
        self._attempt = 0

    def next(self, exc: BaseException | None = None) -> float:
        self._attempt += 1
        state = tenacity.RetryCallState(None, None, (), {})  # type: ignore[arg-type]
        state.attempt_number = self._attempt
        if exc is not None:
            state.set_exception((type(exc), exc, exc.__traceback__))
        return self._wait(state)

    def reset(self) -> None:
        self._attempt = 0


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        raise ApiError(response.status_code, "bad_response", "not JSON") from None


def _parse(model: type[M], response: httpx.Response) -> M:
    try:
        return model.model_validate_json(response.content)
    except ValueError as exc:  # pydantic's ValidationError is one
        detail = f"{model.__name__}: {str(exc)[:300]}"
        raise ApiError(response.status_code, "bad_response", detail, str(response.url)) from None


def _problem(response: httpx.Response) -> tuple[str | None, str]:
    try:
        body = response.json()
    except ValueError:
        return None, response.text[:200]
    if not isinstance(body, dict):
        return None, str(body)[:200]
    detail = body.get("detail") or body.get("title") or ""
    return body.get("code"), str(detail)


class Client:
    def __init__(
        self,
        api: str,
        credential: str | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        timeout: float = 10.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        sleep: Callable[[float], Any] = time.sleep,
    ):
        self.api = api.rstrip("/")
        self.credential = credential
        self._timeout = timeout
        self._backoff = (backoff_initial, backoff_max)
        self._sleep = sleep
        self._http = httpx.Client(
            base_url=self.api,
            transport=transport,
            timeout=timeout,
            headers={"User-Agent": f"rackplane-agent/{__version__}"},
        )

    def close(self) -> None:
        self._http.close()

    # --- one request ---------------------------------------------------------------------

    def _send(
        self,
        method: str,
        path: str,
        *,
        auth: bool = True,
        content: bytes | str | None = None,
        content_type: str = "application/json",
        params: dict[str, Any] | None = None,
        timeout: httpx.Timeout | float | None = None,
    ) -> httpx.Response:
        headers = {}
        if content is not None:
            headers["Content-Type"] = content_type
        if auth:
            if not self.credential:
                raise CredentialRefused(401, "no_credential", "the agent has no credential", path)
            headers["Authorization"] = f"Bearer {self.credential}"
        try:
            response = self._http.request(
                method,
                path,
                content=content,
                params=params,
                headers=headers,
                timeout=timeout if timeout is not None else self._timeout,
            )
        except httpx.TransportError as exc:
            raise TransientError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        status = response.status_code
        if status < 400:
            return response
        if status == 429 or status >= 500:
            raise TransientError(
                f"{method} {path}: {status}",
                retry_after_seconds(response.headers.get("Retry-After")),
            )
        code, detail = _problem(response)
        if status == 401:
            raise (CredentialRefused if auth else JoinRefused)(status, code, detail, path)
        if status == 404:
            raise RouteMissing(status, code, detail, path)
        raise ApiError(status, code, detail, path)

    def _call(
        self,
        method: str,
        path: str,
        *,
        attempts: int | None = 1,
        stop_event: threading.Event | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """`_send`, retried on TransientError: `attempts` times, or (None) until it passes or
        `stop_event` is set; the last TransientError is raised when it gives up."""
        stop: tenacity.stop.stop_base = (
            tenacity.stop_never if attempts is None else tenacity.stop_after_attempt(attempts)
        )
        sleep = self._sleep
        if stop_event is not None:
            stop = stop | tenacity.stop_when_event_set(stop_event)
            sleep = stop_event.wait

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            wait = state.next_action.sleep if state.next_action else 0.0
            log.warning(
                kv(
                    "api_retry",
                    request=f"{method} {path}",
                    attempt=state.attempt_number,
                    wait_s=round(wait, 2),
                    error=exc,
                )
            )

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TransientError),
            wait=_WaitRetryAfter(*self._backoff),
            stop=stop,
            sleep=sleep,
            reraise=True,
            before_sleep=before_sleep,
        )
        return retrying(self._send, method, path, **kwargs)

    # --- the routes ----------------------------------------------------------------------

    def join(self, token: str, **retry: Any) -> dict[str, Any]:
        body = json.dumps({"token": token})
        response = self._call("POST", f"{PREFIX}/join", auth=False, content=body, **retry)
        joined = _json(response)
        if not isinstance(joined, dict) or not isinstance(joined.get("credential"), str):
            raise ApiError(response.status_code, "bad_response", "join answered no credential")
        self.credential = joined["credential"]
        return joined

    def node(self, **retry: Any) -> dict[str, Any]:
        return _json(self._call("GET", f"{PREFIX}/node", **retry))

    def put_inventory(self, inventory: Inventory, **retry: Any) -> InventoryVerdict:
        r = self._call("PUT", f"{PREFIX}/inventory", content=inventory.model_dump_json(), **retry)
        return _parse(InventoryVerdict, r)

    def assignments(self, index: int, wait: float, **retry: Any) -> Assignments:
        """A blocking query: answers when the node's desired state passes `index`, or after
        `wait` (the read timeout leaves the server room to answer)."""
        timeout = httpx.Timeout(self._timeout, read=wait + max(10.0, wait / 2))
        r = self._call(
            "GET",
            f"{PREFIX}/assignments",
            params={"index": index, "wait": wait_duration(wait)},
            timeout=timeout,
            **retry,
        )
        return _parse(Assignments, r)

    def status(self, report: StatusReport, **retry: Any) -> StatusAck:
        r = self._call("POST", f"{PREFIX}/status", content=report.model_dump_json(), **retry)
        return _parse(StatusAck, r)

    def logs(self, batch: LogBatch, **retry: Any) -> LogAck:
        r = self._call("POST", f"{PREFIX}/logs", content=batch.model_dump_json(), **retry)
        return _parse(LogAck, r)

    def run_env(self, workload_id: str, attempt: int, replica: int, **retry: Any) -> RunEnv:
        """The secret part of a run's environment, fetched as it starts."""
        path = f"{PREFIX}/runs/{workload_id}/{attempt}/{replica}/env"
        return _parse(RunEnv, self._call("GET", path, **retry))

    def telemetry(self, text: str, **retry: Any) -> None:
        self._call(
            "POST",
            f"{PREFIX}/telemetry",
            content=text.encode(),
            content_type=PROMETHEUS_TEXT,
            **retry,
        )
