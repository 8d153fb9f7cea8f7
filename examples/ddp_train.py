"""Data-parallel training with PyTorch DistributedDataParallel, one process per replica.

    python examples/ddp_train.py --steps 200 --step-seconds 0.1 \
        --checkpoint-every 20 --checkpoint-dir /shared/ckpt

Each replica reads what Rackplane (or torchrun) gives it: RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (the rendezvous: rank 0's host), LOCAL_RANK. Gloo on CPUs, NCCL when the replica
sees a GPU (chosen at run time; `--backend` overrides). A small model learns a fixed linear map
from synthetic batches (each rank its own shard of every step's data, drawn from the step's
seed, so a resumed run sees the batches it would have seen).

Every `--checkpoint-every` steps, on SIGUSR1 (then it goes on) and on SIGTERM (then it exits 0),
rank 0 writes `DIR/<RACKPLANE_WORKLOAD_ID or local>/step-<n>.pt` with `torch.save` (model,
optimizer, step, loss) and reports it with RACKPLANE_TOKEN to the control plane; the replicas
agree on a signal at each step, so they stop together. With RACKPLANE_RESUME_FROM (a file://
URI of such a checkpoint) every rank starts from it: same weights, same optimizer, next step.
The world size may differ from the checkpoint's (an elastic gang that shrank or grew).

One line per step from rank 0: `step 12/200 loss=0.0312 world=4 backend=gloo t=<unix time>`.
A peer that vanishes (its host lost) makes the collective fail: the replica exits non-zero (1).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import _path_of, report_checkpoint  # noqa: E402 (the examples' shared reporting)

FEATURES, BATCH = 32, 64
_pending: set[str] = set()


def _on_signal(signum, frame) -> None:
    _pending.add(signal.Signals(signum).name)


def model() -> nn.Module:
    torch.manual_seed(0)  # every rank starts from the same weights
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 1))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the step's data: the step's seed, the rank's slice."""
    g = torch.Generator().manual_seed(1_000_003 * step + 17)
    target = torch.Generator().manual_seed(42)
    w = torch.randn(FEATURES, 1, generator=target) / FEATURES**0.5
    x = torch.randn(world * BATCH, FEATURES, generator=g)[rank * BATCH : (rank + 1) * BATCH]
    return x, x @ w + 0.01 * torch.randn(BATCH, 1, generator=g)


def save(directory: Path, step: int, net: nn.Module, opt: torch.optim.Optimizer, loss: float):
    workload = os.environ.get("RACKPLANE_WORKLOAD_ID") or "local"
    target = directory / workload
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"step-{step}.pt"
    tmp = target / f".step-{step}.pt.{os.getpid()}.tmp"
    state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step, "loss": loss}
    torch.save(state, tmp)
    os.replace(tmp, path)
    print(f"checkpoint step={step} loss={loss:.4f} path={path}", flush=True)
    report_checkpoint(path, step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-seconds", type=float, default=0.0, help="extra time per step")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.add_argument("--timeout-s", type=float, default=120.0, help="rendezvous and collectives")
    p.add_argument("--lr", type=float, default=0.02)
    args = p.parse_args(argv)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _on_signal)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = torch.cuda.is_available()
    backend = args.backend or ("nccl" if gpu else "gloo")
    device = torch.device(f"cuda:{local % torch.cuda.device_count()}" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    print(
        f"start rank={rank} world={world} backend={backend} device={device} "
        f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
        f"attempt={os.environ.get('RACKPLANE_ATTEMPT', '-')}",
        flush=True,
    )
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout_s)
    )
    net = model().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    done, loss = 0, float("nan")
    resume = os.environ.get("RACKPLANE_RESUME_FROM")
    if resume:
        state = torch.load(_path_of(resume), map_location=device, weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        done, loss = int(state["step"]), float(state["loss"])
        print(f"resumed from step {done} loss={loss:.4f} world={world}", flush=True)
    ddp = DistributedDataParallel(net, device_ids=[device.index] if gpu else None)
    saved = done

    def checkpoint() -> None:
        nonlocal saved
        if rank == 0 and done > saved:
            save(args.checkpoint_dir, done, net, opt, loss)
        saved = done

    while done < args.steps:
        began = time.monotonic()
        x, y = (t.to(device) for t in batch(done + 1, rank, world))
        opt.zero_grad()
        step_loss = nn.functional.mse_loss(ddp(x), y)
        step_loss.backward()
        opt.step()
        mean = step_loss.detach().clone()
        dist.all_reduce(mean)
        loss = float(mean) / world
        done += 1
        if rank == 0:  # with the wall clock: when training stepped again after a loss
            print(
                f"step {done}/{args.steps} loss={loss:.4f} world={world} backend={backend} "
                f"t={time.time():.3f}",
                flush=True,
            )
        # The replicas agree on the signals any of them got, so they act on the same step.
        flags = torch.tensor(
            [float("SIGTERM" in _pending), float("SIGUSR1" in _pending)], device=device
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        _pending.discard("SIGUSR1")
        if flags[0] > 0:
            print(f"SIGTERM at step {done}: checkpointing and exiting", flush=True)
            checkpoint()
            dist.destroy_process_group()
            return 0
        if flags[1] > 0 or (args.checkpoint_every > 0 and done % args.checkpoint_every == 0):
            checkpoint()
        time.sleep(max(0.0, args.step_seconds - (time.monotonic() - began)))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
