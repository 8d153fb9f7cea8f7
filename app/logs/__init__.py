"""Workload logs: what node agents ship of each replica's output, and tenants' reads of it."""
