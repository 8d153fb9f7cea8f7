"""Rackplane's placement core: pure decisions over a fleet snapshot (no I/O in this package)."""
