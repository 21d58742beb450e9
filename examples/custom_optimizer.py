"""Registering your own functional optimizer, so that DistributedOptimizer compiles it.

``examples/_my_optim.py`` defines a user's optimizer, Lion, twice: ``Lion``, an ordinary
``torch.optim.Optimizer`` subclass, and ``FunctionalLion``, its functional stand-in (gradients
as a list, ``step``, ``step_param``, ``set_hyperparameter``, ``set_state`` and ``self.state``,
compilable with TorchScript). ``functional.register_functional_optimizer(Lion,
FunctionalLion)`` compiles the stand-in and adds it to ``functional.functional_optim_map``;
from then on ``distopt.DistributedOptimizer(Lion, ...)`` runs the compiled, GIL-free
``FunctionalLion`` on the parameters' owner (``is_functional_optim`` is True) instead of
``Lion`` eagerly. Registration is needed only where DistributedOptimizer is constructed.

This script trains a linear regression whose parameters live on ``worker1`` from the
``trainer`` process, and trains a local copy with the eager ``Lion`` on the same batches:
the two end equal.

One machine (spawns both processes on 127.0.0.1, a free port)::

    python examples/custom_optimizer.py --steps 50

Several machines: ``torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr HOST0
--master-port 29500 examples/custom_optimizer.py`` on each (rank 0 is the trainer), or set
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE=2`` yourself.
"""
import argparse
import os
import sys
from typing import List, Optional, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor

try:
    import distopt
except ImportError:  # running from a clone that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import distopt
from functional import functional_optim_map, register_functional_optimizer

import _launch
from _my_optim import FunctionalLion, Lion

WORKERS = ["trainer", "worker1"]


def make_param(shape: Tuple[int, ...], seed: int) -> Tensor:
    """RPC target: a random parameter, created on (and so owned by) the callee."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def value(param_rref: rpc.RRef) -> Tensor:
    """RPC target: a copy of the parameter's current value."""
    return param_rref.local_value().detach().clone()


def predict(weight: Tensor, bias: Tensor, x: Tensor) -> Tensor:
    return F.linear(x, weight, bias)


def remote_predict(weight_rref: rpc.RRef, bias_rref: rpc.RRef, x: Tensor) -> Tensor:
    """RPC target: ``predict`` with the callee's parameters."""
    return predict(weight_rref.local_value(), bias_rref.local_value(), x)


def train(options: argparse.Namespace) -> None:
    """The trainer's role: distopt with the registered Lion, and eager Lion locally."""
    register_functional_optimizer(Lion, FunctionalLion)
    print(f"registered: Lion -> {functional_optim_map[Lion].__name__}", flush=True)

    weight = rpc.remote("worker1", make_param, args=((1, options.features), 1))
    bias = rpc.remote("worker1", make_param, args=((1,), 2))
    kwargs = {"lr": options.lr, "betas": (0.9, 0.99), "weight_decay": options.weight_decay}
    opt = distopt.DistributedOptimizer(Lion, [weight, bias], **kwargs)
    print(f"DistributedOptimizer(Lion).is_functional_optim = {opt.is_functional_optim}")
    if not opt.is_functional_optim:
        raise RuntimeError("Lion was not compiled: is TorchScript disabled (PYTORCH_JIT=0)?")

    local = [rpc.rpc_sync("worker1", value, args=(r,)).requires_grad_() for r in (weight, bias)]
    eager = Lion(local, **kwargs)

    gen = torch.Generator().manual_seed(options.seed)
    true_w = torch.randn(1, options.features, generator=gen)
    for step in range(1, options.steps + 1):
        x = torch.randn(options.batch_size, options.features, generator=gen)
        y = x @ true_w.t() + 0.5
        with dist_autograd.context() as ctx:
            pred = rpc.rpc_sync("worker1", remote_predict, args=(weight, bias, x))
            loss = F.mse_loss(pred, y)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)

        eager.zero_grad()
        eager_loss = F.mse_loss(predict(local[0], local[1], x), y)
        eager_loss.backward()
        eager.step()
        if step % options.log_every == 0 or step == options.steps:
            print(
                f"step {step:4d}  loss distopt {loss.item():.5f}  torch.optim {eager_loss.item():.5f}",
                flush=True,
            )

    remote = [rpc.rpc_sync("worker1", value, args=(r,)) for r in (weight, bias)]
    diff = max((a - b.detach()).abs().max().item() for a, b in zip(remote, local))
    print(f"max |distopt - torch.optim| over the parameters after {options.steps} steps: {diff:.3g}")
    for a, b in zip(remote, local):
        torch.testing.assert_close(a, b.detach())
    print("results equal: yes", flush=True)


def role(name: str, options: argparse.Namespace) -> None:
    if name == "trainer":
        train(options)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="decoupled weight decay")
    parser.add_argument("--features", type=int, default=8, help="input size")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step")
    parser.add_argument("--log-every", type=int, default=20, help="steps between progress lines")
    parser.add_argument("--seed", type=int, default=0, help="data seed")
    _launch.add_network_arguments(parser)
    options = parser.parse_args(argv)
    for name in ("steps", "features", "batch_size", "log_every"):
        if getattr(options, name) < 1:
            parser.error(
                f"Invalid --{name.replace('_', '-')}: {getattr(options, name)!r} (expected >= 1)"
            )
    return options


def main(argv: Optional[List[str]] = None) -> None:
    _launch.run(WORKERS, role, parse_args(argv))


if __name__ == "__main__":
    main()
