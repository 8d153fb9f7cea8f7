"""The outbox: messages and kicks written in a unit of work, sent after it commits.

Importing the package registers both senders with `core.db`'s after-commit hooks; each sends
only what it was given, so their order does not matter."""

from app.outbox import kicks, service

__all__ = ["kicks", "service"]
