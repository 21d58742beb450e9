"""A parameter server and several trainer processes training one model concurrently.

The server (``ps``) holds a small MLP. Each trainer (``trainer1`` .. ``trainerN``), in its own
process and at its own pace, repeats: pull the current parameters from the server, run
forward and backward locally on its own synthetic batch inside a
``torch.distributed.autograd`` context (the gradients flow back to the server's
parameters), and step its own ``distopt.DistributedOptimizer`` over the server's
parameters. The server updates under per-parameter locks, so concurrent trainers lose no
update. The data: inputs ``x ~ N(0, 1)``, targets from a fixed random "teacher" MLP plus a
little noise; the loss is the mean squared error.

The server also keeps a tally of the updates it applied: a one-element parameter, stepped by
each trainer in the same autograd context as the model, with SGD (lr 1) and a gradient of
exactly -1, so each applied step adds exactly 1. At the end the server prints
``updates applied: A of S sent``; A < S would mean concurrent steps overwrote each other
(torch.distributed.optim's DistributedOptimizer loses such updates; distopt must not).

``--checkpoint DIR`` saves every ``--save-every`` steps (of each trainer): each trainer saves
its own optimizer (``opt.save``) and its data generator into ``DIR/step-N/trainerK``, then
waits at a barrier on the server; the last to arrive has the server save the weights and the
tally (no step is in flight then) and name the folder in ``DIR/latest``. ``--auto-resume``
continues from there when DIR holds a checkpoint (for ``torchrun --max-restarts``): the steps
done after the checkpoint are done again and counted once, so the tally still ends at
trainers x steps. With one trainer a resumed run ends with exactly the weights of an
uninterrupted one; with several, the order in which concurrent steps land varies from run to
run anyway.

One machine (spawns the server and the trainers on 127.0.0.1, a free port)::

    python examples/parameter_server.py
    python examples/parameter_server.py --trainers 3 --optimizer Adagrad --lr 0.05

Several machines: one process per role with ``torchrun`` (rank 0 is the server, ranks
1..N the trainers; ``WORLD_SIZE`` must be ``--trainers`` + 1)::

    torchrun --nnodes 3 --nproc-per-node 1 --node-rank R \\
        --master-addr HOST0 --master-port 29500 examples/parameter_server.py --trainers 2

or set ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` yourself and run
``python examples/parameter_server.py`` on each machine, with the same options everywhere.
"""
import argparse
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor, nn

try:
    import distopt
except ImportError:  # running from a clone that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import distopt

import _checkpoints
import _launch


def mlp(in_features: int, hidden: int, seed: int) -> nn.Sequential:
    """``in_features -> hidden -> hidden -> 1`` with tanh, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(in_features, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 1),
    )


def forward(params: List[Tensor], x: Tensor) -> Tensor:
    """The MLP of ``mlp`` with its parameters given as a list, in ``parameters()`` order."""
    w1, b1, w2, b2, w3, b3 = params
    h = torch.tanh(F.linear(x, w1, b1))
    h = torch.tanh(F.linear(h, w2, b2))
    return F.linear(h, w3, b3)


# ---------------------------------------------------------------- on the server


def pull(model_rref: rpc.RRef, tally_rref: rpc.RRef) -> List[Tensor]:
    """RPC target: views of the model's parameters, then of the tally (see the module
    docstring), in one call.

    Called inside a distributed autograd context, the trainer receives copies that are tied
    to these parameters: the gradients of its backward pass arrive here. Views, because RPC
    pickles an ``nn.Parameter`` as its detached data, which would cut that tie.
    """
    tally = tally_rref.local_value()
    return [p.view_as(p) for p in model_rref.local_value().parameters()] + [tally.view_as(tally)]


def held_out_loss(model: nn.Module, options: argparse.Namespace) -> float:
    """The model's loss on a fixed batch no trainer ever sees."""
    x, y = synthetic_batch(options, torch.Generator().manual_seed(10_000), 1024)
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


SERVER_FILE = "server.pt"
TRAINER_FILE = "trainer.pt"
#: The options a resumed run must share with the run that saved the checkpoint (--steps may
#: grow: nothing depends on it).
RESUME_KEYS = ("trainers", "optimizer", "lr", "batch_size", "features", "hidden", "seed")
# The server's model and tally, for the checkpoint barrier (set by ``serve``).
_served: Dict[str, Any] = {}
_barrier_lock = threading.Lock()
_barrier_waiting: List[torch.futures.Future] = []


@rpc.functions.async_execution
def checkpoint_barrier(parties: int, folder: Optional[str]) -> torch.futures.Future:
    """RPC target on the server: completes once ``parties`` trainers have called it. With a
    ``folder``, the last to arrive first saves the server's part (weights and tally) there
    and names the folder in ``latest``: every trainer has saved its own part by then, and
    none is stepping. Waiting trainers hold a future, not an RPC thread."""
    future: torch.futures.Future = torch.futures.Future()
    with _barrier_lock:
        _barrier_waiting.append(future)
        if len(_barrier_waiting) < parties:
            return future
        released = list(_barrier_waiting)
        _barrier_waiting.clear()
    error: Optional[BaseException] = None
    if folder is not None:
        try:
            state = {
                "model": {k: v.detach().clone() for k, v in _served["model"].state_dict().items()},
                "tally": _served["tally"].detach().clone(),
                "options": _served["options"],
            }
            _checkpoints.save_tensors(os.path.join(folder, SERVER_FILE), state)
            _checkpoints.publish(folder)
        except BaseException as exc:  # every trainer gets the error
            error = exc
    for f in released:
        if error is None:
            f.set_result(None)
        else:
            f.set_exception(error)
    return future


def serve(options: argparse.Namespace) -> None:
    """The server's role: hold the model, start every trainer, report when all are done."""
    model = mlp(options.features, options.hidden, options.seed)
    model_rref = rpc.RRef(model)
    param_rrefs = [rpc.RRef(p) for p in model.parameters()]
    tally = torch.zeros(1, requires_grad=True)
    tally_rref = rpc.RRef(tally)
    _served.update(model=model, tally=tally,
                   options=_checkpoints.options_of(options, RESUME_KEYS))
    done = 0
    folder = options.resume_from
    if options.checkpoint:
        _checkpoints.remove_unpublished(options.checkpoint)
    if folder is not None:
        state = torch.load(os.path.join(folder, SERVER_FILE), weights_only=True)
        model.load_state_dict(state["model"])
        with torch.no_grad():
            tally.copy_(state["tally"])
        done = _checkpoints.step_of(folder)
        print(f"ps: resumed from {folder} after step {done}", flush=True)
        if done >= options.steps:
            print(f"nothing to do: the checkpoint is already at step {done}", flush=True)
            return
    before = held_out_loss(model, options)
    print(
        f"ps: MLP {options.features}-{options.hidden}-{options.hidden}-1, "
        f"{sum(p.numel() for p in model.parameters())} parameters; "
        f"{options.trainers} trainers; {options.optimizer}(lr={options.lr}); "
        f"held-out loss {before:.4f}",
        flush=True,
    )
    start = time.perf_counter()
    futures = {
        f"trainer{i}": rpc.rpc_async(
            f"trainer{i}", run_trainer,
            args=(model_rref, param_rrefs, tally_rref, options, done, folder), timeout=0,
        )
        for i in range(1, options.trainers + 1)
    }
    reports = {name: fut.wait() for name, fut in futures.items()}
    wall = time.perf_counter() - start

    after = held_out_loss(model, options)
    print(
        f"{'trainer':10} {'steps':>6} {'final loss':>11} {'steps/s':>8} {'samples/s':>10} "
        f"{'compiled':>9}"
    )
    for name, r in reports.items():
        print(
            f"{name:10} {r['steps']:6d} {r['final_loss']:11.4f} {r['steps_per_s']:8.1f} "
            f"{r['steps_per_s'] * options.batch_size:10.0f} {str(r['compiled']):>9}"
        )
    total_steps = sum(r["steps"] for r in reports.values())
    print(
        f"all: {total_steps} steps in {wall:.1f} s = {total_steps / wall:.1f} steps/s, "
        f"{total_steps * options.batch_size / wall:.0f} samples/s",
        flush=True,
    )
    print(f"held-out loss: before {before:.4f} -> after {after:.4f}", flush=True)
    print(f"updates applied: {int(tally.item())} of {options.trainers * options.steps} sent",
          flush=True)


# ---------------------------------------------------------------- on each trainer


def synthetic_batch(options: argparse.Namespace, gen: torch.Generator, size: int):
    """``size`` inputs and their targets: the teacher's output plus noise."""
    teacher = _teacher(options)
    x = torch.randn(size, options.features, generator=gen)
    with torch.no_grad():
        y = teacher(x) + 0.01 * torch.randn(size, 1, generator=gen)
    return x, y


_teachers: Dict[tuple, nn.Module] = {}


def _teacher(options: argparse.Namespace) -> nn.Module:
    # The same teacher in every process: built from a fixed seed, once per process.
    key = (options.features, options.hidden)
    if key not in _teachers:
        _teachers[key] = mlp(options.features, options.hidden, seed=12_345)
    return _teachers[key]


def run_trainer(
    model_rref: rpc.RRef, param_rrefs: List[rpc.RRef], tally_rref: rpc.RRef,
    options: argparse.Namespace, done: int = 0, folder: Optional[str] = None,
) -> Dict[str, Any]:
    """RPC target, run on a trainer: train steps ``done + 1`` .. ``options.steps`` (after
    ``done``, from the checkpoint in ``folder``), return what happened."""
    name = rpc.get_worker_info().name
    rank = int(name[len("trainer") :])
    gen = torch.Generator().manual_seed(options.seed + rank)
    opt = distopt.DistributedOptimizer(
        _launch.optimizer_class(options.optimizer), param_rrefs, lr=options.lr
    )
    tally_opt = distopt.DistributedOptimizer(torch.optim.SGD, [tally_rref], lr=1.0)
    if folder is not None:
        opt.load(os.path.join(folder, name))
        gen.set_state(torch.load(os.path.join(folder, name, TRAINER_FILE),
                                 weights_only=True)["generator"])
    server = model_rref.owner()
    losses: List[float] = []
    start = time.perf_counter()
    for step in range(done + 1, options.steps + 1):
        x, y = synthetic_batch(options, gen, options.batch_size)
        with dist_autograd.context() as ctx:
            *params, tally = rpc.rpc_sync(server, pull, args=(model_rref, tally_rref))
            loss = F.mse_loss(forward(params, x), y)
            dist_autograd.backward(ctx, [loss, -tally.sum()])  # the tally's gradient: -1
            opt.step(ctx)
            tally_opt.step(ctx)
        losses.append(loss.item())
        if step % options.log_every == 0 or step == options.steps:
            recent = losses[-options.log_every :]
            print(f"{name} step {step:5d}  loss {sum(recent) / len(recent):.4f}", flush=True)
        if options.checkpoint and step % options.save_every == 0:
            # This trainer's part, then the barrier: its last arrival saves the server's part
            # while every trainer waits there, between two steps.
            here = _checkpoints.folder_for(options.checkpoint, step)
            opt.save(os.path.join(here, name))
            _checkpoints.save_tensors(os.path.join(here, name, TRAINER_FILE),
                                      {"generator": gen.get_state()})
            rpc.rpc_sync(server, checkpoint_barrier, args=(options.trainers, here), timeout=0)
            if name == "trainer1":
                print(f"checkpoint saved to {here} after step {step}", flush=True)
    elapsed = time.perf_counter() - start
    if not losses:
        return {"steps": 0, "final_loss": float("nan"), "steps_per_s": 0.0,
                "compiled": opt.is_functional_optim}
    k = min(10, len(losses))
    return {
        "steps": len(losses),
        "final_loss": sum(losses[-k:]) / k,
        "steps_per_s": len(losses) / elapsed,
        "compiled": opt.is_functional_optim,
    }


# ---------------------------------------------------------------- command line


def role(name: str, options: argparse.Namespace) -> None:
    """The server drives everything; trainers run what it sends them."""
    if name == "ps":
        serve(options)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--trainers", type=int, default=2, help="trainer processes")
    parser.add_argument("--steps", type=int, default=300, help="steps per trainer")
    parser.add_argument(
        "--optimizer", default="Adam", metavar="NAME",
        help=f"torch.optim class: {', '.join(_launch.OPTIMIZERS)} (not LBFGS: its step needs a "
        f"closure; not SparseAdam: sparse gradients only; not Muon: 2-D parameters only)",
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step")
    parser.add_argument("--features", type=int, default=16, help="input size")
    parser.add_argument("--hidden", type=int, default=64, help="hidden layer size")
    parser.add_argument("--log-every", type=int, default=100, help="steps between progress lines")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    parser.add_argument("--checkpoint", default="", help="directory for checkpoints (empty: none)")
    parser.add_argument("--save-every", type=int, default=100,
                        help="steps (of each trainer) between checkpoints")
    parser.add_argument("--auto-resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint if there is "
                             "one, else start at step 1 (for torchrun --max-restarts)")
    _launch.add_network_arguments(parser)
    options = parser.parse_args(argv)
    if options.auto_resume and not options.checkpoint:
        parser.error("Invalid --auto-resume: given without --checkpoint (expected a directory)")
    try:
        options.resume_from = _checkpoints.resumable(options, SERVER_FILE, RESUME_KEYS)
    except ValueError as exc:
        parser.error(str(exc))
    for name in ("trainers", "steps", "batch_size", "features", "hidden", "log_every",
                 "save_every"):
        if getattr(options, name) < 1:
            parser.error(
                f"Invalid --{name.replace('_', '-')}: {getattr(options, name)!r} (expected >= 1)"
            )
    try:
        _launch.optimizer_class(options.optimizer)
    except ValueError as exc:
        parser.error(str(exc))
    return options


def main(argv: Optional[List[str]] = None) -> None:
    options = parse_args(argv)
    names = ["ps"] + [f"trainer{i}" for i in range(1, options.trainers + 1)]
    _launch.run(names, role, options)


if __name__ == "__main__":
    main()
