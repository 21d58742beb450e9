"""Starting an example's RPC world: every process on this machine, or one role per process.

Each example has a fixed world: a list of worker names, rank ``i`` taking ``names[i]``.

- One machine (the default): ``run`` starts one process per name with
  ``torch.multiprocessing`` (``spawn``: forked from a fork server that has imported torch)
  and rendezvouses them on a free port of 127.0.0.1.
- Several machines: when ``RANK`` and ``WORLD_SIZE`` are in the environment (``torchrun``
  sets them, or set them yourself with ``MASTER_ADDR`` and ``MASTER_PORT``), ``run`` starts
  only this process's role and rendezvouses through ``env://``.

torch RPC runs the pickled calls of any peer that reaches its port, so the processes talk
over one network interface only: ``--interface IFNAME`` (``add_network_arguments``) sets
``TP_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME``; a one-machine run uses the loopback
interface ``lo`` unless told otherwise.
"""
import logging
import os
import signal
import socket
import sys
import threading
import warnings
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

logger = logging.getLogger(__name__)

#: A role: ``role(name, options)`` runs between ``init_rpc`` and ``rpc.shutdown``.
Role = Callable[[str, Any], None]


#: What each process of a one-machine run starts with already imported (see ``spawn``).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.rpc", "torch.distributed.autograd",
           "distopt"]


def spawn(fn: Callable[..., None], args: Tuple[Any, ...], nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, the processes forked from a fork
    server that has imported ``PRELOAD`` once, instead of each importing torch again (about
    a second of a core each); ``spawn`` where the OS has no fork server. Like ``spawn``, the
    server is a fresh interpreter (no threads or CUDA state of this process), each process
    imports this script's ``__main__`` again, so it must be guarded, and each gets SIGINT
    when this process dies (``_stop_with``), however it dies."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
        return
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    # Only this process holds ``alive``'s other end: the processes read EOF once it is gone.
    alive, mine = context.Pipe(duplex=False)
    try:
        mp.start_processes(_stop_with, args=(alive, fn, args), nprocs=nprocs, join=True,
                           start_method="forkserver")
    finally:
        mine.close()
        alive.close()


def _stop_with(index: int, alive: Any, fn: Callable[..., None], args: Tuple[Any, ...]) -> None:
    """``fn(index, *args)`` in a process of ``spawn``, stopped when its starter dies.
    torch.multiprocessing asks the OS for SIGINT when a process's parent dies; a process
    forked from a fork server has the server as its parent, which outlives the starter
    (every forked process keeps it alive), so a thread waits on ``alive`` instead."""

    def wait() -> None:
        try:
            alive.recv()
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=wait, name="stop-with-parent", daemon=True).start()
    fn(index, *args)


def free_port() -> int:
    """A loopback port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def add_network_arguments(parser: Any) -> None:
    """``--interface``: the one network interface the example's processes talk over."""
    parser.add_argument(
        "--interface", default=None, metavar="IFNAME",
        help="network interface for TensorPipe and gloo (sets TP_SOCKET_IFNAME and "
             "GLOO_SOCKET_IFNAME); default: lo on one machine, else the environment's",
    )


def pin_interface(interface: Optional[str], local: bool) -> None:
    """Make TensorPipe and gloo (in this process and the ones it spawns) use ``interface``
    (None: ``lo`` for a ``local`` run, else leave the environment as it is).

    Raises:
        ValueError: no interface of that name on this machine.
    """
    if interface is None:
        if not local:
            return
        interface = "lo"
    names = [name for _, name in socket.if_nameindex()]
    if interface not in names:
        raise ValueError(f"Invalid --interface: {interface!r} (expected one of {names})")
    os.environ["TP_SOCKET_IFNAME"] = interface
    os.environ["GLOO_SOCKET_IFNAME"] = interface


def env_rank() -> Optional[Tuple[int, int]]:
    """``(RANK, WORLD_SIZE)`` from the environment, or None when this is a local run."""
    rank, size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or size is None:
        return None
    return int(rank), int(size)


def run(names: Sequence[str], role: Role, options: Any, rpc_timeout: float = 120.0) -> None:
    """Run ``role`` in every process of the world named ``names``.

    Args:
        names: one worker name per rank.
        role: called as ``role(name, options)`` in each process once RPC is up; RPC is shut
            down (gracefully: every worker waits for the others) when it returns.
        options: the parsed command line, passed to every role (it must pickle).
        rpc_timeout: seconds before an RPC fails.

    Raises:
        ValueError: ``WORLD_SIZE`` or ``RANK`` from the environment does not fit ``names``.
    """
    from_env = env_rank()
    pin_interface(getattr(options, "interface", None), local=from_env is None)
    if from_env is None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        spawn(_run_rank, (list(names), role, options, init_method, rpc_timeout), len(names))
        return
    rank, size = from_env
    check_restartable(os.environ)
    if size != len(names):
        raise ValueError(
            f"Invalid WORLD_SIZE: {size!r} (expected {len(names)}: one process per role "
            f"{list(names)!r})"
        )
    if not 0 <= rank < size:
        raise ValueError(f"Invalid RANK: {rank!r} (expected 0 <= RANK < {size})")
    _run_rank(rank, list(names), role, options, "env://", rpc_timeout)


def check_restartable(env: Any) -> None:
    """Refuse a torchrun that would restart its workers onto a store they cannot rendezvous on.

    With ``--max-restarts`` above 0 and the rendezvous store shared with the workers (torchrun's
    default), a restarted world finds the previous attempt's keys in the store: init_rpc's
    gloo group then waits on addresses of dead processes and never starts (pytorch#135712).
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` with the c10d rendezvous gives every attempt a
    fresh store; the static rendezvous (``--master-addr`` without ``--rdzv-backend``) always
    shares its store.

    Raises:
        RuntimeError: restarts are allowed and the store is shared; the message says what to
            run instead.
    """
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RuntimeError(
            f"Invalid torchrun for --max-restarts {restarts}: the workers share the "
            f"rendezvous store, so a restarted RPC world would wait forever on the previous "
            f"attempt's keys (pytorch#135712). Start torchrun with "
            f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment and "
            f"--rdzv-backend c10d (or --standalone on one machine)"
        )


def _run_rank(
    rank: int, names: Sequence[str], role: Role, options: Any, init_method: str, timeout: float
) -> None:
    # Several processes share few cores: one OpenMP thread each, or they oversubscribe.
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # init_rpc's start-up barrier uses a deprecated torch.distributed call; not ours to fix.
    warnings.filterwarnings("ignore", message="You are using a Backend")
    rpc.init_rpc(
        names[rank],
        rank=rank,
        world_size=len(names),
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method=init_method, num_worker_threads=16, rpc_timeout=timeout
        ),
    )
    try:
        role(names[rank], options)
    except BaseException:
        # A peer may be gone (the usual reason a role fails): a graceful shutdown would wait
        # for it for minutes. Leave at once; torchrun or ``spawn`` stops the others.
        rpc.shutdown(graceful=False)
        raise
    rpc.shutdown()


#: The torch.optim classes the dense examples (parameter_server, model_parallel_rnn) train
#: with: every one but those in ``REFUSED``.
OPTIMIZERS = (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop", "Rprop", "NAdam",
    "RAdam", "ASGD", "Adafactor",
)
#: The other torch.optim classes, and why they cannot train these models.
REFUSED = {
    "LBFGS": "its step needs a closure, which DistributedOptimizer.step(context_id) never gives",
    "SparseAdam": "it takes sparse gradients only, and these models' are dense",
    "Muon": "it takes 2-D parameters only, and these models have 1-D biases",
}


def optimizer_class(name: str) -> type:
    """The torch.optim class called ``name``, one of ``OPTIMIZERS``."""
    if name in OPTIMIZERS:
        return getattr(torch.optim, name)
    why = REFUSED.get(name, "not a torch.optim optimizer")
    raise ValueError(
        f"Invalid optimizer: {name!r} (expected one of {', '.join(OPTIMIZERS)}; {name}: {why})"
    )
