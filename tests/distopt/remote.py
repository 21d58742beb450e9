"""Code the distopt tests run on RPC workers, in a module workers can import by name.

Workers unpickle RPC targets, optimizer classes and process entry points by qualified name,
so everything a test sends them lives here rather than in a test file.
"""
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor

from distopt import DistributedOptimizer, DistributedOptimizerError
from distopt import local_optimizer, locks, owner
from distopt.profiling import all_threads_config

# ---------------------------------------------------------------- processes


def backend_options(port: int, rpc_timeout: float) -> rpc.TensorPipeRpcBackendOptions:
    """Loopback TensorPipe options for a world rendezvousing on ``port``."""
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=32, rpc_timeout=rpc_timeout
    )


def run_worker(rank: int, world_size: int, port: int, rpc_timeout: float) -> None:
    """Process entry point: join the world as ``worker<rank>`` and serve until shutdown."""
    torch.set_num_threads(1)
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=backend_options(port, rpc_timeout),
    )
    rpc.shutdown()


# ---------------------------------------------------------------- parameters and forward


def make_param(shape: Tuple[int, ...], seed: int) -> Tensor:
    """A random parameter, created on (and so owned by) the worker running this."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).requires_grad_(True)


def make_complex_param(shape: Tuple[int, ...], seed: int, dtype: torch.dtype) -> Tensor:
    """A random parameter of a complex ``dtype``, owned by the worker running this."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=dtype).requires_grad_(True)


def complex_term(param: Tensor, data: Tensor) -> Tensor:
    """A real loss of a complex parameter, ``sum(tanh(view_as_real(p * x)))`` (of a real
    one, ``sum(tanh(p * x))``)."""
    product = param * data
    return torch.tanh(torch.view_as_real(product) if product.is_complex() else product).sum()


def remote_complex_term(param_rref: rpc.RRef, data: Tensor) -> Tensor:
    """``complex_term`` on the owner of ``param_rref``."""
    return complex_term(param_rref.local_value(), data)


def make_ones(shape: Tuple[int, ...]) -> Tensor:
    """A parameter of ones."""
    return torch.ones(shape, requires_grad=True)


def make_list() -> List[int]:
    """Something that is not a parameter, for an RRef that an optimizer must reject."""
    return [1, 2, 3]


def term(param: Tensor, data: Tensor, sparse: bool) -> Tensor:
    """One parameter's share of a loss: dense ``sum(tanh(p * x))``, or a sparse lookup."""
    if sparse:
        return F.embedding(data, param, sparse=True).pow(2).sum()
    return torch.tanh(param * data).sum()


def remote_term(param_rref: rpc.RRef, data: Tensor, sparse: bool) -> Tensor:
    """``term`` on the owner of ``param_rref`` (called by rpc, so autograd spans workers)."""
    return term(param_rref.local_value(), data, sparse)


def param_sum(param_rref: rpc.RRef) -> Tensor:
    """``sum(p)``: its gradient is all ones."""
    return param_rref.local_value().sum()


def value(param_rref: rpc.RRef) -> Tensor:
    """A copy of the parameter's current value."""
    return param_rref.local_value().detach().clone()


# ---------------------------------------------------------------- trainers


def sum_step(optimizer: DistributedOptimizer, param_rrefs: Sequence[rpc.RRef]) -> None:
    """One training step on ``sum`` of each parameter: every element's gradient is 1."""
    with dist_autograd.context() as ctx:
        losses = [rpc.rpc_sync(r.owner(), param_sum, args=(r,)) for r in param_rrefs]
        dist_autograd.backward(ctx, [torch.stack(losses).sum()])
        optimizer.step(ctx)


def train_sum_steps(
    optimizer_class: type, param_rrefs: List[rpc.RRef], steps: int, kwargs: Dict[str, Any]
) -> bool:
    """A trainer: its own DistributedOptimizer, ``steps`` sum steps. Returns the path taken."""
    optimizer = DistributedOptimizer(optimizer_class, param_rrefs, **kwargs)
    for _ in range(steps):
        sum_step(optimizer, param_rrefs)
    return optimizer.is_functional_optim


def dead_owner_trainer(port: int, rpc_timeout: float, results: Any, go: Any) -> None:
    """Process entry point: the trainer of a two-process world whose owner gets killed.

    Puts ``"ready"`` on ``results`` once it has stepped, waits for ``go`` (set after the owner
    is dead), then puts a dict describing the failed step and the failed construction.
    """
    torch.set_num_threads(1)
    rpc.init_rpc(
        "trainer", rank=0, world_size=2, rpc_backend_options=backend_options(port, rpc_timeout)
    )

    report: Dict[str, Any] = {}
    try:
        rref = rpc.remote("worker1", make_ones, args=((4,),))
        # Eager, so that no TorchScript compile on the owner races the short timeout.
        optimizer = DistributedOptimizer(PlainSGD, [rref], lr=1.0)
        sum_step(optimizer, [rref])
        results.put("ready")
        go.wait()
        for action in ("step", "construction"):
            start = time.monotonic()
            try:
                if action == "step":
                    with dist_autograd.context() as ctx:
                        optimizer.step(ctx)
                else:
                    DistributedOptimizer(PlainSGD, [rref], lr=1.0)
                report[action] = {"error": None}
            except DistributedOptimizerError as exc:
                report[action] = {"error": str(exc), "failures": dict(exc.failures)}
            except Exception as exc:  # reported, so the test shows what went wrong
                report[action] = {"error": f"unexpected {type(exc).__name__}: {exc}"}
            report[action]["seconds"] = time.monotonic() - start
        # What docs/guide/machines.md advises after an owner died: graceful=False does not
        # wait for the dead owner (graceful=True waits for every worker to agree, for minutes).
        start = time.monotonic()
        rpc.shutdown(graceful=False)
        report["shutdown_seconds"] = time.monotonic() - start
    finally:
        results.put(report)
        results.close()
        results.join_thread()
        if "shutdown_seconds" not in report:
            rpc.shutdown(graceful=False)


# ---------------------------------------------------------------- eager optimizers


class PlainSGD(torch.optim.Optimizer):
    """``p -= lr * grad``: a torch.optim class with no functional stand-in (eager path)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Invalid lr: {lr!r} (expected >= 0)")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


class ClosureSGD(PlainSGD):
    """PlainSGD whose step, like LBFGS's, cannot run without a closure."""

    @torch.no_grad()
    def step(self, closure: Any) -> Any:
        loss = closure()
        super().step()
        return loss


class FailOnWorker2(PlainSGD):
    """Refuses to be constructed on worker2."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        if rpc.get_worker_info().name == "worker2":
            raise ValueError("Invalid worker: worker2 (expected any other)")
        super().__init__(params, lr)


class StepFailsOnWorker2(PlainSGD):
    """Steps everywhere except on worker2, where its step raises."""

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> None:
        if rpc.get_worker_info().name == "worker2":
            raise RuntimeError("step refused on worker2")
        super().step(closure)


# ---------------------------------------------------------------- owner-side probes


def live_count_for(param_rref: rpc.RRef) -> int:
    """How many live local optimizers on this owner update ``param_rref``'s tensor."""
    param = param_rref.local_value()
    return sum(
        1 for lo in list(local_optimizer.live_by_id.values())
        if any(p is param for p in lo.params)
    )


def same_lock(a: rpc.RRef, b: rpc.RRef) -> bool:
    """Whether two parameters on this owner share one lock."""
    lock_a = locks.lock_of(a.local_value())
    lock_b = locks.lock_of(b.local_value())
    assert lock_a is not None and lock_b is not None
    return lock_a is lock_b


def hold_lock(param_rref: rpc.RRef) -> None:
    """Take the parameter's lock and keep it (``release_lock`` gives it back)."""
    lock = locks.lock_of(param_rref.local_value())
    assert lock is not None
    lock.acquire()


def release_lock(param_rref: rpc.RRef) -> None:
    """Give back a lock taken by ``hold_lock`` (threading.Lock may be released by any thread)."""
    lock = locks.lock_of(param_rref.local_value())
    assert lock is not None
    lock.release()



def is_exclusive(optimizer_rref: rpc.RRef) -> bool:
    """Whether the local optimizer may be stepped without its locks."""
    return optimizer_rref.local_value().exclusive


def refuse_unlocked_steps(optimizer_rref: rpc.RRef, message: str) -> None:
    """End the local optimizer's exclusivity behind its trainer's back (a missed switch)."""
    optimizer_rref.local_value().end_exclusive(message)


def orphan_exclusive(param_rref: rpc.RRef) -> Tuple[rpc.RRef, Optional[rpc.RRef]]:
    """An exclusive compiled SGD (lr 1) whose trainer, "nobody", cannot be reached.

    Returns its RRef and the RRef ``distopt.exclusive.script_step`` steps it through.
    """
    from functional import functional_optim_map

    specs = [([param_rref], [0], {})]
    local, info = owner.new_compiled_local_optimizer(
        functional_optim_map[torch.optim.SGD], torch.optim.SGD, specs, (), {"lr": 1.0},
        ("nobody", 1),
    )
    return local, info["script"]


# ---------------------------------------------------------------- a user's functional optimizer


class FunctionalPlainSGD:
    """A user's functional stand-in for ``PlainSGD``: ``p -= lr * g``, TorchScript-compilable."""

    def __init__(self, params: List[Tensor], lr: float = 0.1) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Invalid lr: {lr} (expected >= 0)")  # no !r in TorchScript
        self.params = params
        self.lr = lr
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        with torch.no_grad():
            for i in range(len(self.params)):
                g = gradients[i]
                if g is not None:
                    self.params[i].add_(g, alpha=-self.lr)

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        for i in range(len(self.params)):
            if self.params[i] is param and grad is not None:
                with torch.no_grad():
                    param.add_(grad, alpha=-self.lr)

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        if name != "lr":
            raise ValueError(f"Invalid hyper-parameter name for PlainSGD: '{name}' (expected lr)")
        self.lr = value[0]

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        self.state = state


# ---------------------------------------------------------------- clipping and checkpoints


def scaled_sum(param_rref: rpc.RRef, factor: float) -> Tensor:
    """``factor * sum(p)``: every element's gradient is ``factor`` (inf for a non-finite one)."""
    return (param_rref.local_value() * factor).sum()


def context_gradient(param_rref: rpc.RRef, context_id: int) -> Optional[Tensor]:
    """A copy of the parameter's gradient in the context on this owner, or None."""
    grads = dist_autograd.get_gradients(context_id)
    grad = grads.get(param_rref.local_value())
    return None if grad is None else grad.clone()


class SimulatedCrash(BaseException):
    """Raised by a checkpoint test hook to stand for a process dying: no cleanup catches it."""


def fail_checkpoint_at(stage: str, crash: bool = False) -> None:
    """Make this process's next checkpoint write fail at ``stage``, once.

    At ``"shard-written"`` the temporary shard is first cut to half its size, as a write
    interrupted midway would leave it. ``crash`` raises SimulatedCrash instead of OSError.
    """
    import os

    from distopt import checkpoint

    def hook(at: str, path: str) -> None:
        if at != stage:
            return
        checkpoint.fault_hook = None
        if at == "shard-written":
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
        if crash:
            raise SimulatedCrash(f"simulated crash at {at}")
        raise OSError(f"simulated failure at {at}")

    checkpoint.fault_hook = hook


def limit_file_size(limit: int) -> None:
    """Set this process's RLIMIT_FSIZE soft limit (bytes; -1: unlimited again). Python
    ignores SIGXFSZ, so a write past it fails with EFBIG instead of killing the process."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE,
                       (resource.RLIM_INFINITY if limit < 0 else limit, hard))


def clear_checkpoint_fault() -> None:
    """Remove any hook set by ``fail_checkpoint_at``."""
    from distopt import checkpoint

    checkpoint.fault_hook = None


# ---------------------------------------------------------------- memory layouts


def make_laid_out_param(shape: Tuple[int, ...], seed: int, layout: str) -> Tensor:
    """A random parameter in ``layout`` (see tests.functional.layouts), on this worker."""
    from tests.functional.layouts import place

    gen = torch.Generator().manual_seed(seed)
    param, _ = place(torch.randn(shape, generator=gen), layout)
    return param.requires_grad_(True)


def layout_term(param: Tensor, data: Tensor, kind: str) -> Tensor:
    """A loss term whose gradient comes out in a given layout from autograd's kernels:
    "mul" as the parameter (elementwise), "mul_t" transposed (through ``p.t()``),
    "matmul_t" contiguous (mm's backward), "sum" expanded with stride 0 before it reaches
    the context. Local autograd fixes ``.grad``'s layout to the parameter's;
    dist_autograd keeps the gradient as the kernel made it."""
    if kind == "mul":
        return torch.tanh(param * data).sum()
    if kind == "matmul_t":
        return torch.tanh(data @ param.t()).sum()
    if kind == "mul_t":
        return torch.tanh(param.t() * data).sum()
    if kind == "sum":
        return param.sum() * data.mean()
    raise ValueError(f"Invalid kind: {kind!r}")


def remote_layout_term(param_rref: rpc.RRef, data: Tensor, kind: str) -> Tensor:
    return layout_term(param_rref.local_value(), data, kind)


def layout_report(param_rref: rpc.RRef, context_id: int) -> Tuple[Tuple[int, ...], ...]:
    """(parameter strides, strides of its gradient in the context)."""
    param = param_rref.local_value()
    grad = dist_autograd.get_gradients(context_id)[param]
    return (tuple(param.stride()), tuple(grad.stride()))


def storage_intact(param_rref: rpc.RRef) -> bool:
    """Whether the storage around the parameter still holds the layouts' sentinel."""
    from tests.functional.layouts import outside_intact

    return outside_intact(param_rref.local_value())


def storage_of(param_rref: rpc.RRef) -> int:
    """The address of the parameter's storage (flat buffers put several in one)."""
    return param_rref.local_value().untyped_storage().data_ptr()


def same_tensor(param_rref: rpc.RRef) -> Tensor:
    """The parameter itself, for a second RRef to the same tensor."""
    return param_rref.local_value()


class KeywordSGD(torch.optim.SGD):
    """SGD whose constructor takes a keyword it keeps out of its defaults (an eager class)."""

    def __init__(self, params: Any, lr: float = 0.1, trace: bool = False) -> None:
        super().__init__(params, lr=lr)
        self.trace = trace


# ---------------------------------------------------------------- profiling an owner

#: The profiler running in this process: (its thread, the event that stops it, the names).
_profile: Dict[str, Any] = {}


def _profiling(started: Any, stop: Any, names: List[str]) -> None:
    config = all_threads_config()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=config) as prof:
        started.set()
        stop.wait()
    names.extend(e.name for e in prof.events() if e.name.startswith("distopt."))


def start_profile() -> None:
    """Start ``torch.profiler`` in this process, seeing every thread (RPC handlers run on
    the agent's threads), on a thread of its own: one RPC handler starts it, another
    (``stop_profile``) stops it, and a profiler must start and stop on one thread."""
    started, stop, names = threading.Event(), threading.Event(), []
    thread = threading.Thread(target=_profiling, args=(started, stop, names),
                              name="test-profiler", daemon=True)
    thread.start()
    started.wait()
    _profile["running"] = (thread, stop, names)


def stop_profile() -> List[str]:
    """Stop ``start_profile``'s profiler; the names of the distopt ranges it recorded."""
    thread, stop, names = _profile.pop("running")
    stop.set()
    thread.join()
    return names


# ---------------------------------------------------------------- version counters, half steps


def version(param_rref: rpc.RRef) -> int:
    """The parameter's autograd version counter (how many in-place changes it has seen)."""
    return param_rref.local_value()._version


def square_sum(param_rref: rpc.RRef) -> Tensor:
    """``sum(p * p)``: autograd saves ``p`` for the backward pass (gradient ``2 p``)."""
    param = param_rref.local_value()
    return (param * param).sum()


def torch_sum_steps(param_rrefs: List[rpc.RRef], steps: int, lr: float) -> None:
    """A trainer with torch.distributed.optim's DistributedOptimizer (SGD): ``steps`` sum
    steps, as ``train_sum_steps`` takes them with distopt's."""
    from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

    optimizer = TorchDistributedOptimizer(torch.optim.SGD, param_rrefs, lr=lr)
    for _ in range(steps):
        sum_step(optimizer, param_rrefs)


def resize_gradient(param_rref: rpc.RRef, context_id: int, shape: Tuple[int, ...]) -> None:
    """Resize the parameter's gradient in the context, in place: a gradient that no longer
    fits its parameter (autograd itself never leaves one)."""
    grad = dist_autograd.get_gradients(context_id)[param_rref.local_value()]
    grad.resize_(shape)


class FailsInSecondGroupOnWorker2(PlainSGD):
    """PlainSGD whose step, on worker2, updates param group 0 and then raises in group 1,
    as a torch.optim step that fails part-way through its groups does."""

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> None:
        for j, group in enumerate(self.param_groups):
            if j == 1 and rpc.get_worker_info().name == "worker2":
                raise RuntimeError("step refused in param group 1 on worker2")
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
