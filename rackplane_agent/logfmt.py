"""One log line per event, `event key=value ...` (logfmt), on stdlib logging."""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s level=%(levelname)s logger=%(name)s event=%(message)s"


def _value(v: object) -> str:
    s = str(v)
    if s == "" or any(c in s for c in ' "=\n\t'):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return s


def kv(event: str, **fields: object) -> str:
    """`kv("run_started", run="w.0.0", pid=12)` -> `run_started run=w.0.0 pid=12`."""
    parts = [event]
    parts += [f"{k}={_value(v)}" for k, v in fields.items() if v is not None]
    return " ".join(parts)


def setup(level: str = "INFO", stream=None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    root = logging.getLogger("rackplane_agent")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # httpx logs each request at INFO: too chatty for a long-poll loop.
    logging.getLogger("httpx").setLevel(logging.WARNING)
