"""Trace replays that drive the placement engine (never a copy of it)."""
