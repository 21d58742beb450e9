"""Process groups for the tests: W processes on 127.0.0.1 (a free port), gloo.

``run_world(fn, world_size, *args)`` spawns the ranks, each calling ``fn(rank, world_size,
*args)`` inside an initialized default group, and returns every rank's result in rank order.
A rank that raises makes ``run_world`` raise with that rank's traceback. Children run with
one intra-op thread, so several ranks on two cores do not oversubscribe them.
"""
import datetime
import faulthandler
import io
import multiprocessing
import os
import queue
import time
import traceback
from typing import Any, Callable, List

import torch

from tests.distopt.conftest import free_port

#: The process group's timeout in the children: what a collective waits for a lost peer.
TIMEOUT_S = 20.0
#: The most a whole world may run before the test fails (no hang survives this).
WORLD_LIMIT_S = 240.0
#: How often the test looks for a rank that died without a result.
POLL_S = 1.0


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, timeout_s: float,
           args: tuple, results: Any) -> None:
    # CPU worlds: hide any GPU before torch first asks for one (torch's PowerSGD hook calls
    # torch.cuda.synchronize whenever CUDA is available, which refuses CPU tensors).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # A rank still running when the world's limit is near prints every thread's stack (to
    # the test's captured stderr), so that a hang shows where it is.
    faulthandler.dump_traceback_later(WORLD_LIMIT_S - 15.0, exit=False)
    faulthandler.enable(all_threads=True)  # and one that aborts, where it was
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        out = fn(rank, world_size, *args)
        # As bytes: a tensor put in a queue travels as a file descriptor that dies with us.
        buf = io.BytesIO()
        torch.save(out, buf)
        report = (rank, True, buf.getvalue())
    except BaseException:  # noqa: B902 - reported to the test
        report = (rank, False, traceback.format_exc())
    # Delivered (the queue's feeder thread flushed) before the teardown, which may abort.
    results.put(report)
    results.close()
    results.join_thread()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone
            pass
    # Skip interpreter teardown: gloo threads of a failed group can block it.
    os._exit(0)


def run_world(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = TIMEOUT_S, expect_dead: tuple = ()) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank; return the results in rank order.

    Args:
        expect_dead: ranks that end without a result (killed by the test itself); their
            entry is None.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, timeout_s, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: List[Any] = [None] * world_size
    failures = []
    waiting = set(range(world_size)) - set(expect_dead)
    deadline = time.monotonic() + WORLD_LIMIT_S
    try:
        while waiting:
            try:
                rank, ok, value = results.get(timeout=POLL_S)
            except queue.Empty:
                # A rank that exited has flushed its result: one more poll would have it.
                gone = sorted(r for r in waiting if procs[r].exitcode is not None)
                if gone and results.empty():
                    raise AssertionError("; ".join(
                        f"rank {r} exited with code {procs[r].exitcode} without a result "
                        f"(its output is in the test's captured stderr)" for r in gone
                    )) from None
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"ranks {sorted(waiting)} gave no result in {WORLD_LIMIT_S:.0f} s "
                        f"(their stacks are in the test's captured stderr)"
                    ) from None
                continue
            waiting.discard(rank)
            if ok:
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise AssertionError("\n".join(failures))
    return out
