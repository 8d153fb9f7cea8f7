"""`python -m rackplane_agent`: the node agent's command line.

    python -m rackplane_agent --api https://rackplane.example --token rpj_...
        [--state-dir DIR] [--work-dir DIR] [--run-uids FIRST-LAST | --same-user]
        [--inventory FILE] [--address HOST] [--runtime process|podman|vm]
        [--dcgm-exporter URL] [--poll-wait 30] [--max-output-mib 16] [--ssh-ports 22000-22999]
        [--serve-ports 31000-31999]
        [--volumes-dir DIR] [--shared-volumes-dir DIR] [--data-interface IFACE]
        [--log-level INFO]
    python -m rackplane_agent stop [--state-dir DIR] [--kill | --power-cut]

Exit codes: 0 stopped (SIGTERM/SIGINT), 1 an unexpected error, 2 cannot start (no join token,
a refused token, no inventory, another agent on the state directory), 3 the control plane
refused the node's credential. In every case the runs are left running.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from rackplane_agent import __version__
from rackplane_agent import stop as stop_cmd
from rackplane_agent.config import (
    EXIT_USAGE,
    AgentConfig,
    default_state_dir,
    parse_port_range,
    parse_uid_range,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rackplane-agent",
        description="Rackplane's node agent: joins the control plane, reports this host's "
        "GPUs and runs the work assigned to the node.",
    )
    p.add_argument("--api", required=True, help="the control plane's base URL")
    p.add_argument(
        "--token",
        default=os.environ.get("RACKPLANE_JOIN_TOKEN"),
        help="a join token (rpj_...), used once when the node has no credential yet "
        "(default: $RACKPLANE_JOIN_TOKEN)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the credential and the runs are kept "
        "(default: $RACKPLANE_AGENT_STATE_DIR, else /var/lib/rackplane-agent)",
    )
    p.add_argument(
        "--inventory",
        type=Path,
        help="a YAML file of the host's GPUs, used when NVML does not answer",
    )
    p.add_argument("--address", help="how other hosts reach this one (default: its FQDN)")
    p.add_argument(
        "--runtime",
        action="append",
        choices=["process", "podman", "vm"],
        help="a runtime to offer (repeatable; default: process, and podman and vm when "
        "installed); process is always offered",
    )
    _places(p)
    _runs(p)
    p.add_argument("--dcgm-exporter", metavar="URL", help="dcgm-exporter's /metrics URL")
    p.add_argument(
        "--poll-wait", type=float, default=30.0, help="seconds a poll for assignments may wait"
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument("--version", action="version", version=f"rackplane-agent {__version__}")
    return p


def _places(p: argparse.ArgumentParser) -> None:
    """Where runs work and tenants' volumes live, and the gang's network interface."""
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where runs work, each in its own directory owned by its own uid (default: "
        "<state-dir>-work); never inside the state directory",
    )
    p.add_argument(
        "--volumes-dir",
        type=Path,
        default=None,
        help="where tenants' node volumes live on this host's disk (default: <state-dir>-volumes)",
    )
    p.add_argument(
        "--shared-volumes-dir",
        type=Path,
        default=None,
        help="where this host mounts the fleet's shared storage (NFS, Lustre: the same files "
        "at the same path on every node) for tenants' shared volumes; without it, work that "
        "mounts one is not placed here",
    )
    p.add_argument(
        "--data-interface",
        metavar="IFACE",
        default=None,
        help="the interface a gang's hosts reach each other on: runs get it as "
        "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME (default: NCCL's and Gloo's own choice)",
    )


def _runs(p: argparse.ArgumentParser) -> None:
    """Whom runs run as, what of their output is kept, and the node's ports for them."""
    runs_as = p.add_mutually_exclusive_group()
    runs_as.add_argument(
        "--run-uids",
        metavar="FIRST-LAST",
        default="auto",
        help="the uids runs get, one each, with the gid of the same number (default: "
        "2000000-2065535 when the agent runs as root; without root, runs share its user)",
    )
    runs_as.add_argument(
        "--same-user",
        action="store_true",
        help="run every run as the agent's own user: a single-user machine only (the "
        "embedded default's local node); the node then says it cannot keep tenants apart",
    )
    p.add_argument(
        "--max-output-mib",
        type=int,
        default=16,
        help="a run's output kept on this node while it runs (past it, the newest 64 KiB)",
    )
    p.add_argument(
        "--ssh-ports",
        metavar="LO-HI",
        default="22000-22999",
        help="the node's TCP ports an instance's SSH server is reached on, one per running "
        "podman or vm run with SSH keys (default: 22000-22999; open them to the tenants)",
    )
    p.add_argument(
        "--serve-ports",
        metavar="LO-HI",
        default="31000-31999",
        help="the node's TCP ports an inference endpoint's replica is reached on, one per "
        "serving run (default: 31000-31999; open them to the gateways)",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stop"]:  # `rackplane agent stop --state-dir DIR`: that agent alone
        return stop_cmd.main(argv[1:])
    args = build_parser().parse_args(argv)
    from rackplane_agent import logfmt

    try:
        logfmt.setup(args.log_level)
    except ValueError:
        print(f"rackplane-agent: unknown --log-level {args.log_level!r}")
        return EXIT_USAGE
    if args.poll_wait <= 0:
        print("rackplane-agent: --poll-wait must be positive")
        return EXIT_USAGE
    if args.max_output_mib <= 0:
        print("rackplane-agent: --max-output-mib must be positive")
        return EXIT_USAGE
    run_uids: tuple[int, int] | str | None = None if args.same_user else args.run_uids
    if isinstance(run_uids, str) and run_uids != "auto":
        try:
            run_uids = parse_uid_range(run_uids)
        except ValueError as exc:
            print(f"rackplane-agent: --run-uids: {exc}")
            return EXIT_USAGE
    try:
        ssh_ports = parse_port_range(args.ssh_ports)
    except ValueError as exc:
        print(f"rackplane-agent: --ssh-ports: {exc}")
        return EXIT_USAGE
    try:
        serve_ports = parse_port_range(args.serve_ports)
    except ValueError as exc:
        print(f"rackplane-agent: --serve-ports: {exc}")
        return EXIT_USAGE
    config = AgentConfig(
        api=args.api,
        work_dir=args.work_dir,
        volumes_dir=args.volumes_dir,
        data_interface=args.data_interface,
        shared_volumes_dir=args.shared_volumes_dir,
        run_uids=run_uids,
        max_output_mib=args.max_output_mib,
        ssh_ports=ssh_ports,
        serve_ports=serve_ports,
        state_dir=args.state_dir or default_state_dir(),
        token=args.token or None,
        inventory_file=args.inventory,
        address=args.address,
        runtimes=args.runtime,
        dcgm_exporter=args.dcgm_exporter,
        poll_wait=args.poll_wait,
    )
    from rackplane_agent.runner import Agent

    agent = Agent(config)
    if threading.current_thread() is threading.main_thread():

        def stop(signum, frame) -> None:
            logging.getLogger("rackplane_agent").info(
                f"shutdown signal={signal.Signals(signum).name} runs=left_running"
            )
            agent.shutdown()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    return agent.run()
