"""Checkpoints of a DataParallelOptimizer: the replicated state once, residuals per rank.

A checkpoint is a directory (on a filesystem every rank shares)::

    manifest.json                       written last, by the first rank: class, world size,
                                        generation, and the files of this save, each with
                                        its size and CRC-32
    dp-<generation>-state-rank<r>.pt    torch.optim's state_dict (r = 0 only, unless the
                                        state differs per rank: RoundRobin)
    dp-<generation>-shard-rank<r>.pt    sharded: rank r's pieces of the state, where they lie
                                        and the shapes of their parameters
    dp-<generation>-residuals-rank<r>.pt  each rank's error-feedback residuals and its
                                        compression state (PowerSGD), if any

Files are written with ``distopt.manifest.write_atomic`` (temporary name, fsync, rename)
under a new generation id; the manifest, renamed last, names them, so a failed save leaves
the previous checkpoint loadable, and files of other generations are removed only after
the new manifest is in place. Every rank reports whether its writes succeeded through one
all_reduce before the manifest is written, and on load its reason for refusing its part,
if any, before any rank changes anything (``refuse_everywhere``): every rank then raises
the same error, naming each refusing rank and its reason. Load refuses what
``distopt.manifest`` refuses (shared with the RPC format): a manifest that does not parse,
a file name outside the directory, a file missing, resized or corrupted; and a state saved
for a parameter of another shape.

Sharded, a rank reads the pieces it will hold once the load has cut its buckets as the
saved state says (``distopt.parallel.state.load_plan``), not those of its buckets before.
"""
import logging
import os
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from distopt import manifest as _manifest
from distopt.manifest import MANIFEST, crc32_of, write_atomic
from distopt.parallel import shard as _shard
from distopt.parallel import state as _state
from distopt.parallel.sync import collective_device, global_rank, lost_agreement, refuse_everywhere

logger = logging.getLogger(__name__)

FORMAT = "distopt.data_parallel"
VERSION = 2

__all__ = ["FORMAT", "MANIFEST", "load", "save"]


def _agree(ok: bool, opt: Any, what: str, path: str) -> bool:
    """Whether every rank's ``ok`` is True (one all_reduce; RuntimeError if it fails)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32,
                        device=collective_device(opt.process_group))
    try:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=opt.process_group)
    except Exception as exc:
        raise lost_agreement(opt, f"{what} {path!r}", exc) from exc
    return bool(flag.item())


def save(opt: Any, path: str) -> Dict[str, Any]:
    path = os.path.abspath(path)
    box = [_manifest.new_generation() if opt.rank == 0 else None]
    try:
        group = opt.process_group
        dist.broadcast_object_list(box, src=global_rank(group, 0), group=group)
    except Exception as exc:
        raise lost_agreement(opt, f"save to {path!r}", exc) from exc
    generation = box[0]
    written: Dict[str, int] = {}  # file name -> bytes written
    error = None
    try:
        _write_files(opt, path, generation, written)
    except Exception as exc:  # reported on every rank below
        error = exc
    # A failed collective leaves this generation's files (whether some rank went on to
    # write the manifest cannot be known here); the next save removes them.
    if not _agree(error is None, opt, "save to", path):
        _manifest.prune(path, lambda name: name in written)
        raise RuntimeError(
            f"Invalid save to {path!r}: rank {opt.rank} "
            f"{'failed: ' + repr(error) if error else 'succeeded but another rank failed'}"
        ) from error
    manifest = _write_manifest(opt, path, generation, written)
    # Each rank removes its own files of older generations (and rank 0 the shared state).
    _manifest.prune(path, lambda name: name.endswith(f"-rank{opt.rank}.pt") and (
        _manifest.generation_of(name, "dp") not in (None, generation)))
    _agree(True, opt, "save to", path)  # every rank's old files are gone when save returns
    logger.info("rank %d: saved generation %s to %s", opt.rank, generation, path)
    return manifest


def _write_files(opt: Any, path: str, generation: Any, written: Dict[str, int]) -> None:
    """This rank's files of ``generation``: its state (or shard) and its residuals, each
    recorded in ``written`` (name -> bytes) as it is in place."""
    os.makedirs(path, exist_ok=True)
    sharded = opt.shard is not None
    sd = _state.state_dict(opt, gather=False)
    sd.pop("residuals_of", None)  # the residuals file's name says whose
    residuals = sd.pop("residuals", None)
    compression_state = sd.pop("compression", None)
    if compression_state is not None:
        residuals = {"residuals": residuals or {}, "compression": compression_state}
    if opt.sync is not None or sharded or opt.rank == 0:
        name = _file_name(generation, "shard" if sharded else "state", opt.rank)
        written[name] = write_atomic(os.path.join(path, name), lambda f: torch.save(sd, f))
    if residuals is not None:
        name = _file_name(generation, "residuals", opt.rank)
        written[name] = write_atomic(os.path.join(path, name),
                                     lambda f: torch.save(residuals, f))


def _write_manifest(opt: Any, path: str, generation: Any,
                    written: Dict[str, int]) -> Dict[str, Any]:
    """Every rank's file records gathered, and the manifest written by the first rank;
    RuntimeError on every rank (this generation's files removed) if it could not be."""
    try:
        records = [None] * dist.get_world_size(opt.process_group)
        dist.all_gather_object(
            records,
            {name: {"bytes": size, "crc32": crc32_of(os.path.join(path, name))}
             for name, size in written.items()},
            group=opt.process_group,
        )
    except Exception as exc:
        _manifest.prune(path, lambda name: name in written)
        raise lost_agreement(opt, f"save to {path!r}", exc) from exc
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "generation": generation,
        "optimizer_class": opt.optimizer_class.__name__,
        "world_size": opt.world_size,
        "state_per_rank": opt.sync is not None,
        "shard": opt.shard,
        "residuals": opt.reduction.error_feedback or opt.reduction.state_dict() is not None,
        "files": {name: record for part in records for name, record in part.items()},
    }
    error = None
    if opt.rank == 0:
        try:
            _manifest.write(path, manifest)
        except Exception as exc:  # reported on every rank below
            error = exc
    if not _agree(error is None, opt, "save to", path):
        _manifest.prune(path, lambda name: name in written)
        raise RuntimeError(f"Invalid save to {path!r}: the manifest was not written: {error!r}")
    return manifest


def load(opt: Any, path: str) -> None:
    path = os.path.abspath(path)
    loader = None
    error = None
    try:
        manifest = _manifest.read(path, FORMAT, VERSION, "DataParallelOptimizer.save")
        files = manifest.get("files")
        if not isinstance(files, dict):
            raise ValueError(f"Invalid checkpoint {path!r}: {MANIFEST!r} has no map of files")
        for name in files:  # every file it names lies in the directory, read or not
            _manifest.check_name(path, name)
        if manifest["optimizer_class"] != opt.optimizer_class.__name__:
            raise ValueError(
                f"Invalid checkpoint {path!r}: optimizer_class {manifest['optimizer_class']!r} "
                f"(expected {opt.optimizer_class.__name__!r})"
            )
        if manifest["world_size"] != opt.world_size and (
            manifest["state_per_rank"] or manifest["residuals"]
        ):
            raise ValueError(
                f"Invalid checkpoint {path!r}: world_size {manifest['world_size']} (expected "
                f"{opt.world_size}: its state or residuals are per rank)"
            )
        generation = manifest["generation"]
        part, compression = None, None
        if manifest["residuals"]:
            name = _checked(path, manifest, _file_name(generation, "residuals", opt.rank))
            part = torch.load(name, weights_only=True)
            if isinstance(part, dict) and "compression" in part:
                compression = part["compression"]
                part = part["residuals"]
        plan = None
        if manifest.get("shard"):
            sd, plan = _join_shards(opt, path, manifest, compression)
        else:
            source = opt.rank if manifest["state_per_rank"] else 0
            name = _checked(path, manifest, _file_name(generation, "state", source))
            sd = torch.load(name, weights_only=True)
        if compression is not None:
            sd["compression"] = compression
        if manifest["residuals"] and opt.reduction.error_feedback:
            sd["residuals"] = part
        loader = _state.checked_loader(opt, sd, plan, agreed=True)
    except Exception as exc:  # reported on every rank below
        error = exc
    # Every rank raises the same message, naming the ranks that refused and why.
    refuse_everywhere(opt, error, "checkpoint", "load()", f"load from {path!r}")
    loader()
    logger.info("rank %d: loaded %s", opt.rank, path)


def _join_shards(opt: Any, path: str, manifest: Dict[str, Any],
                 compression: Any) -> Tuple[Dict[str, Any], Any]:
    """The state this rank needs, in torch.optim's format, from a sharded checkpoint of any
    world size, and ``distopt.parallel.state.load_plan``'s plan for it: whole parameters, joined from every
    shard file that holds a piece of one (read memory-mapped); each piece is checked to be
    there exactly once, and each parameter to have the shape it was saved with.

    The pieces this rank needs are those it holds once the load has cut its buckets as the
    saved state says (``compression``'s layout, or the files' ``"layout"``): not
    necessarily those of its buckets now."""
    trained = opt.bucketed
    loaded = []
    for r in range(manifest["world_size"]):
        name = _checked(path, manifest, _file_name(manifest["generation"], "shard", r))
        loaded.append((name, torch.load(name, weights_only=True, mmap=True)))
    layout = loaded[0][1].get("layout") if loaded else None
    plan = _state.load_plan(opt, {"compression": compression, "layout": layout})
    needed = set(plan[1]) if opt.shard is not None else set(trained)
    parts: Dict[int, List[Any]] = {}
    groups = None
    for name, part in loaded:
        groups = part["param_groups"]
        for i, shape in sorted(part.get("shapes", {}).items()):  # none before this version
            if i in trained and list(shape) != list(trained[i].shape):
                raise ValueError(
                    f"Invalid checkpoint {path!r}: state[{i}] was saved for a parameter of "
                    f"shape {list(shape)} (expected {list(trained[i].shape)} for params[{i}] "
                    f"of shape {list(trained[i].shape)}; {os.path.basename(name)!r})"
                )
        for i, (a, b) in part["pieces"].items():
            if i in needed:
                parts.setdefault(i, []).append((a, b, part["state"].get(i), name))
    state = {}
    for i in sorted(needed):
        ps = sorted(parts.get(i, []), key=lambda t: t[0])
        n = trained[i].numel()
        bounds = [(a, b) for a, b, _, _ in ps]
        starts = [0] + [b for _, b in bounds[:-1]]
        if not ps or [a for a, _ in bounds] != starts or bounds[-1][1] != n:
            raise ValueError(
                f"Invalid checkpoint {path!r}: the pieces of parameter {i}'s state "
                f"{[(a, b, os.path.basename(f)) for a, b, _, f in ps]} do not cover its "
                f"{n} elements exactly once"
            )
        stepped = [e is not None for _, _, e, _ in ps]
        if any(stepped) != all(stepped):
            raise ValueError(
                f"Invalid checkpoint {path!r}: parameter {i} has state in some of its pieces "
                f"only ({[os.path.basename(f) for _, _, e, f in ps if e is None]} lack it)"
            )
        if all(stepped):
            state[i] = _shard.merge_pieces([(a, b, e) for a, b, e, _ in ps], trained[i].shape,
                                           manifest["shard"] == "flat")
    sd = {"state": state, "param_groups": groups}
    if layout is not None:
        sd["layout"] = layout
    return sd, plan


def _file_name(generation: Any, kind: str, rank: int) -> str:
    """The name of a rank's file of one save (``kind``: "state", "shard" or "residuals")."""
    return f"dp-{generation}-{kind}-rank{rank}.pt"


def _checked(path: str, manifest: Dict[str, Any], name: str) -> str:
    """``path/name`` once it is checked against the manifest's record of it (see
    ``distopt.manifest.check_file``)."""
    return _manifest.check_file(path, name, manifest["files"].get(name))
