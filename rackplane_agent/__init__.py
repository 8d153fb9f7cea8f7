"""Rackplane's node agent: joins the control plane, reports the host's GPUs, runs what the node
is assigned and reports how it goes (shaped like HashiCorp Nomad's client).

Kept import-light: `rackplane_agent.shim` runs in front of every workload process and imports
this package first, so nothing here pulls in httpx, pydantic or NVML.
"""

__version__ = "0.1.0"
