"""One process of a fault test across test hosts: ``python -m tests.hosts.fault_node SCENARIO DIR``.

Rank 0 (``RANK`` in the environment) is ``trainer``, rank 1 ``owner1``, rank 2 ``owner2``;
``FAULT_RPC_TIMEOUT`` is the RPC timeout in seconds of the step a fault strikes (the world's
setup and plain steps run under ``SETUP_TIMEOUT_S``: on a loaded machine the construction
alone took over 4 s). Owners serve until shutdown. The
trainer prints ``REPORT <json>`` with what it saw, then leaves (after a fault with
``rpc.shutdown(graceful=False)``, which does not wait for the lost owner) and exits 0. Owners print marker lines when they reach the
point where the test strikes, and then block reading their stdin (the test kills them, cuts
their link, or writes a line to let them go on).

Scenarios:

- ``step``: two plain steps, then a step during which owner2 blocks inside its optimizer's
  step (``OWNER-IN-STEP``); the trainer reports the DistributedOptimizerError and timings.
- ``save``: Adam, 3 steps, save to DIR (its state written to ``DIR/../expected.pt``),
  2 more steps, then a save during which owner1 blocks after writing its shard to its
  temporary file (``OWNER-SHARD-WRITTEN``): the test kills the trainer there.
- ``transfer``: seconds to send 2 MiB of tensor to each owner.
- ``load``: a fresh world loads DIR and reports whether the state equals ``expected.pt``,
  and which files the directory held before and after one more save.
"""
import json
import os
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer, DistributedOptimizerError
from tests.helpers import identical

NAMES = ["trainer", "owner1", "owner2"]
#: The RPC timeout until the fault's step: setup must not fail because the machine is busy.
SETUP_TIMEOUT_S = 120.0
SHAPES = [(64, 32), (32,)]
_armed = False


def make_param(shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).requires_grad_(True)


def remote_loss(rref: rpc.RRef) -> torch.Tensor:
    p = rref.local_value()
    return (p * p).sum() * 0.5


class BlockingSGD(torch.optim.SGD):
    """SGD (run eagerly: no functional twin) that, once armed, blocks inside ``step``."""

    def step(self, closure=None):
        if _armed:
            print("OWNER-IN-STEP", flush=True)
            sys.stdin.readline()  # the test kills this process, or cuts its link and writes
        return super().step(closure)


def arm_step() -> None:
    global _armed
    _armed = True


def arm_save() -> None:
    """Block this owner's next shard write once its temporary file is written."""
    from distopt import checkpoint

    def hook(stage: str, path: str) -> None:
        if stage == "shard-written":
            checkpoint.fault_hook = None
            print("OWNER-SHARD-WRITTEN", flush=True)
            sys.stdin.readline()  # the test writes a line once the trainer is dead

    checkpoint.fault_hook = hook


def params() -> List[rpc.RRef]:
    return [rpc.remote(owner, make_param, args=(shape, 10 * k + j))
            for k, owner in enumerate(NAMES[1:]) for j, shape in enumerate(SHAPES)]


def one_step(opt: DistributedOptimizer, rrefs: List[rpc.RRef]) -> None:
    with dist_autograd.context() as ctx:
        losses = [rpc.rpc_sync(r.owner(), remote_loss, args=(r,)) for r in rrefs]
        dist_autograd.backward(ctx, [torch.stack(losses).sum()])
        opt.step(ctx)


def scenario_step(directory: str) -> Dict[str, Any]:
    rrefs = params()
    opt = DistributedOptimizer(BlockingSGD, rrefs, lr=0.1)
    for _ in range(2):
        one_step(opt, rrefs)
    rpc.rpc_sync("owner2", arm_step)
    # From here on the fault's timeout: what the test measures the trainer's wait against.
    rpc._set_rpc_timeout(float(os.environ["FAULT_RPC_TIMEOUT"]))
    start = time.monotonic()
    try:
        one_step(opt, rrefs)
    except DistributedOptimizerError as exc:
        return {"error": str(exc), "failures": sorted(exc.failures),
                "succeeded": exc.succeeded, "seconds": time.monotonic() - start}
    return {"error": None}


def scenario_save(directory: str) -> Dict[str, Any]:
    rrefs = params()
    opt = DistributedOptimizer(torch.optim.Adam, rrefs, lr=0.01)
    for _ in range(3):
        one_step(opt, rrefs)
    opt.save(directory)
    torch.save(opt.state_dict(), os.path.join(os.path.dirname(directory), "expected.pt"))
    for _ in range(2):
        one_step(opt, rrefs)
    rpc.rpc_sync("owner1", arm_save)
    print("SAVING", flush=True)
    opt.save(directory)  # the test kills this process while owner1 waits
    return {"saved": True}


def echo_size(t: torch.Tensor) -> int:
    return t.numel()


def scenario_transfer(directory: str) -> Dict[str, Any]:
    """Seconds to send 2 MiB of tensor to each owner, one call after a warm-up call."""
    data = torch.ones(512 * 1024)  # 2 MiB
    seconds = {}
    for owner in NAMES[1:]:
        rpc.rpc_sync(owner, echo_size, args=(data[:16],))
        start = time.monotonic()
        assert rpc.rpc_sync(owner, echo_size, args=(data,)) == data.numel()
        seconds[owner] = time.monotonic() - start
    return {"bytes": data.numel() * 4, "seconds": seconds}


def scenario_load(directory: str) -> Dict[str, Any]:
    rrefs = params()
    opt = DistributedOptimizer(torch.optim.Adam, rrefs, lr=0.01)
    before = sorted(os.listdir(directory))
    opt.load(directory)
    expected = torch.load(os.path.join(os.path.dirname(directory), "expected.pt"),
                          weights_only=True)
    equal = identical(opt.state_dict(), expected)
    opt.save(directory)
    return {"equal": equal, "before": before, "after": sorted(os.listdir(directory))}


def main() -> None:
    scenario, directory = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    rpc.init_rpc(
        NAMES[rank], rank=rank, world_size=len(NAMES),
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method="env://", rpc_timeout=SETUP_TIMEOUT_S,
        ),
    )
    if rank != 0:
        rpc.shutdown()
        return
    scenarios = {"step": scenario_step, "save": scenario_save, "load": scenario_load,
                 "transfer": scenario_transfer}
    report = scenarios[scenario](
        directory
    )
    start = time.monotonic()
    # After a fault, leave without waiting for the lost owner; after a clean run, with all.
    rpc.shutdown(graceful=scenario in ("load", "transfer"))
    report["shutdown_seconds"] = time.monotonic() - start
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    # Run as the module by its package name, so RPC pickles these functions by that name.
    from tests.hosts import fault_node

    fault_node.main()
