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
then renamed over its final name (``os.replace``, atomic on POSIX). Each save uses a new
generation id in its shard names, and the manifest, renamed last, is the only thing that
names the shards: until it is in place the previous manifest and its shards are untouched,
so a save that fails or a trainer that dies mid-save leaves the previous checkpoint intact
and loadable. Shards of other generations are removed only after the new manifest is in
place. Two saves into the same directory at once are not supported.

``load`` checks the manifest against the optimizer on the trainer, then has every owner
read and check its part (first round) before any owner changes anything (second round).
"""
import contextlib
import json
import logging
import os
import re
import uuid
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from distopt import state
from distopt.errors import returns_failure
from distopt.fanout import fan_out
from distopt.layout import Layout
from distopt.param_groups import TrainerGroups

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "distopt.checkpoint"
VERSION = 1

#: Test hook, called with ``(stage, path)``: on an owner at ``"shard-written"`` (its shard
#: is in the temporary file, not yet fsync'ed or renamed), on the trainer at
#: ``"before-manifest"`` (every shard in place, no manifest yet). None in normal use.
fault_hook: Optional[Callable[[str, str], None]] = None


def _hook(stage: str, path: str) -> None:
    if fault_hook is not None:
        fault_hook(stage, path)


# ---------------------------------------------------------------- trainer side


def save(layout: Layout, param_groups: List[Dict[str, Any]], path: str) -> Dict[str, Any]:
    """Write the state into the directory ``path``: shards in parallel, then the manifest.

    Args:
        layout: the optimizer's owners and parameters.
        param_groups: the trainer's param groups.
        path: a directory (created if missing) on a filesystem every owner shares.

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
        for i, g in enumerate(state.group_dicts(layout, param_groups))
    ]
    os.makedirs(path, exist_ok=True)
    generation = uuid.uuid4().hex[:16]
    calls = {
        part.name: (
            part.info, write_shard, (part.rref, path, _shard_name(generation, k, part.name),
                                     generation),
        )
        for k, part in enumerate(layout.owners)
    }
    try:
        written = fan_out("save", calls)
        _hook("before-manifest", path)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "generation": generation,
            "optimizer_class": _class_name(layout.optimizer_class),
            "param_groups": groups,
            "params": [
                {"shape": list(shape), "dtype": str(dtype).replace("torch.", "")}
                for shape, dtype in zip(layout.param_shapes, layout.param_dtypes)
            ],
            "shards": [{"owner": name, **info} for name, info in written.items()],
        }
        data = json.dumps(manifest, indent=1).encode()
        write_atomic(os.path.join(path, MANIFEST), lambda name: _write_bytes(name, data))
    except Exception:
        # A failed save leaves nothing behind (a crash may leave shards no manifest names:
        # the next successful save removes them).
        _remove(path, lambda name: _generation_of(name) == generation)
        raise
    _remove(path, lambda name: _generation_of(name) not in (None, generation))
    logger.info(
        "saved %s shard(s) of %s into %s", len(written), layout.optimizer_class.__name__, path
    )
    return manifest


def load(layout: Layout, trainer: TrainerGroups, path: str) -> None:
    """Restore the checkpoint in ``path``.

    The manifest is checked on the trainer (class, groups, parameter counts and shapes);
    then every owner reads and checks its part in parallel; only when all have succeeded
    does any owner change its state, and the trainer its param groups.

    Args:
        layout: the optimizer's owners and parameters.
        trainer: the trainer's param groups and the values its owners hold.
        path: the checkpoint directory.

    Raises:
        FileNotFoundError: ``path`` holds no manifest.
        ValueError: the checkpoint is not for this optimizer; it names what differs.
        DistributedOptimizerError: some owners could not read or check their part (nothing
            changed), or failed to apply it.
    """
    path = os.path.abspath(path)
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path, "rb") as f:
            manifest = json.loads(f.read().decode())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"Invalid checkpoint path: {path!r} (expected a directory holding {MANIFEST})"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"Invalid checkpoint: {manifest_path!r} (expected a {FORMAT} manifest)")
    if manifest.get("version") != VERSION:
        raise ValueError(
            f"Invalid checkpoint: version {manifest.get('version')!r} (expected {VERSION})"
        )
    expected_class = _class_name(layout.optimizer_class)
    if manifest["optimizer_class"] != expected_class:
        raise ValueError(
            f"Invalid checkpoint: written by a {manifest['optimizer_class']} optimizer "
            f"(expected {expected_class})"
        )
    groups = [_decode(g) for g in manifest["param_groups"]]
    id_map = state.check_groups(layout, trainer, groups, what="checkpoint")
    saved_params = manifest["params"]
    if len(saved_params) != len(layout.param_shapes):
        raise ValueError(
            f"Invalid checkpoint: {len(saved_params)} parameters (expected "
            f"{len(layout.param_shapes)})"
        )
    for saved_id, i in id_map.items():
        shape = tuple(saved_params[saved_id]["shape"])
        if shape != tuple(layout.param_shapes[i]):
            raise ValueError(
                f"Invalid checkpoint: parameter {i} has shape {shape} (expected "
                f"{tuple(layout.param_shapes[i])})"
            )
    file_of = {i: shard["file"] for shard in manifest["shards"] for i in shard["params"]}
    saved_id_of = {i: saved_id for saved_id, i in id_map.items()}
    token = uuid.uuid4().hex
    stage_calls = {}
    for part in layout.owners:
        wanted = {saved_id_of[i]: i for indices in part.indices for i in indices}
        files = sorted({file_of[s] for s in wanted if s in file_of})
        stage_calls[part.name] = (
            part.info, stage_shards,
            (part.rref, path, files, manifest["generation"], wanted, token),
        )
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    state.stage_and_commit(layout, trainer, "load", stage_calls, token, hyper)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _shard_name(generation: str, k: int, owner: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.]", "_", owner)[:64]
    return f"shard-{generation}-{k:03d}-{safe}.pt"


def _generation_of(name: str) -> Optional[str]:
    """The generation in a shard's name (or its temporary file's); None for other files."""
    match = re.match(r"^\.?shard-([0-9a-f]+)-", name)
    return match.group(1) if match else None


def _remove(path: str, doomed: Callable[[str], bool]) -> None:
    for name in os.listdir(path):
        if doomed(name) or name.startswith(f".{MANIFEST}.tmp-"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, name))


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


# ---------------------------------------------------------------- any side


def write_atomic(path: str, write: Callable[[str], Any], stage: str = "") -> int:
    """Write a file so that ``path`` holds either its old content or all the new one.

    The data goes to a temporary file in the same directory, which is fsync'ed and renamed
    over ``path``; then the directory is fsync'ed so that the rename lasts.

    Args:
        path: the final file name.
        write: writes the whole content into the file name it is given (a file name rather
            than a file object, so that ``torch.save`` uses its own C++ writer).
        stage: the name passed to the test hook once the content is written.

    Returns:
        The number of bytes written.
    """
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        if stage:
            _hook(stage, tmp)
        fd = os.open(tmp, os.O_WRONLY)
        try:
            os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_directory(directory)
    return size


def _write_bytes(name: str, data: bytes) -> None:
    with open(name, "wb") as f:
        f.write(data)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        ``{"file", "params", "bytes"}`` for the manifest, or a ``RemoteFailure``.
    """
    local = optimizer_rref.local_value()
    os.makedirs(directory, exist_ok=True)
    with local.locked():
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "generation": generation,
            "owner": rpc.get_worker_info().name,
            "state": local.torch_state(copy=False),
            "param_groups": [
                {**h, "params": list(indices)}
                for h, indices in zip(local.hyperparameters(), local.global_indices)
            ],
        }
        size = write_atomic(
            os.path.join(directory, file_name),
            lambda name: torch.save(payload, name),
            "shard-written",
        )
        del payload
    return {
        "file": file_name,
        "params": [i for indices in local.global_indices for i in indices],
        "bytes": size,
    }


@returns_failure
def stage_shards(
    optimizer_rref: rpc.RRef,
    directory: str,
    files: List[str],
    generation: str,
    wanted: Dict[int, int],
    token: str,
) -> None:
    """RPC target: read and check this owner's part of a checkpoint; change nothing yet.

    Args:
        optimizer_rref: the local optimizer.
        directory: the checkpoint directory.
        files: the shards holding this owner's parameters.
        generation: the manifest's generation; every shard must carry it.
        wanted: saved parameter id -> this optimizer's global index, for local parameters.
        token: names the staged part for ``commit_staged`` / ``discard_staged``.
    """
    local = optimizer_rref.local_value()
    shapes = {
        i: p.shape
        for indices, params in zip(local.global_indices, local.group_params)
        for i, p in zip(indices, params)
    }
    staged: Dict[int, Dict[str, Any]] = {}
    for file_name in files:
        data = torch.load(
            os.path.join(directory, file_name), map_location="cpu", weights_only=True, mmap=True
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
            state.check_values(i, entry, shapes[i], repr(saved_id), "checkpoint", local.compiled)
            # Eager torch.optim keeps the tensors it is given: copy them out of the mapping.
            staged[i] = entry if local.compiled else {
                k: v.clone() if isinstance(v, Tensor) else v for k, v in entry.items()
            }
    local.check_torch_state(staged)
    local.staged[token] = staged
