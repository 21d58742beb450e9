"""DistributedOptimizer step time per link rate, across three test hosts (network namespaces).

Three hosts on a private bridge (``tests/hosts/netns.py``, needs root): the trainer (rank 0,
host 0, the rendezvous) and two parameter owners (hosts 1 and 2), one process each, one
intra-op thread each, TensorPipe and gloo pinned to the hosts' ``eth0``. Each rate in
``--rates`` is set with a token bucket (``tc ... tbf``) on both directions of the owners'
links (``--limit-hosts``); the trainer's link is left alone. The parameters (Adam, lr 1e-3)
are ``--params-per-owner`` tensors of ``--param-numel`` elements on each owner (1M elements
in all by default).

What is timed, per rate, the candidates in turns, medians of ``--repeats`` after
``--warmup`` rounds:

- step: ``opt.step(ctx)`` alone, for ``distopt.DistributedOptimizer`` and for
  ``torch.distributed.optim.DistributedOptimizer`` over the same parameters, each after a
  cheap forward/backward in a fresh context (the sum of every parameter, a scalar per owner).
  A step sends the context id and gets small replies, so the link rate barely moves it.
- iteration (distopt): a whole training iteration, which is what a slow link costs: a
  forward that fetches an activation of ``--activation-kb`` from each owner in turn (an RPC
  whose result is computed from every parameter there), a loss that weights it, the
  backward (which sends each owner the activation's gradient, as large), ``opt.step(ctx)``,
  and leaving the context. Each owner's link carries the activation size each way.
- local Adam: ``torch.optim.Adam`` (its default implementation) over the same shapes in the
  trainer process, gradients set once: the step without any network.

"wire ms at rate" is not measured: it is the time the iteration's payload (activations and
their gradients, no headers) takes on the limited links at the nominal rate, to be read
against the iteration's growth over the unlimited row. A token bucket lets ``--burst`` bytes
through at full speed after an idle spell, so it must stay well below the activation (a
bucket as large as the activation hides the limit entirely: 1 MB at 1 Gbit/s did); and a
small bucket at a high rate delivers less than the rate (with 64 KB, the 1 Gbit/s iteration
grew by 1.1 to 1.4 times the wire time over the unlimited one in our runs on 2 cores, where
200 and 50 Mbit/s grew by the wire time less the bucket's free bytes).

Each process runs in a pid namespace of its own besides its network namespace (see
``netns.Hosts.command``): TensorPipe then sees processes of different machines and sends
tensors over TCP, through the links and their limits, instead of copying them between the
processes' memory (as it does on one machine).

Run (as root): ``python benchmarks/link_rate.py [--rates unlimited,1gbit,200mbit,50mbit]
[--repeats 30] [--markdown]``. The table (with ``--markdown``, markdown only) goes to
stdout and ends with the run time and the machine; progress and logs go to stderr. Where
namespaces cannot be made it says why and exits with status 2. The processes on the hosts
run this file with ``--role owner`` / ``--role trainer``.
"""
import argparse
import json
import logging
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Dict, List, Optional, Sequence

# The folder of this file holds functional.py, which would hide the ``functional`` package;
# import this folder's helpers as ``benchmarks.*`` from the repository root instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if _ROOT not in [os.path.abspath(p or os.curdir) for p in sys.path]:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.optim as torch_dist_optim  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
from torch import Tensor  # noqa: E402

import distopt  # noqa: E402
from benchmarks import _rpc_world as world  # noqa: E402
from benchmarks._machine import machine  # noqa: E402
from benchmarks.rpc_step import ParamSets, median_ms  # noqa: E402
from tests.hosts import netns  # noqa: E402

logger = logging.getLogger("benchmarks.link_rate")

ADAM = {"lr": 1e-3}
WORLD_SIZE = 3
OWNER_HOSTS = (1, 2)
#: The rendezvous port on host 0; the namespaces are new, so nothing else holds it.
PORT = 29500
#: Lines of the trainer's stdout that carry a reply to the benchmark; others are passed on.
_REPLY = "@link_rate "
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)$")
#: tc's SI prefixes (``kbit`` is 1,000 bit/s); ``bps`` is bytes per second.
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SIZE = re.compile(r"^\d+(\.\d+)?[kmg]?(b|bit)?$")
UNLIMITED = "unlimited"


# --- on the owners ------------------------------------------------------------------------

def activation(name: str, numel: int) -> Tensor:
    """RPC target: ``numel`` elements computed from every parameter of set ``name``, so the
    activation's gradient reaches each of them."""
    return world.set_sum(name) * torch.ones(numel)


def backend_options(address: str, port: int, rpc_timeout: float) -> rpc.TensorPipeRpcBackendOptions:
    """TensorPipe options for a world rendezvousing at ``address:port``."""
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{address}:{port}", num_worker_threads=32, rpc_timeout=rpc_timeout,
    )


def _quiet_torch() -> None:
    """Drop torch's warnings for the eager optimizers and TorchScript paths it builds."""
    logging.getLogger("torch.distributed.optim.optimizer").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="You are using a Backend")
    warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated")
    warnings.simplefilter("ignore", DeprecationWarning)


def run_owner(options: argparse.Namespace) -> None:
    """Role ``owner``: join the world and serve until the trainer shuts it down."""
    _quiet_torch()
    torch.set_num_threads(1)
    logger.info("owner%d: joining the world at %s:%d", options.rank, options.address, PORT)
    rpc.init_rpc(f"owner{options.rank}", rank=options.rank, world_size=WORLD_SIZE,
                 rpc_backend_options=backend_options(options.address, PORT, options.rpc_timeout))
    rpc.shutdown()


# --- on the trainer -----------------------------------------------------------------------

class Candidates:
    """What the trainer times, built once and measured again at every rate."""

    def __init__(self, options: argparse.Namespace) -> None:
        layout = [(f"owner{r}", options.params_per_owner, options.param_numel)
                  for r in OWNER_HOSTS]
        self.sets = ParamSets("link", layout)
        self.optimizers = {
            "distopt": distopt.DistributedOptimizer(torch.optim.Adam, self.sets.rrefs, **ADAM),
            "torch": torch_dist_optim.DistributedOptimizer(
                torch.optim.Adam, self.sets.rrefs, **ADAM
            ),
        }
        self.activation_numel = options.activation_kb * 1024 // 4
        self.weight = torch.randn(self.activation_numel)
        self.local_params = [torch.randn(n).requires_grad_() for _, c, n in layout
                             for _ in range(c)]
        for p in self.local_params:
            p.grad = torch.ones_like(p)
        self.local = torch.optim.Adam(self.local_params, **ADAM)

    def step_seconds(self, name: str) -> float:
        """One ``opt.step(ctx)`` after the cheap forward/backward."""
        with dist_autograd.context() as ctx:
            self.sets.forward_backward(ctx)
            start = time.perf_counter()
            self.optimizers[name].step(ctx)
            return time.perf_counter() - start

    def iteration_seconds(self) -> float:
        """Forward fetching an activation from each owner, backward, distopt step."""
        start = time.perf_counter()
        with dist_autograd.context() as ctx:
            acts = [rpc.rpc_sync(owner, activation, args=(name, self.activation_numel))
                    for owner, name in self.sets.names]
            loss = torch.stack([(a * self.weight).sum() for a in acts]).sum()
            dist_autograd.backward(ctx, [loss])
            self.optimizers["distopt"].step(ctx)
        return time.perf_counter() - start

    def local_seconds(self) -> float:
        """One local torch.optim.Adam step."""
        start = time.perf_counter()
        self.local.step()
        return time.perf_counter() - start

    def measure(self, repeats: int, warmup: int) -> Dict[str, float]:
        """Median ms of each candidate, in turns (the order rotates every round)."""
        timers = {
            "distopt": lambda: self.step_seconds("distopt"),
            "torch": lambda: self.step_seconds("torch"),
            "iteration": self.iteration_seconds,
            "local": self.local_seconds,
        }
        names = list(timers)
        samples: Dict[str, List[float]] = {name: [] for name in names}
        for i in range(warmup + repeats):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                seconds = timers[name]()
                if i >= warmup:
                    samples[name].append(seconds)
        return {name: median_ms(s) for name, s in samples.items()}


def _reply(message: Dict) -> None:
    print(_REPLY + json.dumps(message), flush=True)


def _command(timeout: float) -> str:
    """The benchmark's next line on stdin ("" at end of input); raises after ``timeout``."""
    if not select.select([sys.stdin], [], [], timeout)[0]:
        raise TimeoutError(f"no command from the benchmark in {timeout:.0f} s")
    return sys.stdin.readline()


def run_trainer(options: argparse.Namespace) -> None:
    """Role ``trainer``: build the candidates, then measure once per ``rate NAME`` line on
    stdin, replying on stdout, until ``done`` (or end of input)."""
    _quiet_torch()
    torch.set_num_threads(1)
    logger.info("trainer: joining the world at %s:%d", options.address, PORT)
    rpc.init_rpc("trainer", rank=0, world_size=WORLD_SIZE,
                 rpc_backend_options=backend_options(options.address, PORT, options.rpc_timeout))
    graceful = False
    try:
        candidates = Candidates(options)
        _reply({"ready": True})
        while True:
            words = _command(options.timeout).split()
            if not words or words[0] == "done":
                break
            try:
                _reply({"rate": words[1], **candidates.measure(options.repeats, options.warmup)})
            except Exception as exc:  # reported to the benchmark, which stops
                _reply({"error": f"{type(exc).__name__}: {exc}"})
                raise
        graceful = True
    finally:
        # A failed world is not waited for (the benchmark kills what is left).
        rpc.shutdown(graceful=graceful)


# --- the benchmark, in the root namespace -------------------------------------------------

class _Replies:
    """The trainer's replies, read by a thread so that every wait has a limit."""

    def __init__(self, stream) -> None:
        self._queue: "queue.Queue[Optional[Dict]]" = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            if line.startswith(_REPLY):
                self._queue.put(json.loads(line[len(_REPLY):]))
            else:
                sys.stderr.write(line)
        self._queue.put(None)

    def next(self, procs: Dict[str, subprocess.Popen], timeout: float) -> Dict:
        """The next reply; raises when it is an error, a process exits, or ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = self._queue.get(timeout=1.0)
            except queue.Empty:
                exited = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
                if exited:
                    raise RuntimeError(f"processes exited early (exit status): {exited}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no reply from the trainer in {timeout:.0f} s")
                continue
            if reply is None:
                raise RuntimeError("the trainer closed its output")
            if "error" in reply:
                raise RuntimeError(f"trainer: {reply['error']}")
            return reply


def _host_env() -> Dict[str, str]:
    env = dict(os.environ)
    env.update(MASTER_ADDR=f"{netns.SUBNET}.1", MASTER_PORT=str(PORT),
               TP_SOCKET_IFNAME=netns.INTERFACE, GLOO_SOCKET_IFNAME=netns.INTERFACE,
               OMP_NUM_THREADS="1")
    return env


def _stop(procs: Dict[str, subprocess.Popen], timeout: float) -> None:
    """Wait up to ``timeout`` for the processes to exit, then kill what is left."""
    deadline = time.monotonic() + timeout
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %d) did not exit; killing it", name, proc.pid)
    for name, proc in procs.items():
        if proc.poll() is None:
            proc.kill()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                logger.error("%s (pid %d) survived SIGKILL; the hosts' teardown retries",
                             name, proc.pid)


def run_on_hosts(options: argparse.Namespace, argv: Sequence[str]) -> List[Dict]:
    """Build the hosts, start the world, measure every rate; one reply per rate."""
    script = [sys.executable, os.path.abspath(__file__), *argv,
              "--address", f"{netns.SUBNET}.1"]
    results = []
    logger.info("building %d hosts", WORLD_SIZE)
    with netns.Hosts(WORLD_SIZE) as hosts:
        procs: Dict[str, subprocess.Popen] = {}
        try:
            logger.info("hosts %s up; starting the world", ", ".join(hosts.namespaces))
            for rank in OWNER_HOSTS:
                procs[f"owner{rank}"] = hosts.popen(
                    rank, [*script, "--role", "owner", "--rank", str(rank)], env=_host_env(),
                    stdout=sys.stderr,
                )
            trainer = procs["trainer"] = hosts.popen(
                0, [*script, "--role", "trainer", "--rank", "0"], env=_host_env(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            )
            replies = _Replies(trainer.stdout)
            replies.next(procs, options.timeout)
            logger.info("world up on %s", ", ".join(hosts.addresses))
            for rate in options.rates:
                for host in options.limit_hosts:
                    if rate == UNLIMITED:
                        hosts.unlimit(host)
                    else:
                        hosts.limit(host, rate, burst=options.burst)
                logger.info("rate %s on hosts %s: measuring", rate, options.limit_hosts)
                trainer.stdin.write(f"rate {rate}\n")
                trainer.stdin.flush()
                results.append(replies.next(procs, options.timeout))
                logger.info("rate %s: %s", rate, {k: round(v, 2) for k, v in results[-1].items()
                                                  if isinstance(v, float)})
            for host in options.limit_hosts:  # the world's shutdown need not wait on them
                hosts.unlimit(host)
            trainer.stdin.write("done\n")
            trainer.stdin.flush()
            _stop(procs, 60)
            logger.info("world shut down; removing the hosts")
        finally:
            _stop(procs, 0)
    logger.info("hosts removed")
    return results


def bits_per_second(rate: str) -> float:
    """A tc rate such as ``50mbit`` in bit/s."""
    number, prefix, unit = _RATE.match(rate).groups()
    return float(number) * _PREFIX[prefix] * (8 if unit == "bps" else 1)


def wire_ms(options: argparse.Namespace, rate: str) -> Optional[float]:
    """Time one iteration's activations and their gradients take at ``rate`` on the limited
    links, payload only (no headers, no token bucket's burst): the forward fetches from the
    owners one after the other, the backward sends to them at once. None when unlimited."""
    if rate == UNLIMITED:
        return None
    bits = options.activation_kb * 1024 * 8.0
    speed = bits_per_second(rate)

    def seconds(host: int, share: int = 1) -> float:
        return share * bits / speed if host in options.limit_hosts else 0.0

    forward = sum(max(seconds(0), seconds(r)) for r in OWNER_HOSTS)
    backward = max([seconds(0, share=len(OWNER_HOSTS))] + [seconds(r) for r in OWNER_HOSTS])
    return (forward + backward) * 1e3


def report(options: argparse.Namespace, results: List[Dict]) -> List[str]:
    """The table's lines."""
    md = options.markdown
    total = options.params_per_owner * options.param_numel * len(OWNER_HOSTS)
    header = ["rate", "distopt step ms", "torch step ms", "distopt/torch",
              "iteration ms (distopt)", "local Adam ms", "wire ms at rate"]
    lines = [
        f"machine: {machine()}; torch {torch.__version__}; 3 hosts (network namespaces), "
        f"1 process and 1 intra-op thread each; Adam lr=1e-3 over "
        f"{options.params_per_owner} x {options.param_numel} elements on each of 2 owners "
        f"({total:,} in all); activation {options.activation_kb} KB per owner each way per "
        f"iteration; rate (tc tbf, burst {options.burst}) on hosts "
        f"{','.join(map(str, options.limit_hosts))} both ways; "
        f"medians of {options.repeats}",
        "",
    ]
    rows = [[r["rate"], f"{r['distopt']:.2f}", f"{r['torch']:.2f}",
             f"{r['distopt'] / r['torch']:.2f}", f"{r['iteration']:.2f}", f"{r['local']:.2f}",
             "-" if wire_ms(options, r["rate"]) is None else f"{wire_ms(options, r['rate']):.2f}"]
            for r in results]
    if md:
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|---|" + "---:|" * (len(header) - 1))
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        widths = [max(len(c) for c in col) for col in zip(header, *rows)]
        for row in [header, *rows]:
            lines.append("  ".join([row[0].ljust(widths[0])]
                                   + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]))
    return lines


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="unlimited,1gbit,200mbit,50mbit",
                        help="comma-separated tc rates, or 'unlimited'")
    parser.add_argument("--burst", default="64kb",
                        help="the token bucket's size (tc tbf burst), e.g. 64kb")
    parser.add_argument("--limit-hosts", default="1,2",
                        help="comma-separated hosts whose links get the rate (0 is the trainer)")
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds per rate")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds per rate")
    parser.add_argument("--activation-kb", type=int, default=1024,
                        help="activation fetched from each owner per iteration, KB")
    parser.add_argument("--params-per-owner", type=int, default=4)
    parser.add_argument("--param-numel", type=int, default=131072)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for the world to start, and for each rate")
    parser.add_argument("--rpc-timeout", type=float, default=120.0)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--role", choices=["owner", "trainer"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    for name in ("repeats", "activation_kb", "params_per_owner", "param_numel"):
        if getattr(options, name) < 1:
            parser.error(f"Invalid --{name.replace('_', '-')}: {getattr(options, name)!r} "
                         f"(expected >= 1)")
    if options.warmup < 0:
        parser.error(f"Invalid --warmup: {options.warmup!r} (expected >= 0)")
    options.rates = [r.strip().lower() for r in options.rates.split(",") if r.strip()]
    bad = [r for r in options.rates if r != UNLIMITED and not _RATE.match(r)]
    if not options.rates or bad:
        parser.error(f"Invalid --rates: {bad or options.rates!r} "
                     f"(expected tc rates such as 50mbit, or {UNLIMITED})")
    if not _SIZE.match(options.burst.lower()):
        parser.error(f"Invalid --burst: {options.burst!r} (expected a tc size such as 64kb)")
    try:
        options.limit_hosts = sorted({int(h) for h in options.limit_hosts.split(",") if h})
    except ValueError:
        parser.error(f"Invalid --limit-hosts: {options.limit_hosts!r} (expected host numbers)")
    if not options.limit_hosts or not set(options.limit_hosts) <= set(range(WORLD_SIZE)):
        parser.error(f"Invalid --limit-hosts: {options.limit_hosts!r} "
                     f"(expected hosts 0 to {WORLD_SIZE - 1})")
    return options


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    options = _parse(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    if options.role == "owner":
        run_owner(options)
        return
    if options.role == "trainer":
        run_trainer(options)
        return
    why_not = netns.unavailable()
    if why_not is not None:
        print(f"cannot build test hosts: {why_not}", file=sys.stderr)
        sys.exit(2)
    # SIGTERM (timeout, kill) leaves through the with-block too, so the hosts are removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    start = time.perf_counter()
    results = run_on_hosts(options, argv)
    lines = report(options, results)
    if options.markdown:
        lines.append("")
    lines.append(f"run time: {time.perf_counter() - start:.0f} s on {machine()}")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
