"""Rank-side scenarios of issue 36: training loops as users write them, unmodified.

nanoGPT's train.py is the model (``nanogpt``): AdamW with decay / no-decay groups, gradient
accumulation with ``no_sync``, a GradScaler (enabled or not, as its ``dtype`` decides),
``clip_grad_norm_(model.parameters(), 1.0)`` between backward and step, the optimizer's
``state_dict()`` saved by rank 0 only, and a resume from that file. Each run is compared bit
for bit with DDP + torch.optim on the same batches. The others: Join over two optimizers
(with ``save()`` and ``consolidate_state_dict`` inside the block, after a rank has joined),
changes made to the model after the optimizer was built, and ``torch.compile`` with
``module=``.
"""
import contextlib
import copy
import math
import os
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel

from distopt.parallel import DataParallelOptimizer
from tests.parallel.buffer_join_scenarios import BatchNormNet, image_batch
from tests.parallel.model_scenarios import BATCH, SEQ, VOCAB, TinyLM
from tests.parallel.training import flat_params

#: nanoGPT's AdamW (its betas; a larger lr so that a few steps move the parameters), on
#: torch's fused kernel, the one the compiled steps run.
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "fused": True}
ITERS, ACCUM, SAVE_AT, CLIP = 4, 2, 2, 1.0


def _groups(model: torch.nn.Module) -> List[Dict[str, Any]]:
    """nanoGPT's ``configure_optimizers``: weight decay for every parameter of 2 or more
    dimensions, none for the others."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _batch(it: int, micro: int, rank: int) -> Any:
    gen = torch.Generator().manual_seed(7000 + 100 * it + 10 * micro + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _iterations(model: torch.nn.Module, opt: Any, no_sync: Callable, scaler: Any, first: int,
                last: int, rank: int, save: Optional[Callable[[int], None]] = None) -> List[Any]:
    """nanoGPT's loop from iteration ``first`` to ``last`` (excluded); the parameters after
    each. ``save(it)`` runs after iteration ``it``'s step (nanoGPT saves between steps)."""
    after = []
    for it in range(first, last):
        for micro in range(ACCUM):
            x, y = _batch(it, micro, rank)
            torch.manual_seed(500 + 10 * it + micro + rank)  # dropout, alike on both sides
            with no_sync() if micro < ACCUM - 1 else contextlib.nullcontext():
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) / ACCUM
                scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        after.append(flat_params(model).clone())
        if save is not None:
            save(it)
    return after


def _scaler(enabled: bool) -> Any:
    # nanoGPT: GradScaler(enabled=(dtype == 'float16')); a huge first scale makes the
    # first step overflow: the scaler drops that step, as in fp16 runs.
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 40 if enabled else 2.0 ** 16,
                                enabled=enabled)


def nanogpt(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """Per (scaler, options): DDP + torch.optim's parameters after each iteration, ours, and
    ours resumed at ``SAVE_AT`` from the state_dict rank 0 saved alone (sharded: after
    ``consolidate_state_dict(to=0)`` on every rank; ``state_dict()`` before it raises at
    once, the error kept)."""
    out: Dict[str, Any] = {}
    for scaled in (False, True):
        model = TinyLM()
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(_groups(model), **ADAMW)
        out[f"{scaled}/ddp"] = _iterations(ddp, opt, ddp.no_sync, _scaler(scaled), 0, ITERS,
                                           rank)
        for name, options in {"defaults": {}, "flat": {"shard": "flat"},
                              "param": {"shard": "param"}}.items():
            key = f"{scaled}/{name}"
            file = os.path.join(path, f"{key.replace('/', '-')}.pt")
            model = TinyLM()
            opt = DataParallelOptimizer(torch.optim.AdamW, _groups(model), module=model,
                                        **options, **ADAMW)

            def save(it: int, opt: Any = opt, model: torch.nn.Module = model,
                     file: str = file, key: str = key) -> None:
                if it != SAVE_AT:
                    return
                if opt.shard is not None:
                    if rank == 0:
                        try:  # nanoGPT's habit, unchanged: raises at once, nothing waits
                            opt.state_dict()
                        except RuntimeError as exc:
                            out[f"{key}/lone"] = str(exc)
                    opt.consolidate_state_dict(to=0)  # on every rank
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "iter_num": it}, file)
                if rank == 1 and opt.shard is not None:
                    try:
                        opt.state_dict()
                    except RuntimeError as exc:
                        out[f"{key}/not-to"] = str(exc)

            out[key] = _iterations(model, opt, opt.no_sync, _scaler(scaled), 0, ITERS, rank,
                                   save)
            if opt.shard is not None and rank == 0:
                try:  # consolidated before a step: out of date now
                    opt.state_dict()
                except RuntimeError as exc:
                    out[f"{key}/stale"] = str(exc)
            opt.close()
            dist.barrier()  # rank 0's file is written
            checkpoint = torch.load(file, weights_only=True)
            model = TinyLM()
            model.load_state_dict(checkpoint["model"])
            opt = DataParallelOptimizer(torch.optim.AdamW, _groups(model), module=model,
                                        **options, **ADAMW)
            opt.load_state_dict(checkpoint["optimizer"])
            out[f"{key}/resumed"] = _iterations(model, opt, opt.no_sync, _scaler(scaled),
                                                checkpoint["iter_num"] + 1, ITERS, rank)
            opt.close()
    return out


def late_clipping(rank: int, world_size: int) -> Dict[str, Any]:
    """overlap=True, clipping only from the third step on: each such step raises (its
    buckets were stepped during backward with the averages)."""
    model = torch.nn.Linear(8, 4)
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.5, momentum=0.9,
                                fused=True)
    ref_model = torch.nn.Linear(8, 4)
    ref_model.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(ref_model)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.5, momentum=0.9, fused=True)
    out: Dict[str, Any] = {"errors": [], "ours": [], "ddp": []}
    for step in range(5):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(4, 8, generator=gen) * 10
        for m, o in ((ddp, ref), (model, opt)):
            m(x).pow(2).sum().backward()
            if step >= 2:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            try:
                o.step()
            except RuntimeError as exc:
                out["errors"].append((step, str(exc)))
            o.zero_grad()
        out["ours"].append(flat_params(model).clone())
        out["ddp"].append(flat_params(ref_model).clone())
    opt.close()
    return out


def norm_logged_on_rank0(rank: int, world_size: int, shard: Optional[str]) -> Dict[str, Any]:
    """Rank 0 alone computes the gradient norm with ``clip_grad_norm_(..., inf)`` between
    backward and step (it scales ``.grad`` in place by 1), SGD over 4 buckets."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    ref_model = copy.deepcopy(model)
    opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9,
                                fused=True, shard=shard, bucket_cap_mb=0.0002)
    ddp = DistributedDataParallel(ref_model)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9, fused=True)
    out: Dict[str, Any] = {"ours": [], "ddp": [], "edited": []}
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        for m, o in ((ddp, ref), (model, opt)):
            m(x).pow(2).sum().backward()
            if rank == 0:
                torch.nn.utils.clip_grad_norm_(m.parameters(), math.inf)
            o.step()
            o.zero_grad()
        out["edited"].append((opt._engine.status.overlap.name == "GRADS_EDITED"))
        out["ours"].append(flat_params(model).clone())
        out["ddp"].append(flat_params(ref_model).clone())
    opt.close()
    return out


class TwoPart(torch.nn.Module):
    """A body with BatchNorm (one optimizer, ``module=body``) and a head (another)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = BatchNormNet(0)
        self.head = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


SGD = {"lr": 0.05, "momentum": 0.9, "fused": True}


def two_optimizers_join(rank: int, world_size: int, path: str, nested: bool) -> Dict[str, Any]:
    """Rank 0 has 5 batches, rank 1 3: DDP + two torch.optim optimizers under ``Join([ddp])``
    against two DataParallelOptimizers under ``Join([o1, o2])`` (or nested Joins), with
    ``save()`` of both and the body's ``consolidate_state_dict`` at the 4th iteration, when
    rank 1 has joined."""
    batches = 5 if rank == 0 else 3
    out: Dict[str, Any] = {}

    model = TwoPart()
    ddp = DistributedDataParallel(model)
    refs = [torch.optim.SGD(model.body.trained(), **SGD),
            torch.optim.SGD(model.head.parameters(), **SGD)]
    with Join([ddp]):
        for step in range(batches):
            x, y = image_batch(rank, step)
            F.mse_loss(ddp(x), y).backward()
            for o in refs:
                o.step()
                o.zero_grad()
            if step == 3:
                out["ref_state_at_3"] = copy.deepcopy(refs[0].state_dict()["state"])
    out["ddp"] = flat_params(model).clone()
    out["ddp_buffers"] = [b.clone() for b in model.buffers()]

    model = TwoPart()
    o1 = DataParallelOptimizer(torch.optim.SGD, model.body.trained(), module=model.body,
                               shard="flat", **SGD)
    o2 = DataParallelOptimizer(torch.optim.SGD, model.head.parameters(), **SGD)
    outer = Join([o1]) if nested else Join([o1, o2])
    inner = Join([o2]) if nested else contextlib.nullcontext()
    with outer, inner:
        for step in range(batches):
            x, y = image_batch(rank, step)
            F.mse_loss(model(x), y).backward()
            for o in (o1, o2):
                o.step()
                o.zero_grad()
            if step == 3:  # rank 1 has joined
                o1.save(os.path.join(path, f"body-{nested}"))
                o2.save(os.path.join(path, f"head-{nested}"))
                o1.consolidate_state_dict(to=None)  # rank 1, joined, gets it too
                out["state_at_3"] = o1.state_dict()["state"]
                out["head_state_at_3"] = copy.deepcopy(o2.state_dict()["state"])
    out["ours"] = flat_params(model).clone()
    out["buffers"] = [b.clone() for b in model.buffers()]
    try:  # rank 1 shadowed the 5th step: its consolidated state is out of date too
        o1.state_dict()
        out["stale"] = "no error"
    except RuntimeError as exc:
        out["stale"] = str(exc)
    # The checkpoints written inside the block load into new optimizers, equal to the state
    # at that iteration.
    o1.close()
    o2.close()
    again = TwoPart()
    n1 = DataParallelOptimizer(torch.optim.SGD, again.body.trained(), module=again.body,
                               shard="flat", **SGD)
    n2 = DataParallelOptimizer(torch.optim.SGD, again.head.parameters(), **SGD)
    n1.load(os.path.join(path, f"body-{nested}"))
    n2.load(os.path.join(path, f"head-{nested}"))
    n1.consolidate_state_dict(to=None)
    out["loaded_body"] = n1.state_dict()["state"]
    out["loaded_head"] = n2.state_dict()["state"]
    n1.close()
    n2.close()
    return out


def load_inside_join(rank: int, world_size: int, path: str) -> Dict[str, str]:
    """``load()``, a sharded ``load_state_dict()``, ``dcp_state_dict()`` and ``load_dcp()``
    (collectives), inside a Join block are refused at once, on every rank alike."""
    out = {}
    for shard in (None, "flat"):
        model = torch.nn.Linear(2, 2)
        opt = DataParallelOptimizer(torch.optim.SGD, model.parameters(), lr=0.1, shard=shard)
        opt.save(path)
        opt.consolidate_state_dict(to=None)
        state = opt.state_dict()
        calls = {"load": lambda: opt.load(path),
                 "load_state_dict": lambda: opt.load_state_dict(state),
                 "dcp_state_dict": opt.dcp_state_dict,
                 "load_dcp": lambda: opt.load_dcp(path)}
        for name, call in calls.items():
            try:
                with Join([opt]):
                    call()
                out[f"{shard}/{name}"] = "no error"
            except RuntimeError as exc:
                out[f"{shard}/{name}"] = str(exc)
        opt.close()
    return out


def changed_after_construction(rank: int, world_size: int) -> Dict[str, Any]:
    """The model cast, or laid out as channels_last, after the optimizer was built."""
    out: Dict[str, Any] = {}
    x, y = image_batch(rank, 0)
    for cast in ("double", "half", "bfloat16"):
        model = BatchNormNet(0)
        opt = DataParallelOptimizer(torch.optim.SGD, model.trained(), module=model, **SGD)
        before = flat_params(model).clone()
        getattr(model, cast)()
        try:
            F.mse_loss(model(x.to(getattr(torch, cast if cast != "half" else "float16"))),
                       y.to(model.head.weight.dtype)).backward()
            out[cast] = "no error"
        except RuntimeError as exc:
            out[cast] = str(exc)
        out[f"{cast}/unchanged"] = torch.equal(flat_params(model), before.to(model.head.weight.dtype))
        opt.close()
    # channels_last after construction: refused sharded (its state's pieces follow the memory
    # order); unsharded, exact against DDP over a model laid out before DDP was built.
    for shard in (None, "flat", "param"):
        model = BatchNormNet(0)
        opt = DataParallelOptimizer(torch.optim.SGD, model.trained(), module=model,
                                    shard=shard, **SGD)
        model.to(memory_format=torch.channels_last)
        ref_model = BatchNormNet(0)
        # DDP laid out before it is built: after, DDP itself ends 0.23 off torch.optim here
        ref_model.to(memory_format=torch.channels_last)
        ddp = DistributedDataParallel(ref_model)
        ref = torch.optim.SGD(ref_model.trained(), **SGD)
        try:
            for step in range(3):
                x, y = image_batch(rank, step)
                for m, o in ((ddp, ref), (model, opt)):
                    F.mse_loss(m(x), y).backward()
                    o.step()
                    o.zero_grad()
            out[f"channels_last/{shard}"] = torch.equal(flat_params(model),
                                                        flat_params(ref_model))
        except RuntimeError as exc:
            out[f"channels_last/{shard}"] = str(exc)
        opt.close()
    return out


def _compiled_run(model: torch.nn.Module, module: Optional[torch.nn.Module], forward: Any,
                  rank: int) -> List[torch.Tensor]:
    """Three SGD steps of ``forward``; the model's parameters and buffers after each. With
    ``module=None`` ``forward`` is a DDP and torch.optim steps, the reference."""
    if module is None:
        opt: Any = torch.optim.SGD(model.trained(), **SGD)
    else:
        opt = DataParallelOptimizer(torch.optim.SGD, model.trained(), module=module, **SGD)
    after = []
    for step in range(3):
        x, y = image_batch(rank, step)
        F.mse_loss(forward(x), y).backward()
        opt.step()
        opt.zero_grad()
        after.append(torch.cat([flat_params(model)] + [b.double().reshape(-1).float()
                                                        for b in model.buffers()]))
    if module is not None:
        opt.close()
    return after


def compiled_module(rank: int, world_size: int) -> Dict[str, Any]:
    """``torch.compile(model, fullgraph=True)`` with ``module=`` the model and with
    ``module=`` the compiled module: BatchNorm's buffers broadcast as DDP's (equal to DDP's,
    eager, parameters and buffers after each step); a torch container (``nn.Sequential``)
    compiled with ``fullgraph=True`` and ``module=`` the container: dynamo's error, which
    names the fix."""
    out: Dict[str, Any] = {}
    ref_model = BatchNormNet(0)
    ddp = DistributedDataParallel(ref_model)
    out["ddp"] = _compiled_run(ref_model, None, ddp, rank)
    model = BatchNormNet(0)
    out["module=model"] = _compiled_run(
        model, model, torch.compile(model, fullgraph=True, backend="eager"), rank)
    model = BatchNormNet(0)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    out["module=compiled"] = _compiled_run(model, compiled, compiled, rank)
    torch._dynamo.reset()

    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = DataParallelOptimizer(torch.optim.SGD, seq.parameters(), module=seq, **SGD)
    try:
        torch.compile(seq, fullgraph=True, backend="eager")(torch.randn(3, 4))
        out["container"] = "no error"
    except Exception as exc:  # dynamo's Unsupported
        out["container"] = f"{type(exc).__name__}: {exc}"
    opt.close()
    torch._dynamo.reset()
    return out


def untouched_grads_keep_overlapping(rank: int, world_size: int) -> Dict[str, Any]:
    """A loop that leaves ``.grad`` alone keeps stepping buckets during backward from the
    second step on, whatever the scheme: per options, whether the third step's buckets were
    stepped during backward and whether the optimizer decided that the loop edits
    gradients."""
    from distopt.parallel import Cast, PowerSGD, TopK

    out = {}
    schemes = {"plain": {}, "flat": {"shard": "flat"}, "param": {"shard": "param"},
               "topk": {"compression": TopK(0.5)}, "cast": {"compression": Cast(torch.bfloat16)},
               "powersgd": {"compression": PowerSGD(rank=1, start_iter=2)},
               "passes": {"backward_passes_per_step": 2}}
    for name, options in schemes.items():
        model = TinyLM()
        opt = DataParallelOptimizer(torch.optim.AdamW, _groups(model), bucket_cap_mb=0.002,
                                    **options, **ADAMW)
        seen = []
        for it in range(3):
            for micro in range(options.get("backward_passes_per_step", 1)):
                x, y = _batch(it, micro, rank)
                F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
            seen.append(opt._engine.status.in_backward)
            opt.step()
            opt.zero_grad()
        out[name] = {"in_backward": seen, "edited": (opt._engine.status.overlap.name == "GRADS_EDITED")}
        opt.close()
    return out


def join_with_ddp(rank: int, world_size: int) -> Dict[str, str]:
    """A DataParallelOptimizer and a DDP model in one Join, either order: torch's Join
    refuses them at once (their rounds would not pair)."""
    model = torch.nn.Linear(2, 2)
    head = torch.nn.Linear(2, 1)
    ddp = DistributedDataParallel(model)
    opt = DataParallelOptimizer(torch.optim.SGD, head.parameters(), lr=0.1)
    out = {}
    for name, joinables in (("opt-first", [opt, ddp]), ("ddp-first", [ddp, opt])):
        try:
            with Join(joinables):
                pass
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    opt.close()
    return out
