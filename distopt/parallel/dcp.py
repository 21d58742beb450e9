"""``DataParallelOptimizer``'s state through ``torch.distributed.checkpoint`` (DCP), each rank
writing and reading its own shard only.

What DCP is handed (``dcp_state_dict``)::

    "state":   {index: {key: tensor}}  every state tensor of this rank's pieces, as
               ``StateChunk``: a view of the optimizer's own tensor (nothing copied) that
               tells DCP where its entries lie in the parameter's flattened state
    "distopt": bytes                   the same on every rank (DCP writes it once): the
               class, the param groups, and every rank's chunks, each with its CRC-32

A state tensor of a parameter of ``n`` elements is saved as one 1-D tensor whatever the
sharding: ``ceil(n / k)`` entries, where one entry covers ``k`` elements of the parameter
(``elements_per_entry``: 1 for torch.optim's classes; 2 for codes of 4-bit state, one block
for a block's absmax), so a piece ``[start, stop)`` of the parameter holds entries
``[start // k, ceil(stop / k))``. A 0-dim tensor (``step``) is one value every piece shares;
DCP writes it once. Flat pieces are uneven element ranges of flattened parameters, which a
DTensor's ``Shard`` placement (``torch.chunk``'s even split) cannot describe; DCP's own
protocol for objects that describe their chunks (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``) can, and DCP reshards any saved chunks
into any requested ones, so a save on N ranks loads on M, in any ``shard`` mode.

Load (``load``): the ``"distopt"`` entry first (what was saved, where), then this rank's
pieces into fresh tensors, then every saved chunk's CRC-32 checked from the pieces every
rank read (partial CRCs joined, ``crc32_combine``), and only when every rank has accepted
everything is the optimizer's state replaced.
"""
import io
import zlib
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from distopt.param_groups import check_groups
from distopt.parallel import shard as _shard
from distopt.parallel import state as _state
from distopt.parallel.sync import all_gather_named, refuse_everywhere
from distopt.saved_state import check_saved_groups, check_state_dict
from distopt.surface import indexed_groups

__all__ = ["FORMAT", "StateChunk", "crc32_combine", "dcp_state_dict", "elements_per_entry",
           "load"]

FORMAT = "distopt.data_parallel.dcp"
VERSION = 1


class StateChunk(Tensor):
    """Entries ``[offset, offset + len)`` of a 1-D state tensor of ``entries`` entries: the
    object DCP is handed for one state tensor of one rank's piece (a ``Tensor`` that is a
    view of it, so that DCP takes it where it takes a tensor).

    ``size()`` is the whole tensor's, as DCP checks it on load; the chunk's own entries are
    what ``__get_tensor_shard__`` returns."""

    entries: int
    offset: int
    #: On load: laid out as its piece once read (torch.optim's state), else kept 1-D.
    shaped: bool = True
    #: On save: the optimizer's status and the generation (steps and loads) it was taken at.
    taken: Optional[Tuple[Any, int]] = None

    @staticmethod
    def of(local: Tensor, entries: int, offset: int,
           taken: Optional[Tuple[Any, int]] = None) -> "StateChunk":
        """``local`` (1-D) as entries ``[offset, offset + local.numel())`` of ``entries``;
        ``taken``: (status, generation) of a live state handed to ``dcp.save``."""
        chunk = local.as_subclass(StateChunk)
        chunk.entries, chunk.offset, chunk.taken = entries, offset, taken
        return chunk

    def check_fresh(self, fqn: str) -> None:
        """RuntimeError where the optimizer stepped or loaded since ``dcp_state_dict()``
        handed this live state out: DCP would write the newer state under the CRC-32s
        recorded before it, and the checkpoint would be refused only at its load."""
        if self.taken is not None and self.taken[0].generation != self.taken[1]:
            raise RuntimeError(
                f"Invalid dcp.save of {fqn!r}: the optimizer stepped or loaded since "
                f"opt.dcp_state_dict() handed out its live state (generation "
                f"{self.taken[1]}, now {self.taken[0].generation}), so the checkpoint "
                f"would hold the newer state under the older CRC-32s (expected "
                f"opt.dcp_state_dict() again, right before dcp.save)")

    def local(self) -> Tensor:
        """The chunk's own entries, a plain tensor (the same memory)."""
        return self.as_subclass(Tensor)

    def size(self, dim: Optional[int] = None) -> Any:  # type: ignore[override]
        whole = torch.Size([self.entries])
        return whole if dim is None else whole[dim]

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]),
                                    sizes=torch.Size([self.local().numel()]))

    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        self.check_fresh(fqn)
        chunk = self._chunk()
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=chunk, size=torch.Size([self.entries]),
                              properties=TensorProperties.create_from_tensor(self.local())))]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        if index.offset is not None and tuple(index.offset) != (self.offset,):
            raise ValueError(f"Invalid index: {index!r} (expected offset ({self.offset},) of "
                             f"{index.fqn!r})")
        self.check_fresh(index.fqn)
        return self.local()


# ---------------------------------------------------------------- entries and elements


def elements_per_entry(optimizer_class: type, group: Dict[str, Any], key: str, value: Tensor,
                       piece: Tuple[int, int], numel: int) -> Optional[int]:
    """How many elements of its parameter one entry of state ``key`` covers (None: a 0-dim
    value every element shares), from ``value``, the state of elements ``piece`` of a
    parameter of ``numel`` elements.

    A class that lays its state out otherwise says so with a ``state_elements_per_entry(key,
    numel, group)`` attribute; without one: 1 for a tensor of as many entries as elements;
    one block (``group["block_size"]``) for an ``*_absmax`` key; 2 for codes of two
    elements a byte.

    Raises:
        ValueError: ``value`` fits none, or the piece does not start at an entry.
    """
    if value.dim() == 0:
        return None
    start, stop = piece
    told = getattr(optimizer_class, "state_elements_per_entry", None)
    if told is not None:
        k = int(told(key, numel, group))
    elif value.numel() == stop - start:
        k = 1
    elif key.endswith("_absmax") and "block_size" in group:
        k = int(group["block_size"])
    else:
        k = 2
    if start % k or value.numel() != -(-stop // k) - start // k:
        raise ValueError(
            f"Invalid state[{key!r}]: {value.numel()} entries for elements [{start}, {stop}) "
            f"of a parameter of {numel} (expected one entry per {k} elements, the piece "
            f"starting at an entry)")
    return k


def own_pieces(engine: Any) -> Dict[int, Tuple[int, int, torch.Size]]:
    """Global index -> ``(start, stop, shape of its state tensors)`` of the pieces this
    rank steps (unsharded: every trained parameter, whole)."""
    if engine.shard is None:
        return {i: (0, p.numel(), p.shape) for i, p in engine.bucketed.items()}
    return _shard.piece_index(engine.buckets)


def _live_state(engine: Any) -> Dict[int, Dict[str, Any]]:
    """This rank's state entries, the optimizer's own tensors (no copies)."""
    if engine.eager is not None:
        pieces = own_pieces(engine)
        params = engine.eager.param_groups
        flat = [p for g in params for p in g["params"]]
        return {i: dict(engine.eager.state[flat[i]]) for i in pieces
                if flat[i] in engine.eager.state}
    return engine.units.torch_state(copy=False)


def _group_of(engine: Any) -> Dict[int, Dict[str, Any]]:
    """Global index -> its param group."""
    out, start = {}, 0
    for g in engine.param_groups:
        for k in range(len(g["params"])):
            out[start + k] = g
        start += len(g["params"])
    return out


def crc32_of(t: Tensor) -> int:
    """The CRC-32 of ``t``'s bytes (contiguous), as ``zlib.crc32``."""
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


# ---------------------------------------------------------------- save


def dcp_state_dict(engine: Any) -> Dict[str, Any]:
    """What ``DataParallelOptimizer.dcp_state_dict`` returns (see the module's docstring);
    a collective (one all_gather_object of every rank's chunk records)."""
    check_groups(engine.param_groups, engine.built)
    pieces, groups = own_pieces(engine), _group_of(engine)
    state: Dict[str, Dict[str, Any]] = {}
    records = []  # (index, key, offset, entries held, entries, k, dtype, shaped, crc)
    for i, entry in sorted(_live_state(engine).items()):
        start, stop, view = pieces[i]
        param = engine.bucketed[i]
        numel = param.numel()
        out = state.setdefault(str(i), {})
        for key, value in entry.items():
            if not isinstance(value, Tensor):
                raise ValueError(f"Invalid state[{i}][{key!r}]: {type(value).__name__} "
                                 f"(expected tensors only, to save through DCP)")
            k = elements_per_entry(engine.optimizer_class, groups[i], key, value,
                                   (start, stop), numel)
            local = value.detach().reshape(-1) if k is not None else value.detach()
            offset = 0 if k is None else start // k
            entries = None if k is None else -(-numel // k)
            out[key] = local if k is None else StateChunk.of(
                local, entries, offset, (engine.status, engine.status.generation))
            # Laid out as its piece (torch.optim's state) or 1-D (codes, scales): a flat
            # piece's state is 1-D either way; quantised codes are not the parameter's dtype.
            shaped = tuple(value.shape) == tuple(view) and value.dtype == param.dtype
            records.append((i, key, offset, local.numel(), entries, k, str(value.dtype),
                            shaped, crc32_of(local)))
    mine = (dist.get_rank() if dist.is_initialized() else 0, records)
    every = [mine]
    if engine.world_size > 1:
        every = all_gather_named("dcp_state_dict()", mine, engine.process_group,
                                 engine.rank, engine.world_size)
    about = {"format": FORMAT, "version": VERSION,
             "optimizer_class": engine.optimizer_class.__name__,
             "shard": engine.shard, "world_size": engine.world_size,
             "shapes": {i: list(p.shape) for i, p in engine.bucketed.items()},
             "param_groups": indexed_groups(engine.param_groups),
             "chunks": _merged(every)}
    buffer = io.BytesIO()
    torch.save(about, buffer)
    return {"state": state, "distopt": buffer.getvalue()}


def _merged(every: List[Tuple[int, List[Tuple[Any, ...]]]]) -> List[Tuple[Any, ...]]:
    """Every rank's chunk records (``(global rank, records)`` per rank) as ``Chunk`` tuples,
    one per chunk: a chunk several ranks hold (a step count, unsharded state) names them
    all, as DCP writes it from one of them.

    Raises:
        ValueError: ranks hold one chunk with different values (state that differs per
            rank, as under ``RoundRobin``: DCP would keep one of them).
    """
    chunks: Dict[Tuple[Any, ...], List[Any]] = {}
    for global_rank, records in every:
        for index, key, offset, held, entries, k, dtype, shaped, crc in records:
            known = chunks.setdefault((index, key, offset, held), [
                [], index, key, offset, held, entries, k, dtype, shaped, crc])
            if known[-1] != crc:
                raise ValueError(
                    f"Invalid state[{index}][{key!r}]: entries [{offset}, {offset + held}) "
                    f"differ between ranks {known[0] + [global_rank]} (expected the same on "
                    f"every rank that holds them, as DCP writes them once; state kept per "
                    f"rank, as under RoundRobin, goes through opt.save)")
            known[0].append(global_rank)
    return [tuple(c) for c in chunks.values()]


# ---------------------------------------------------------------- load


class Chunk(NamedTuple):
    """One saved state tensor: entries ``[offset, offset + held)`` of ``entries`` (None: a
    0-dim value), one entry per ``k`` elements, held by ``ranks`` (global ranks) at the
    save."""

    ranks: List[int]
    index: int
    key: str
    offset: int
    held: int
    entries: Optional[int]
    k: Optional[int]
    dtype: str
    shaped: bool  #: laid out as its piece (torch.optim's state), else 1-D (codes, scales)
    crc: int


def _nested(key: Optional[str], value: Dict[str, Any]) -> Dict[str, Any]:
    return value if key is None else {key: value}


def _fqn(key: Optional[str], *parts: Any) -> str:
    return ".".join(str(p) for p in ((key,) if key is not None else ()) + parts)


def read_about(engine: Any, key: Optional[str], **where: Any) -> Dict[str, Any]:
    """The ``"distopt"`` entry of a checkpoint (``where``: ``dcp.load``'s ``checkpoint_id``
    and ``storage_reader``), checked to be one of this format."""
    sd = _nested(key, {"distopt": b""})
    dcp.load(sd, process_group=engine.process_group, **where)
    raw = sd[key]["distopt"] if key is not None else sd["distopt"]
    about = torch.load(io.BytesIO(raw), weights_only=True)
    if not isinstance(about, dict) or about.get("format") != FORMAT:
        raise ValueError(f"Invalid checkpoint: {_fqn(key, 'distopt')!r} is not a "
                         f"{FORMAT!r} entry (expected what opt.dcp_state_dict() saved)")
    if about.get("version") != VERSION:
        raise ValueError(f"Invalid checkpoint: version {about.get('version')!r} (expected "
                         f"{VERSION})")
    return about


def plan_load(engine: Any, about: Dict[str, Any]) -> Dict[Tuple[int, str], Any]:
    """This rank's fresh tensors to read into, by (index, key): a ``StateChunk`` per state
    tensor of its pieces, a 0-dim tensor per shared value; every check that needs no data
    done first (class, parameters and their shapes, param groups, where pieces start).

    Raises:
        ValueError: naming what does not fit.
    """
    name = engine.optimizer_class.__name__
    if about["optimizer_class"] != name:
        raise ValueError(f"Invalid checkpoint: optimizer_class {about['optimizer_class']!r} "
                         f"(expected {name!r})")
    shapes = {i: list(p.shape) for i, p in engine.bucketed.items()}
    if about["shapes"] != shapes:
        differ = sorted(i for i in set(shapes) | set(about["shapes"])
                        if shapes.get(i) != about["shapes"].get(i))
        raise ValueError(
            f"Invalid checkpoint: parameters {differ} were saved with shapes "
            f"{[about['shapes'].get(i) for i in differ]} (expected "
            f"{[shapes.get(i) for i in differ]}, this optimizer's)")
    check_saved_groups(_state.spec_for(engine.optimizer_class, engine.param_groups,
                                       engine.hyper_keys,
                                       engine.units if engine.eager is None else None),
                       about["param_groups"])
    staged: Dict[Tuple[int, str], Any] = {}
    pieces = own_pieces(engine)
    for c in map(Chunk._make, about["chunks"]):
        if c.index not in pieces or (c.index, c.key) in staged:
            continue
        dtype = getattr(torch, c.dtype.replace("torch.", ""))
        if c.k is None:
            staged[c.index, c.key] = torch.empty((), dtype=dtype)
            continue
        start, stop, _ = pieces[c.index]
        if start % c.k:
            raise ValueError(
                f"Invalid checkpoint: state[{c.index}][{c.key!r}] has one entry per {c.k} "
                f"elements, and this rank's piece starts at element {start} (expected a "
                f"multiple of {c.k})")
        lo, hi = start // c.k, -(-stop // c.k)
        staged[c.index, c.key] = StateChunk.of(torch.empty(hi - lo, dtype=dtype), c.entries, lo)
        staged[c.index, c.key].shaped = c.shaped
    return staged


def check_crcs(engine: Any, about: Dict[str, Any], staged: Dict[Tuple[int, str], Any],
               key: Optional[str]) -> None:
    """Every saved chunk's CRC-32 against what the ranks read of it: each rank's CRC of its
    part of each chunk, gathered (one all_gather_object) and joined in order; every rank
    decides alike.

    Raises:
        ValueError: naming the rank that saved a chunk that differs, its DCP files, the key
            and the entries.
    """
    chunks = [Chunk._make(c) for c in about["chunks"]]
    partial = []
    for n, c in enumerate(chunks):
        got = staged.get((c.index, c.key))
        if got is None:
            continue
        if c.k is None:
            partial.append((n, 0, 1, crc32_of(got)))
            continue
        lo = got.offset
        a, b = max(c.offset, lo), min(c.offset + c.held, lo + got.local().numel())
        if a < b:
            partial.append((n, a - c.offset, b - a, crc32_of(got.local()[a - lo:b - lo])))
    every = [partial]
    if engine.world_size > 1:
        every = all_gather_named("load_dcp()", partial, engine.process_group, engine.rank,
                                 engine.world_size)
    parts: Dict[int, Dict[int, Tuple[int, int]]] = {}
    for theirs in every:
        for n, start, length, crc in theirs:
            parts.setdefault(n, {})[start] = (length, crc)
    for n, c in enumerate(chunks):
        joined = _joined(parts.get(n, {}), c.held, torch.empty((), dtype=getattr(
            torch, c.dtype.replace("torch.", ""))).element_size())
        if joined != c.crc:
            got = "not read by any rank" if joined is None else f"CRC-32 {joined:#010x}"
            by = (f"rank {c.ranks[0]} (its DCP files, __{c.ranks[0]}_*.distcp with "
                  f"FileSystemWriter)" if len(c.ranks) == 1 else
                  f"ranks {c.ranks} (DCP wrote it from one of them: "
                  f"{' or '.join(f'__{r}_*.distcp' for r in c.ranks)})")
            raise ValueError(
                f"Invalid checkpoint: the shard saved by {by} holds "
                f"{_fqn(key, 'state', c.index, c.key)!r} entries [{c.offset}, "
                f"{c.offset + c.held}): {got} (expected {c.crc:#010x}, recorded at the save)")


def _joined(parts: Dict[int, Tuple[int, int]], held: int, itemsize: int) -> Optional[int]:
    """The CRC-32 of entries ``[0, held)`` from CRCs of consecutive parts (start ->
    (length, crc)); None if they do not cover them."""
    crc, at = None, 0
    while at < held:
        if at not in parts:
            return None
        length, part = parts[at]
        crc = part if crc is None else crc32_combine(crc, part, length * itemsize)
        at += length
    return crc


def load(engine: Any, key: Optional[str], **where: Any) -> None:
    """``DataParallelOptimizer.load_dcp``: read, check everything on every rank, then
    replace the state (or refuse on every rank alike, nothing changed)."""
    doing = f"load_dcp from {where.get('checkpoint_id')!r}"
    about, staged, error = None, {}, None
    try:
        check_groups(engine.param_groups, engine.built)
        about = read_about(engine, key, **where)
        staged = plan_load(engine, about)
    except Exception as exc:  # reported on every rank below
        error = exc
    refuse_everywhere(engine, error, "checkpoint", "load_dcp()", doing)
    state: Dict[str, Dict[str, Any]] = {}
    for (i, name), value in staged.items():
        state.setdefault(str(i), {})[name] = value
    dcp.load(_nested(key, {"state": state}), process_group=engine.process_group, **where)
    try:
        check_crcs(engine, about, staged, key)
        loaded = _shaped(engine, staged)
        if engine.eager is None:
            engine.units.check_state(loaded)
        else:
            check_state_dict(_state.spec_for(engine.optimizer_class, engine.param_groups,
                                             engine.hyper_keys, None),
                             {"state": loaded, "param_groups": about["param_groups"]})
    except Exception as exc:  # reported on every rank below
        error = exc
    refuse_everywhere(engine, error, "checkpoint", "load_dcp()", doing)
    groups = about["param_groups"]
    _state.load_checked(engine, {"state": loaded, "param_groups": groups}, groups,
                        {i: i for i in engine.bucketed}, own_pieces(engine), loaded)
    engine.status.fresh = False


def _shaped(engine: Any, staged: Dict[Tuple[int, str], Any]) -> Dict[int, Dict[str, Any]]:
    """The read tensors by global index, each laid out as this rank's optimizer holds the
    state of its piece: as the piece where it was saved so (torch.optim's state), else 1-D
    (quantised codes and scales)."""
    pieces = own_pieces(engine)
    out: Dict[int, Dict[str, Any]] = {}
    for (i, name), value in staged.items():
        if isinstance(value, StateChunk):
            local = value.local()
            value = local.view(pieces[i][2]) if value.shaped else local
        out.setdefault(i, {})[name] = value
    return out


# ---------------------------------------------------------------- CRC-32 of a concatenation

_POLY = 0xEDB88320  # CRC-32 (zlib's), reflected


def _multiply(a: int, b: int) -> int:
    """``a(x) * b(x)`` modulo the CRC-32 polynomial (reflected bit order)."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _x_to_8n(n: int) -> int:
    """``x ** (8 * n)`` modulo the polynomial: what ``n`` zero bytes do to a CRC register."""
    result, square = 1 << 31, 1 << 23  # x^0; x^8 (one byte)
    while n:
        if n & 1:
            result = _multiply(result, square)
        square = _multiply(square, square)
        n >>= 1
    return result


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """``zlib.crc32(a + b)`` from ``zlib.crc32(a)``, ``zlib.crc32(b)`` and ``len(b)``: the
    CRC-32 of a saved chunk from the CRCs of the parts different ranks read."""
    return _multiply(_x_to_8n(length_b), crc_a) ^ crc_b
