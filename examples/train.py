"""A toy training job for the walkthrough and the end-to-end tests (standard library only).

    python examples/train.py --steps 100 --step-seconds 0.5 \
        --checkpoint-every 10 --checkpoint-dir /tmp/ckpt [--fail-at-step M]

One line per step (`step 12/100 rank=0 world=2 devices=GPU-...`). Every `--checkpoint-every`
steps, on SIGUSR1 (then it goes on) and on SIGTERM (then it exits 0), rank 0 writes
`DIR/<RACKPLANE_WORKLOAD_ID or local>/step-<n>.json` and, when RACKPLANE_API and
RACKPLANE_TOKEN are set, reports it to `POST /v1/workloads/{id}/checkpoints`. With
RACKPLANE_RESUME_FROM (a file:// URI or a path to such a checkpoint) it starts after the step
the checkpoint holds. `--fail-at-step M` exits 3 at step M.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

_pending: set[str] = set()


def _on_signal(signum, frame) -> None:
    _pending.add(signal.Signals(signum).name)


def _path_of(uri: str) -> Path:
    if uri.startswith("file://"):
        return Path(urllib.parse.unquote(urllib.parse.urlparse(uri).path))
    return Path(uri)


def resume_step(uri: str) -> int:
    return int(json.loads(_path_of(uri).read_text())["step"])


def report_checkpoint(path: Path, step: int) -> None:
    api = os.environ.get("RACKPLANE_API")
    token = os.environ.get("RACKPLANE_TOKEN")
    workload = os.environ.get("RACKPLANE_WORKLOAD_ID")
    if not (api and token and workload):
        return
    body = json.dumps(
        {"uri": path.resolve().as_uri(), "step": step, "size_bytes": path.stat().st_size}
    ).encode()
    request = urllib.request.Request(
        f"{api.rstrip('/')}/v1/workloads/{urllib.parse.quote(workload)}/checkpoints",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
        print(f"checkpoint {step} reported", flush=True)
    except (urllib.error.URLError, OSError) as exc:
        print(f"checkpoint {step} not reported: {exc}", flush=True)


def write_checkpoint(directory: Path, step: int) -> Path:
    workload = os.environ.get("RACKPLANE_WORKLOAD_ID") or "local"
    target = directory / workload
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"step-{step}.json"
    tmp = target / f".step-{step}.json.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump({"step": step}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    print(f"checkpoint step={step} path={path}", flush=True)
    report_checkpoint(path, step)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-seconds", type=float, default=1.0)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--fail-at-step", type=int, default=None)
    args = p.parse_args(argv)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _on_signal)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    devices = os.environ.get("CUDA_VISIBLE_DEVICES") or "none"

    master = os.environ.get("MASTER_ADDR")
    print(
        f"start rank={rank} world={world} devices={devices}"
        + (f" master={master}:{os.environ.get('MASTER_PORT')}" if master else "")
        + f" attempt={os.environ.get('RACKPLANE_ATTEMPT', '-')}",
        flush=True,
    )
    done = 0  # steps completed
    resume = os.environ.get("RACKPLANE_RESUME_FROM")
    if resume:
        done = resume_step(resume)
        print(f"resumed from step {done}", flush=True)
    saved = done  # the last step a checkpoint holds

    def checkpoint() -> None:
        nonlocal saved
        if rank == 0 and done > saved:
            write_checkpoint(args.checkpoint_dir, done)
        saved = done

    while done < args.steps:
        deadline = time.monotonic() + args.step_seconds
        while True:  # a step's work, interruptible by the signals
            if "SIGTERM" in _pending:
                print(f"SIGTERM at step {done}: checkpointing and exiting", flush=True)
                checkpoint()
                return 0
            if "SIGUSR1" in _pending:
                _pending.discard("SIGUSR1")
                print(f"SIGUSR1 at step {done}: checkpointing", flush=True)
                checkpoint()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, 0.05))
        done += 1
        print(f"step {done}/{args.steps} rank={rank} world={world} devices={devices}", flush=True)
        if args.fail_at_step is not None and done == args.fail_at_step:
            print(f"failing at step {done}", file=sys.stderr, flush=True)
            return 3
        if args.checkpoint_every > 0 and done % args.checkpoint_every == 0:
            checkpoint()
    return 0


if __name__ == "__main__":
    sys.exit(main())
