"""Inference endpoints (issue 47): replicas that serve, scaled with their traffic."""
