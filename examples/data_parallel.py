"""An MLP regression trained data-parallel with ``distopt.parallel.DataParallelOptimizer``.

Every rank holds the whole model; each step it takes its own slice of a global batch, runs
forward and backward, and ``opt.step()`` averages the gradients over the ranks (in flat
buckets, overlapped with backward) before AdamW updates the parameters: the training loop
is the single-process one, with ``DataParallelOptimizer(torch.optim.AdamW, ...)`` in place
of ``torch.optim.AdamW(...)`` and no model wrapper. The data is synthetic and seeded: inputs
``x ~ N(0, I)`` and targets from a hidden random two-layer "teacher" network plus noise of
variance 0.01, so the loss can fall well below that of predicting the mean (about 1.0 at the start).

What travels between the ranks can be compressed (``--compression``: float16 or bfloat16
all-reduce, top-k or threshold sparsification with error feedback), or replaced by
partial synchronisation (``--sync-k K``: each rank steps on its own gradients and averages
one of K partitions of the parameters per step); ``--backward-passes N`` accumulates N
micro-batches per step (the global batch stays ``--batch-size``). ``--shard param`` or
``--shard flat`` keeps only 1/W of the optimizer state on each rank (ZeRO): each rank steps
its share of the parameters and they are all-gathered, bucket by bucket during backward;
the losses are those of the unsharded run, bit for bit, and the last line reports the
state bytes each rank holds.

Rank 0 prints a line every ``--log-every`` steps: the step, the loss of that step averaged
over the ranks (each rank keeps its losses; one all_reduce per progress line averages the
window's losses, outside the measured bytes), the bytes this process sent per step over
the window (the change of ``wchar`` in /proc/self/io, which counts every thread's writes,
gloo's included) and steps/s. At the end: the loss of the first step, the mean loss of the
last 10 steps, and the loss on held-out data before and after training (rank 0's model;
with ``--sync-k`` the ranks' models differ slightly between their synchronisations).

One machine (spawns ``--nproc`` processes on 127.0.0.1, a free port, gloo)::

    python examples/data_parallel.py
    python examples/data_parallel.py --compression topk --ratio 0.01
    python examples/data_parallel.py --sync-k 2 --backward-passes 2
    python examples/data_parallel.py --shard flat

With ``torchrun`` (it sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; the
world size is torchrun's, ``--nproc`` is ignored)::

    torchrun --nproc-per-node 2 examples/data_parallel.py --compression bf16
    # several machines: on each, R = 0, 1, ...; HOST0 is the machine with rank 0
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank R \\
        --master-addr HOST0 --master-port 29500 examples/data_parallel.py

Each process runs one intra-op thread (several processes on few cores oversubscribe them
otherwise). The options must be the same on every rank.
"""
import argparse
import datetime
import importlib.util
import os
import sys
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

if importlib.util.find_spec("distopt") is None:  # running from a clone that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distopt.parallel import Cast, DataParallelOptimizer, RoundRobin, Threshold, TopK
from distopt.parallel.compression import Compression

import _launch

COMPRESSIONS = ("none", "fp16", "bf16", "topk", "threshold")
#: The number of steps whose mean loss is reported as the final one.
FINAL_WINDOW = 10


# ---------------------------------------------------------------- data and model


class TeacherData:
    """Regression pairs ``(x, teacher(x) + noise)`` from a hidden random network.

    Args:
        features: input size.
        seed: seed of the teacher and of every batch.
        noise: standard deviation of the noise added to the targets.
    """

    def __init__(self, features: int, seed: int, noise: float = 0.1) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.features = features
        self.seed = seed
        self.noise = noise
        self.w1 = torch.randn(features, 64, generator=gen) / features ** 0.5
        self.w2 = torch.randn(64, 1, generator=gen) / 64 ** 0.5
        scale = self.targets(torch.randn(4096, features, generator=gen)).std()
        self.w2 /= scale  # targets of unit variance: the mean predictor's loss is about 1

    def targets(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.w1 * 2.0) @ self.w2

    def batch(self, step: int, size: int) -> Tuple[Tensor, Tensor]:
        """The global batch of ``step``: the same on every rank, whatever the world size."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(size, self.features, generator=gen)
        y = self.targets(x) + self.noise * torch.randn(size, 1, generator=gen)
        return x, y

    def held_out(self, size: int = 2048) -> Tuple[Tensor, Tensor]:
        return self.batch(-1, size)


def mlp(features: int, hidden: int, layers: int, seed: int) -> nn.Module:
    """``layers`` hidden layers of ``hidden`` units (ReLU), one output."""
    torch.manual_seed(seed)
    parts: List[nn.Module] = []
    width = features
    for _ in range(layers):
        parts += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    parts.append(nn.Linear(width, 1))
    return nn.Sequential(*parts)


# ---------------------------------------------------------------- options to objects


def compression_of(options: argparse.Namespace) -> Optional[Compression]:
    """The ``compression=`` argument that ``--compression`` names."""
    return {
        "none": None,
        "fp16": Cast(torch.float16),
        "bf16": Cast(torch.bfloat16),
        "topk": TopK(options.ratio),
        "threshold": Threshold(options.threshold),
    }[options.compression]


def wchar() -> int:
    """Bytes this process has written so far, sockets included (every thread)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def modelled_bytes(opt: DataParallelOptimizer) -> Optional[float]:
    """The scheme's payload model per step and rank (None where the payload depends on the
    gradients: Threshold, or on the round: RoundRobin)."""
    if opt.sync is not None or isinstance(opt.compression, Threshold):
        return None
    return opt.bytes_per_step()


# ---------------------------------------------------------------- training


def train(rank: int, world_size: int, options: argparse.Namespace) -> None:
    """One rank's training loop; rank 0 prints."""
    data = TeacherData(options.features, options.seed)
    # Same seed everywhere; the optimizer broadcasts rank 0's parameters anyway, as DDP does.
    model = mlp(options.features, options.hidden, options.layers, options.seed)
    sync = RoundRobin(options.sync_k) if options.sync_k else None
    opt = DataParallelOptimizer(
        _launch.optimizer_class(options.optimizer), model.parameters(), lr=options.lr,
        compression=compression_of(options), sync=sync,
        backward_passes_per_step=options.backward_passes, bucket_cap_mb=options.bucket_cap_mb,
        shard=None if options.shard == "none" else options.shard,
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=options.steps, eta_min=options.lr * 0.05
    )
    x_held, y_held = data.held_out()
    say = print if rank == 0 else (lambda *args, **kwargs: None)
    with torch.no_grad():
        held_before = F.mse_loss(model(x_held), y_held).item()
    modelled = modelled_bytes(opt)
    say(
        f"{world_size} ranks (gloo), {sum(p.numel() for p in model.parameters())} parameters "
        f"in {len(opt.bucket_layout())} buckets; {options.optimizer}(lr={options.lr}), "
        f"compression={opt.compression!r}, sync={opt.sync!r}, shard={opt.shard!r}, "
        f"backward passes per step {options.backward_passes}; global batch "
        f"{options.batch_size} ({options.batch_size // world_size} per rank)",
        flush=True,
    )
    if modelled is not None:
        say(f"modelled payload per step and rank: {modelled:.0f} bytes", flush=True)

    per_rank = options.batch_size // world_size
    micro = per_rank // options.backward_passes
    losses: List[float] = []  # averaged over the ranks, one per step
    window: List[float] = []  # this rank's losses since the last progress line
    since, sent_since = time.perf_counter(), wchar()
    start = since
    for step in range(1, options.steps + 1):
        x, y = data.batch(step, options.batch_size)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        step_loss = 0.0
        for k in range(options.backward_passes):
            loss = F.mse_loss(model(x[k * micro:(k + 1) * micro]), y[k * micro:(k + 1) * micro])
            # Gradients of the mean over the micro-batches, as one pass over all of them.
            (loss / options.backward_passes).backward()
            step_loss += loss.item() / options.backward_passes
        opt.step()
        opt.zero_grad()
        scheduler.step()
        window.append(step_loss)
        if step % options.log_every == 0 or step == options.steps:
            sent = wchar() - sent_since
            elapsed = time.perf_counter() - since
            # Outside the measured window: the window's losses, averaged over the ranks.
            mean = torch.tensor(window, dtype=torch.float64)
            dist.all_reduce(mean)
            mean /= world_size
            losses.extend(mean.tolist())
            say(
                f"step {step:4d}  loss {losses[-1]:.4f}  sent {sent / len(window):10.0f} B/step"
                f"  {len(window) / elapsed:6.1f} steps/s",
                flush=True,
            )
            window = []
            since, sent_since = time.perf_counter(), wchar()
    held = torch.tensor([opt.state_bytes()], dtype=torch.int64)
    every = [torch.zeros_like(held) for _ in range(world_size)]
    dist.all_gather(every, held)
    say(f"optimizer state per rank: {[int(b) for b in every]} bytes", flush=True)
    with torch.no_grad():
        held_after = F.mse_loss(model(x_held), y_held).item()
    final = sum(losses[-FINAL_WINDOW:]) / len(losses[-FINAL_WINDOW:])
    say(
        f"loss: first {losses[0]:.4f} -> final {final:.4f} (step 1; mean of the last "
        f"{min(FINAL_WINDOW, len(losses))} steps); held-out {held_before:.4f} -> "
        f"{held_after:.4f}; {options.steps} steps in {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    opt.close()


def run_rank(rank: int, world_size: int, init_method: str, options: argparse.Namespace) -> None:
    """A process's life: join the group, train, leave."""
    torch.set_num_threads(1)  # several processes share few cores
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=options.timeout),
    )
    try:
        train(rank, world_size, options)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- command line


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps")
    parser.add_argument("--nproc", type=int, default=2,
                        help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none",
                        help="what the gradients travel as")
    parser.add_argument("--ratio", type=float, default=0.01,
                        help="--compression topk: the fraction of each bucket sent")
    parser.add_argument("--threshold", type=float, default=1e-3,
                        help="--compression threshold: the smallest magnitude sent")
    parser.add_argument("--sync-k", type=int, default=0,
                        help="RoundRobin(K): average one of K parameter partitions per step "
                             "instead of the gradients (0: off)")
    parser.add_argument("--shard", choices=["none", "param", "flat"], default="none",
                        help="keep 1/W of the optimizer state per rank: whole parameters "
                             "(param) or even flat slices (flat)")
    parser.add_argument("--backward-passes", type=int, default=1,
                        help="micro-batches (backward passes) accumulated per step")
    parser.add_argument("--optimizer", default="AdamW", metavar="NAME",
                        help=f"torch.optim class: {', '.join(_launch.OPTIMIZERS)}")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine)")
    parser.add_argument("--batch-size", type=int, default=128,
                        help="global batch, split evenly over the ranks")
    parser.add_argument("--features", type=int, default=32, help="input size")
    parser.add_argument("--hidden", type=int, default=128, help="hidden layer width")
    parser.add_argument("--layers", type=int, default=2, help="hidden layers")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="the most gradient megabytes in one bucket")
    parser.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the model")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds a collective waits for a lost peer")
    _launch.add_network_arguments(parser)
    options = parser.parse_args(argv)
    for name in ("steps", "nproc", "backward_passes", "batch_size", "features", "hidden",
                 "layers", "log_every"):
        if getattr(options, name) < 1:
            parser.error(f"Invalid --{name.replace('_', '-')}: {getattr(options, name)!r} "
                         f"(expected >= 1)")
    if options.sync_k < 0:
        parser.error(f"Invalid --sync-k: {options.sync_k!r} (expected >= 0; 0: off)")
    if options.sync_k and options.compression != "none":
        parser.error(f"Invalid --compression: {options.compression!r} with --sync-k "
                     f"(expected none: RoundRobin averages parameters, not gradients)")
    if not 0.0 < options.ratio <= 1.0:
        parser.error(f"Invalid --ratio: {options.ratio!r} (expected a float in (0, 1])")
    if options.threshold < 0:
        parser.error(f"Invalid --threshold: {options.threshold!r} (expected >= 0)")
    try:
        _launch.optimizer_class(options.optimizer)
    except ValueError as exc:
        parser.error(str(exc))
    world_size = (_launch.env_rank() or (0, options.nproc))[1]
    if options.batch_size % (world_size * options.backward_passes):
        parser.error(
            f"Invalid --batch-size: {options.batch_size!r} (expected a multiple of "
            f"{world_size * options.backward_passes}: ranks x backward passes)"
        )
    return options


def main(argv: Optional[List[str]] = None) -> None:
    options = parse_args(argv)
    from_env = _launch.env_rank()
    _launch.pin_interface(options.interface, local=from_env is None)
    if from_env is None:
        init_method = f"tcp://127.0.0.1:{_launch.free_port()}"
        _launch.spawn(run_rank, (options.nproc, init_method, options), options.nproc)
    else:
        rank, world_size = from_env
        run_rank(rank, world_size, "env://", options)


if __name__ == "__main__":
    main()
