"""What ``benchmarks/rpc_step.py`` runs on its owner processes, importable by name there.

Owners hold named sets of parameters (so that a forward pass sends a name, not thousands of
RRefs), on the CPU or on a GPU, compute the cheap loss whose gradients the benchmark steps on,
and can run a thread that spins in pure Python to keep their interpreter busy.

With parameters on a GPU no CUDA tensor crosses RPC: a set's loss leaves its owner on the CPU
(its gradient comes back there, and autograd's copy takes it to the GPU), values are read
back as CPU copies. So TensorPipe needs no device map, and every owner's CUDA work stays on
its default stream, in the order its requests ran (with device maps, TensorPipe runs each
request on streams taken from a pool, ordered with other work only through the tensors a
message carries).
"""
import logging
import threading
from typing import Dict, List, Optional

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from functional._compile import script

logger = logging.getLogger(__name__)

_sets: Dict[str, List[Tensor]] = {}
_spinning: List[bool] = [False]
_spinner: List[Optional[threading.Thread]] = [None]


def backend_options(port: int, rpc_timeout: float = 120.0) -> rpc.TensorPipeRpcBackendOptions:
    """Loopback TensorPipe options for a world rendezvousing on ``port``."""
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=32, rpc_timeout=rpc_timeout
    )


def run_owner(rank: int, world_size: int, port: int, threads: int = 1) -> None:
    """Process entry point: join as ``owner<rank>`` and serve until the trainer shuts down;
    ``threads`` intra-op threads (0: torch's default)."""
    import warnings

    warnings.filterwarnings("ignore", message="You are using a Backend")
    warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script, in torch's optimizer
    if threads > 0:
        torch.set_num_threads(threads)
    rpc.init_rpc(
        f"owner{rank}", rank=rank, world_size=world_size, rpc_backend_options=backend_options(port)
    )
    rpc.shutdown()


def create(name: str, count: int, numel: int, fill: Optional[float],
           device: str = "cpu") -> List[rpc.RRef]:
    """RPC target: ``count`` parameters of ``numel`` elements (random, or all ``fill``) on
    ``device`` (random values drawn on the CPU, the same on every device)."""
    gen = torch.Generator().manual_seed(len(name) + count)
    if fill is None:
        params = [torch.randn(numel, generator=gen).to(device).requires_grad_()
                  for _ in range(count)]
    else:
        params = [torch.full((numel,), fill, device=device).requires_grad_()
                  for _ in range(count)]
    _sets[name] = params
    return [rpc.RRef(p) for p in params]


def drop(name: str) -> None:
    """RPC target: forget a set (its RRefs may still keep the tensors alive)."""
    _sets.pop(name, None)


def set_sum(name: str) -> Tensor:
    """RPC target: the sum of every element of a set, on the CPU (where the set is); each
    element's gradient is 1."""
    params = _sets[name]
    if len(params) == 1:
        return params[0].sum().cpu()
    return torch.stack([p.sum() for p in params]).sum().cpu()


def set_values(name: str) -> List[Tensor]:
    """RPC target: copies of a set's current values, on the CPU."""
    return [p.detach().to("cpu", copy=True) for p in _sets[name]]





def _spin() -> None:
    n = 0
    while _spinning[0]:
        n += 1


def start_spinner() -> None:
    """RPC target: start a thread that spins in pure Python (holding the GIL when it runs)."""
    if _spinner[0] is None:
        _spinning[0] = True
        _spinner[0] = threading.Thread(target=_spin, daemon=True)
        _spinner[0].start()


def stop_spinner() -> None:
    """RPC target: stop the spinning thread."""
    thread = _spinner[0]
    _spinning[0] = False
    if thread is not None:
        thread.join()
    _spinner[0] = None


@script  # torch.jit.script without torch 2.13's deprecation warning
def script_echo(x: int) -> int:
    """A TorchScript RPC target that does nothing: the round trip's floor."""
    return x


def python_echo(x: int) -> int:
    """A Python RPC target that does nothing."""
    return x


def _cuda_synchronize(x: int) -> int:
    """Wait for every kernel queued on this process's GPU; returns ``x`` (the shape of the
    echo targets, so that ``round_trip_ms`` can time it)."""
    torch.cuda.synchronize()
    return x


def _cuda_synchronize_target():
    """``_cuda_synchronize`` compiled where CUDA is (a TorchScript RPC target takes no GIL, so
    a busy owner answers it at once; TorchScript knows ``cuda::synchronize`` only in CUDA
    builds), else the Python function."""
    if not torch.cuda.is_available():
        return _cuda_synchronize
    try:
        return script(_cuda_synchronize)
    except Exception as exc:  # TorchScript raises RuntimeError, NotSupportedError, OSError...
        logger.warning("cuda_synchronize runs in Python (TorchScript refused it: %s)", exc)
        return _cuda_synchronize


#: RPC target: ``_cuda_synchronize``, compiled where it can be.
cuda_synchronize = _cuda_synchronize_target()


def set_switch_interval(seconds: float) -> float:
    """RPC target: set this interpreter's GIL switch interval; returns the old one."""
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    return old


def timed_owner_step(optimizer_rref: rpc.RRef, autograd_ctx_id: int,
                     device: str = "cpu") -> float:
    """RPC target: seconds distopt's owner-side step function takes here, on its own (on a
    GPU, from an idle device until its kernels are done).

    Probes distopt's internals (``distopt.owner.step_local_optimizer``) to split a step's
    time between the owner's work and the RPC and trainer around it.
    """
    from benchmarks._machine import device_clock
    from distopt import owner

    clock = device_clock(torch.device(device))
    start = clock()
    failure = owner.step_local_optimizer(optimizer_rref, autograd_ctx_id)
    elapsed = clock() - start
    if not isinstance(failure, bool):  # the owner's RemoteFailure
        raise RuntimeError(f"owner step failed: {failure}")
    return elapsed


class EagerAdam(torch.optim.Adam):
    """torch.optim.Adam under another name: neither library maps it, so both run it eagerly."""
