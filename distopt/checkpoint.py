"""Sharded checkpoints: every owner writes its own shard, the trainer writes a small manifest.

A checkpoint is a directory::

    manifest.json                      written last, by the trainer: class, param groups,
                                       parameter shapes, and the shard files of this save
    shard-<generation>-<k>-<owner>.pt  one per owner: torch.save of its parameters' state
                                       (torch.optim's format, global parameter indices)
                                       and its groups' hyper-parameters

Owners write in parallel, so the trainer never holds the whole state, and each writes
straight from its optimizer's tensors under their locks (steps on those parameters wait
for the write; no second copy of the state is made). Owners on other
machines write to the same ``path``: it must be a directory on a filesystem that every
owner and the trainer share (NFS, Lustre, a mounted bucket...), or the trainer's manifest
will name files it cannot see.

Every file is written to a temporary name in the same directory, flushed, fsync'ed, and
then renamed over its final name (``os.replace``, atomic on POSIX); ``distopt.manifest``
holds these writes and the file checks below, shared with the data-parallel format. Each
save uses a new generation id in its shard names, and the manifest, renamed last, is the
only thing that names the shards: until it is in place the previous manifest and its shards
are untouched, so a save that fails or a trainer that dies mid-save leaves the previous
checkpoint intact and loadable. Shards of other generations are removed only after the
new manifest is in place. Two saves into the same directory at once are not supported.

``load`` checks the manifest against the optimizer on the trainer, then has every owner
read and check its part (first round) before any owner changes anything (second round).
A checkpoint cannot lie about what it holds: the manifest records each shard's size,
CRC-32 and parameters, and each shard records its own name and parameters. The trainer
refuses, naming the file, a manifest that does not parse, a shard name that leaves the
directory (``../x``, an absolute path, a symlink out), parameters not covered exactly once,
a shard missing, of another size, or not named by the manifest (an extra shard of its
generation); each owner refuses a shard whose CRC-32, recorded name or parameters differ
from the manifest's (renamed or swapped files), or that is not tensors-only.
"""
import logging
import os
import re
import uuid
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from distopt import manifest as _manifest
from distopt import state
from distopt.saved_state import check_saved_entry, check_saved_groups
from distopt.errors import returns_failure
from distopt.fanout import fan_out
from distopt.placement import Placement
# crc32_of and write_atomic: also this module's names for tests and examples.
from distopt.manifest import MANIFEST, check_crc32, check_file, check_name, crc32_of, write_atomic
from distopt.param_groups import TrainerGroups

logger = logging.getLogger(__name__)

FORMAT = "distopt.checkpoint"
VERSION = 2

#: Test hook, called with ``(stage, path)``: on an owner at ``"shard-written"`` (its shard
#: is in the temporary file, not yet fsync'ed or renamed), on the trainer at
#: ``"before-manifest"`` (every shard in place, no manifest yet). None in normal use.
fault_hook: Optional[Callable[[str, str], None]] = None


def _hook(stage: str, path: str) -> None:
    if fault_hook is not None:
        fault_hook(stage, path)


# ---------------------------------------------------------------- trainer side


def save(placement: Placement, param_groups: List[Dict[str, Any]], path: str,
         extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Write the state into the directory ``path``: shards in parallel, then the manifest.

    Args:
        placement: the optimizer's owners and parameters.
        param_groups: the trainer's param groups.
        path: a directory (created if missing) on a filesystem every owner shares.
        extra: what else the manifest records (JSON), for the optimizer's ``load`` to
            check: ``distopt.sparse``'s partitions of its tables.

    Returns:
        The manifest written.

    Raises:
        ValueError: a param group holds a value the manifest cannot record (before any
            owner writes).
        DistributedOptimizerError: some owners failed to write their shard; the previous
            checkpoint in ``path`` is intact.
        OSError: the trainer could not write the manifest; the previous checkpoint is intact.
    """
    path = os.path.abspath(path)
    groups = [
        _encode(g, f"param_groups[{i}]")
        for i, g in enumerate(state.group_dicts(placement, param_groups))
    ]
    os.makedirs(path, exist_ok=True)
    generation = _manifest.new_generation()
    calls = {
        part.name: (
            part.info, write_shard, (part.rref, path, _shard_name(generation, k, part.name),
                                     generation),
        )
        for k, part in enumerate(placement.owners)
    }
    try:
        written = fan_out("save", calls)
        _hook("before-manifest", path)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "generation": generation,
            "optimizer_class": _class_name(placement.optimizer_class),
            "param_groups": groups,
            "params": [
                {"shape": list(shape), "dtype": str(dtype).replace("torch.", "")}
                for shape, dtype in zip(placement.param_shapes, placement.param_dtypes)
            ],
            "shards": [{"owner": name, **info} for name, info in written.items()],
            **(extra or {}),
        }
        _manifest.write(path, manifest)
    except Exception:
        # A failed save leaves nothing behind (a crash may leave shards no manifest names:
        # the next successful save removes them).
        _manifest.prune(path, lambda name: _generation_of(name) == generation)
        raise
    _manifest.prune(path, lambda name: _generation_of(name) not in (None, generation))
    logger.info(
        "saved %s shard(s) of %s into %s", len(written), placement.optimizer_class.__name__, path
    )
    return manifest


def load(placement: Placement, trainer: TrainerGroups, path: str,
         check: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
    """Restore the checkpoint in ``path``.

    The manifest is checked on the trainer (class, groups, parameter counts and shapes,
    and by ``check``); then every owner reads and checks its part in parallel; only when
    all have succeeded does any owner change its state, and the trainer its param groups.

    Args:
        placement: the optimizer's owners and parameters.
        trainer: the trainer's param groups and the values its owners hold.
        path: the checkpoint directory.
        check: called with the manifest before any owner reads its part; raises
            ValueError for a checkpoint the optimizer cannot take (``save``'s ``extra``).

    Raises:
        FileNotFoundError: ``path`` holds no manifest.
        ValueError: the checkpoint is not for this optimizer; it names what differs.
        DistributedOptimizerError: some owners could not read or check their part (nothing
            changed), or failed to apply it.
    """
    path = os.path.abspath(path)
    manifest = _manifest.read(path, FORMAT, VERSION, "DistributedOptimizer.save")
    expected_class = _class_name(placement.optimizer_class)
    if manifest["optimizer_class"] != expected_class:
        raise ValueError(
            f"Invalid checkpoint: written by a {manifest['optimizer_class']} optimizer "
            f"(expected {expected_class})"
        )
    if check is not None:  # first: a caller's record explains a count or shape that differs
        check(manifest)
    groups = [_decode(g) for g in manifest["param_groups"]]
    id_map = check_saved_groups(state.spec_of(placement, trainer), groups, what="checkpoint")
    saved_params = manifest["params"]
    if len(saved_params) != len(placement.param_shapes):
        raise ValueError(
            f"Invalid checkpoint: {len(saved_params)} parameters (expected "
            f"{len(placement.param_shapes)})"
        )
    for saved_id, i in id_map.items():
        shape = tuple(saved_params[saved_id]["shape"])
        if shape != tuple(placement.param_shapes[i]):
            raise ValueError(
                f"Invalid checkpoint: parameter {i} has shape {shape} (expected "
                f"{tuple(placement.param_shapes[i])})"
            )
    shards = _checked_shards(path, manifest, len(saved_params))
    file_of = {i: shard["file"] for shard in shards for i in shard["params"]}
    expected = {shard["file"]: shard for shard in shards}
    saved_id_of = {i: saved_id for saved_id, i in id_map.items()}
    token = uuid.uuid4().hex
    stage_calls = {}
    for part in placement.owners:
        wanted = {saved_id_of[i]: i for indices in part.indices for i in indices}
        files = sorted({file_of[s] for s in wanted if s in file_of})
        stage_calls[part.name] = (
            part.info, stage_shards,
            (part.rref, path, files, manifest["generation"], wanted, token,
             {name: expected[name] for name in files}),
        )
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    state.stage_and_commit(placement, trainer, "load", stage_calls, token, hyper)


def _checked_shards(path: str, manifest: Dict[str, Any], count: int) -> List[Dict[str, Any]]:
    """The manifest's shards, checked against the directory before any owner reads one.

    Raises:
        ValueError: naming the file and what is wrong (see the module's docstring).
    """
    shards = manifest.get("shards")
    where = os.path.join(path, MANIFEST)
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise ValueError(f"Invalid checkpoint {path!r}: {where!r} has no list of shards")
    owner_of: Dict[int, str] = {}
    names = set()
    for shard in shards:
        name = shard.get("file")
        check_name(path, name, "shard")
        if name in names:
            raise ValueError(f"Invalid checkpoint {path!r}: shard {name!r} is listed twice in {where!r}")
        names.add(name)
        params, size, digest = shard.get("params"), shard.get("bytes"), shard.get("crc32")
        if not isinstance(params, list) or not isinstance(size, int) or not isinstance(digest, str):
            raise ValueError(
                f"Invalid checkpoint {path!r}: shard {name!r} in {where!r} lacks its parameters, size "
                f"or crc32 (expected a manifest written by this version of distopt)"
            )
        for i in params:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < count:
                raise ValueError(
                    f"Invalid checkpoint {path!r}: shard {name!r} covers parameter {i!r} (expected "
                    f"0 to {count - 1})"
                )
            if i in owner_of:
                raise ValueError(
                    f"Invalid checkpoint {path!r}: parameter {i} is covered by shards {owner_of[i]!r} "
                    f"and {name!r} (expected exactly one)"
                )
            owner_of[i] = name
        check_file(path, name, shard, "shard", crc=False)  # its owner reads the CRC-32
    missing = [i for i in range(count) if i not in owner_of]
    if missing:
        raise ValueError(
            f"Invalid checkpoint {path!r}: parameters {missing[:10]} are in no shard of {where!r} "
            f"(expected every parameter in exactly one)"
        )
    generation = manifest.get("generation")
    extra = sorted(n for n in os.listdir(path)
                   if _generation_of(n) == generation and not n.startswith(".") and n not in names)
    if extra:
        raise ValueError(
            f"Invalid checkpoint {path!r}: {extra} in {path!r} carry generation {generation!r} but "
            f"{where!r} does not name them (a renamed or extra shard)"
        )
    return shards


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _shard_name(generation: str, k: int, owner: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.]", "_", owner)[:64]
    return f"shard-{generation}-{k:03d}-{safe}.pt"


def _generation_of(name: str) -> Optional[str]:
    """The generation in a shard's name (or its temporary file's); None for other files."""
    return _manifest.generation_of(name, "shard")


def _encode(value: Any, where: str) -> Any:
    """A param group value in JSON (tuples and tensors tagged, so that they come back)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, where) for v in value]}
    if isinstance(value, list):
        return [_encode(v, where) for v in value]
    if isinstance(value, dict):
        return {"dict": {str(k): _encode(v, f"{where}[{k!r}]") for k, v in value.items()}}
    if isinstance(value, Tensor):
        return {"tensor": value.detach().cpu().tolist(), "dtype": str(value.dtype)[6:]}
    raise ValueError(
        f"Invalid {where}: {type(value).__name__} (expected None, bool, number, str, tuple, "
        f"list, dict or Tensor, which the manifest can record)"
    )


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"tuple"}:
            return tuple(_decode(v) for v in value["tuple"])
        if set(value) == {"tensor", "dtype"}:
            return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
        if set(value) == {"dict"}:
            return {k: _decode(v) for k, v in value["dict"].items()}
    return value


# ---------------------------------------------------------------- owner side


@returns_failure
def write_shard(
    optimizer_rref: rpc.RRef, directory: str, file_name: str, generation: str
) -> Dict[str, Any]:
    """RPC target: write this owner's shard, holding its locks while it writes.

    The state is written straight from the optimizer's own tensors (no copy: a state too
    large for the trainer may not fit twice on its owner either), so steps on these
    parameters wait for the write.

    Returns:
        ``{"file", "params", "bytes", "crc32"}`` for the manifest, or a ``RemoteFailure``.
    """
    local = optimizer_rref.local_value()
    os.makedirs(directory, exist_ok=True)
    with local.locked():
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "generation": generation,
            "owner": rpc.get_worker_info().name,
            "file": file_name,
            "params": [i for indices in local.global_indices for i in indices],
            "state": local.torch_state(copy=False),
            "param_groups": [
                {**h, "params": list(indices)}
                for h, indices in zip(local.hyperparameters(), local.global_indices)
            ],
        }
        size = write_atomic(
            os.path.join(directory, file_name),
            lambda name: torch.save(payload, name),
            lambda tmp: _hook("shard-written", tmp),
        )
        del payload
    return {
        "file": file_name,
        "params": [i for indices in local.global_indices for i in indices],
        "bytes": size,
        "crc32": crc32_of(os.path.join(directory, file_name)),
    }


@returns_failure
def stage_shards(
    optimizer_rref: rpc.RRef,
    directory: str,
    files: List[str],
    generation: str,
    wanted: Dict[int, int],
    token: str,
    expected: Dict[str, Dict[str, Any]],
) -> None:
    """RPC target: read and check this owner's part of a checkpoint; change nothing yet.

    Args:
        optimizer_rref: the local optimizer.
        directory: the checkpoint directory.
        files: the shards holding this owner's parameters.
        generation: the manifest's generation; every shard must carry it.
        wanted: saved parameter id -> this optimizer's global index, for local parameters.
        token: names the staged part for ``commit_staged`` / ``discard_staged``.
        expected: per file, the manifest's entry: its CRC-32 and parameters.
    """
    local = optimizer_rref.local_value()
    shapes = {
        i: p.shape
        for indices, params in zip(local.global_indices, local.group_params)
        for i, p in zip(indices, params)
    }
    staged: Dict[int, Dict[str, Any]] = {}
    for file_name in files:
        full = check_name(directory, file_name, "shard")
        check_crc32(directory, full, expected[file_name]["crc32"], "shard")
        try:
            data = torch.load(full, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ValueError(
                f"Invalid shard {full!r}: not a tensors-only file torch.load(weights_only=True)"
                f" accepts ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            ) from None
        if not isinstance(data, dict) or data.get("file") != file_name or (
            data.get("params") != expected[file_name]["params"]
        ):
            got = (data.get("file"), data.get("params")) if isinstance(data, dict) else type(data)
            raise ValueError(
                f"Invalid shard {full!r}: it was written as {got!r} (expected {file_name!r} "
                f"covering {expected[file_name]['params']}, the manifest's): renamed or swapped"
            )
        if data.get("generation") != generation:
            raise ValueError(
                f"Invalid shard {file_name!r}: generation {data.get('generation')!r} "
                f"(expected {generation!r}, the manifest's)"
            )
        for saved_id, entry in data["state"].items():
            if saved_id not in wanted:
                continue
            i = wanted[saved_id]
            check_saved_entry(i, entry, shapes[i], repr(saved_id), "checkpoint", local.compiled)
            # Eager torch.optim keeps the tensors it is given: copy them out of the mapping.
            staged[i] = entry if local.compiled else {
                k: v.clone() if isinstance(v, Tensor) else v for k, v in entry.items()
            }
    local.check_torch_state(staged)
    local.staged[token] = staged
