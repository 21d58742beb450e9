"""The data-parallel optimizers' saved state: ``state_dict`` / ``load_state_dict`` in
torch.optim's format (torch's state-dict hooks run, ``distopt.surface``), and what
``DataParallelOptimizer`` keeps beside it: residuals, the compression's state,
``RoundRobin``'s round, sharded pieces (``distopt.parallel.shard``), checkpoints
(``distopt.parallel.checkpoint``).

The one checker of every optimizer of this project (``distopt.saved_state``, through
``spec_for``), then what only these optimizers hold (residuals, compression state, shards):
a state_dict is checked whole, every group and every entry, before anything of it is
loaded, so a refused one leaves every group as it was. The functions on
``DataParallelOptimizer``'s state take its engine (``distopt.parallel.engine``).
"""
import copy
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from torch import Tensor

from distopt.param_groups import check_groups, snapshot
from distopt.parallel import plan as _plan
from distopt.parallel import shard as _shard
from distopt.parallel.buckets import Bucket
from distopt.parallel.compression import Compression
from distopt.parallel.sync import refuse_everywhere
from distopt.parallel.units import CompiledUnits
from distopt.saved_state import CheckedState, SavedStateSpec, check_state_dict
from distopt.surface import indexed_groups, state_dict_with_hooks

__all__ = ["CompiledStateView", "adopt_groups", "checked_loader", "checked_residuals", "compiled_state_dict",
           "foreign_residuals", "load_checked", "load_plan", "put_residuals", "residuals", "spec_for",
           "state_dict", "warn_residuals_once"]


# ---------------------------------------------------------------- both optimizers


def spec_for(optimizer_class: type, param_groups: List[Dict[str, Any]],
             hyper_keys: List[str], units: Optional[CompiledUnits]) -> SavedStateSpec:
    """What a saved state must fit (``distopt.saved_state``): ``param_groups``' parameters
    numbered over the groups in order, stepped by ``units`` (None: an eager class)."""
    indices, start = [], 0
    for g in param_groups:
        indices.append(list(range(start, start + len(g["params"]))))
        start += len(g["params"])
    shapes = [p.shape for g in param_groups for p in g["params"]]
    if units is None:
        held = [{k: snapshot(g[k]) for k in hyper_keys} for g in param_groups]
        return SavedStateSpec(optimizer_class, indices, shapes, hyper_keys, None, held,
                              hyper_keys, False)
    return SavedStateSpec(optimizer_class, indices, shapes, hyper_keys, units.settable,
                          units.sent, hyper_keys, True)


def checked_residuals(state_dict: Dict[str, Any], position: Dict[Any, int],
                      params: Dict[int, Tensor]) -> Dict[int, Tensor]:
    """``state_dict["residuals"]`` by global index, checked against ``params``."""
    out = {}
    for saved, value in state_dict.get("residuals", {}).items():
        i = position.get(saved)
        if i is None or i not in params:
            raise ValueError(f"Invalid state_dict['residuals']: parameter {saved!r} (expected "
                             f"one of the trained parameters)")
        if not isinstance(value, Tensor) or value.shape != params[i].shape:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"Invalid state_dict['residuals'][{saved!r}]: {got} (expected a tensor of "
                f"shape {tuple(params[i].shape)})"
            )
        out[i] = value
    return out


def warn_residuals_once(foreign: Optional[str], warned: bool, stacklevel: int) -> bool:
    """Warn ``foreign`` (``foreign_residuals``) unless a load has ``warned`` already;
    whether one has now."""
    if foreign is None or warned:
        return warned
    warnings.warn(foreign, stacklevel=stacklevel)
    return True


def adopt_groups(param_groups: List[Dict[str, Any]], saved_groups: List[Dict[str, Any]],
                 units: CompiledUnits) -> None:
    """The saved groups' hyper-parameters into ``param_groups`` (the compiled steps have
    them already)."""
    for group, saved in zip(param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    units.reset_sent(param_groups)


def compiled_state_dict(units: CompiledUnits, param_groups: List[Dict[str, Any]],
                        copy: bool = True) -> Dict[str, Any]:
    """The compiled steps' state in torch.optim's format."""
    return {"state": dict(sorted(units.torch_state(copy=copy).items())),
            "param_groups": indexed_groups(param_groups)}


# ---------------------------------------------------------------- DataParallelOptimizer


def fresh_containers(value: Any) -> Any:
    """``value``'s dicts, lists and tuples copied, everything else (tensors) shared, as
    torch.optim's ``state_dict()`` hands out new containers each call: the consolidated
    state a sharded ``state_dict()`` returns stays as gathered when its caller rewrites
    what it was handed (torch's ``get_state_dict`` renames the parameter ids in place)."""
    if isinstance(value, dict):
        return {k: fresh_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [fresh_containers(v) for v in value]
    if type(value) is tuple:  # a NamedTuple kept as it is
        return tuple(fresh_containers(v) for v in value)
    return value


def state_dict(engine: Any, gather: bool = True) -> Dict[str, Any]:
    """The optimizer's ``state_dict``, its hooks run (``make_state_dict``)."""
    check_groups(engine.param_groups, engine.built)
    return state_dict_with_hooks(engine.surface, lambda: make_state_dict(engine, gather))


def make_state_dict(engine: Any, gather: bool) -> Dict[str, Any]:
    """``state_dict``; without ``gather`` (sharded) this rank's pieces only, under
    ``"state"``, where they lie under ``"pieces"`` (global index -> (start, stop)) and
    the shapes of their parameters under ``"shapes"``.

    Residuals and the compression's state are this rank's own: ``"residuals_of"``
    records whose (``{"rank", "world_size"}``). Where what a bucket sends depends on the
    whole bucket (``Compression.bucket_wide``: TopK), ``"layout"`` records the buckets
    (``bucket_layout()``), which a new optimizer takes on load."""
    sharded = engine.shard is not None
    if engine.eager is not None:
        sd = engine.eager.state_dict()
    else:
        sd = compiled_state_dict(engine.units, engine.param_groups, copy=gather)
    if gather and sharded:
        sd["state"] = dict(sorted(_shard.gathered_state(engine, sd["state"]).items()))
    if engine.reduction.error_feedback:
        sd["residuals"] = residuals(engine)
    if not gather and sharded:
        pieces = _shard.piece_index(engine.buckets)
        sd["pieces"] = {i: (a, b) for i, (a, b, _) in pieces.items()}
        sd["shapes"] = {i: tuple(engine.bucketed[i].shape) for i in pieces}
    extra = engine.reduction.state_dict()
    if extra is not None:
        sd["compression"] = extra
    if "residuals" in sd or extra is not None:
        sd["residuals_of"] = {"rank": engine.rank, "world_size": engine.world_size}
    if engine.reduction.bucket_wide and engine.reducer is not None:
        sd["layout"] = engine.bucket_layout()
    if engine.sync is not None:
        sd["sync"] = {"round": engine.round}
    return sd


def checked_loader(engine: Any, state_dict: Dict[str, Any],
                   plan: Optional[Tuple[Any, Any]] = None,
                   agreed: bool = False) -> Callable[[], None]:
    """Check ``state_dict`` against the engine's optimizer, all of it; return what loads it
    (no check left to fail but the eager optimizer's own), cutting the buckets first as the
    state says (``load_plan``: ``PowerSGD``'s ``layout``, or ``"layout"``).

    ``plan``: ``load_plan``'s, when the caller made it already. Sharded and not
    ``agreed`` (``load_state_dict``), every rank's checks are joined by one collective,
    so every rank refuses alike, with the same message (``opt.load`` joins its own)."""
    if engine.shard is not None and not agreed and engine.world_size > 1:
        loader, error = None, None
        try:
            loader = checked_loader(engine, state_dict, plan, agreed=True)
        except Exception as exc:  # reported on every rank below
            error = exc
        refuse_everywhere(engine, error, "state_dict", "load_state_dict()",
                                      "load_state_dict")
        return loader
    check_groups(engine.param_groups, engine.built)
    checked = check_state_dict(
        spec_for(engine.optimizer_class, engine.param_groups, engine.hyper_keys,
                 engine.units if engine.eager is None else None), state_dict)
    saved_groups = state_dict["param_groups"]
    position = checked.id_map
    saved_ids = sorted(position, key=position.get)
    saved_residuals = (checked_residuals(state_dict, position, engine.bucketed)
                       if engine.reduction.error_feedback else {})
    foreign = foreign_residuals(state_dict, engine.name, engine.rank,
                                engine.world_size)
    relayout, pieces = plan if plan is not None else load_plan(engine, state_dict)
    reduction = engine.reduction if relayout is None else relayout[1]
    load_reduction = reduction.checked_loader(state_dict.get("compression"))
    rounds = state_dict.get("sync", {}).get("round", engine.round) if engine.sync else 0
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(
            f"Invalid state_dict['sync']['round']: {rounds!r} (expected an int >= 0)")
    whole = _checked_whole_state(engine, checked, saved_ids, pieces)

    def load() -> None:
        if relayout is not None:
            engine.rebuild_buckets(*relayout)
            engine.status.rebuild_pending = False
        load_checked(engine, state_dict, saved_groups, position, pieces, whole)
        put_residuals(engine, saved_residuals)
        engine.round = rounds
        load_reduction()
        engine.status.fresh = False
        engine.warned_residuals = warn_residuals_once(foreign, engine.warned_residuals, 6)
    return load


def _checked_whole_state(engine: Any, saved: CheckedState, saved_ids: List[Any],
                         pieces: Optional[Dict[int, Any]]) -> Dict[int, Dict[str, Any]]:
    """A compiled class's saved state by global index, checked by its compiled steps
    (sharded: this rank's pieces of it, cut as the buckets after the load hold them); {} for
    an eager class."""
    if engine.eager is not None:
        return {}
    whole = dict(saved.by_index)
    checked = whole
    if engine.shard is not None:  # every parameter's, on every rank: every rank decides alike
        _shard.check_laid_out(engine, whole)
        # The compiled steps are still the construction's: check the state cut as they
        # hold it (keys, dtypes, sizes); it is loaded cut for the layout to be.
        checked = _shard.own_pieces_of(engine, whole, saved_ids)
        whole = _shard.own_pieces_of(engine, whole, saved_ids, pieces)
    engine.units.check_state(checked)
    return whole


def load_checked(engine: Any, state_dict: Dict[str, Any], saved_groups: List[Dict[str, Any]],
                  position: Dict[Any, int], pieces: Optional[Dict[int, Any]],
                  whole: Dict[int, Dict[str, Any]]) -> None:
    """Load what ``checked_loader`` checked: the optimizer state and the groups."""
    if engine.eager is not None:
        chosen = state_dict["state"]
        if engine.shard is not None:  # whole parameters, this rank's only
            chosen = {k: v for k, v in chosen.items() if position.get(k) in pieces}
        engine.eager.load_state_dict({"state": chosen, "param_groups": saved_groups})
        engine.surface.param_groups = engine.eager.param_groups
        engine.surface.state = engine.eager.state
    else:
        engine.units.load(saved_groups, whole)
        adopt_groups(engine.param_groups, saved_groups, engine.units)


def load_plan(engine: Any, state_dict: Dict[str, Any]) -> Tuple[Any, Optional[Dict[int, Any]]]:
    """What loading ``state_dict`` will make of the engine's buckets: the buckets (and the
    reduction bound to them) it cuts first, or None to keep them (``saved_buckets``); and,
    sharded, this rank's pieces then (global index -> ``(start, stop, shape)``,
    ``shard.piece_index``), from which the state to read is chosen."""
    relayout = saved_buckets(engine, state_dict)
    if engine.shard is None:
        return relayout, None
    if relayout is None:
        return None, _shard.piece_index(engine.buckets)
    # Cut as the engine will cut them after the relayout: the same split.
    _shard.attach(relayout[0], engine.world_size, engine.rank, engine.shard,
                  engine.optimizer_class)
    return relayout, _shard.piece_index(relayout[0])


def residuals(engine: Any) -> Dict[int, Tensor]:
    """Global index -> a copy of this rank's residual, shaped like the parameter."""
    if not engine.reduction.error_feedback:
        return {}
    return {i: b.residual[o:o + p.numel()].view(p.shape).clone()
            for b in engine.buckets for i, p, o in zip(b.positions, b.params, b.offsets)}


def put_residuals(engine: Any, values: Dict[int, Tensor]) -> None:
    """``residuals`` back into the buckets."""
    for b in engine.buckets:
        for i, p, o in zip(b.positions, b.params, b.offsets):
            if i in values:
                b.residual[o:o + p.numel()].copy_(values[i].reshape(-1))


def saved_buckets(engine: Any,
                  state_dict: Dict[str, Any]) -> Optional[Tuple[List[Bucket], Compression]]:
    """The buckets (and the reduction bound to them) a state was saved with, where they
    differ from the engine's and it takes them; else None.

    A compression state per bucket (PowerSGD's ``layout``) needs its buckets. The
    ``"layout"`` of a scheme whose buckets change what is sent (TopK) is taken by a new
    optimizer that would cut its buckets again after its first step anyway
    (``rebuild_buckets``): it then reduces as the saved run did; others keep theirs."""
    compression = state_dict.get("compression")
    layout = compression.get("layout") if isinstance(compression, dict) else None
    where = "state_dict['compression']['layout']"
    if layout is None and engine.status.fresh and engine.status.rebuild_pending:
        layout, where = state_dict.get("layout"), "state_dict['layout']"
    if layout is None or engine.reducer is None or layout == engine.bucket_layout():
        return None
    buckets = _plan.layout_buckets(engine.bucketed, layout, where)
    if engine.shard is not None and not engine.status.fresh:
        raise ValueError(
            f"Invalid {where}: {layout!r} (expected this optimizer's buckets "
            f"{engine.bucket_layout()!r}: a sharded optimizer that has stepped or loaded "
            f"state cuts its buckets again only at the end of its first step; load such "
            f"a state into a new DataParallelOptimizer before its first step)"
        )
    reduction = engine.scheme.bound(engine.comm_group, engine.rank, engine.world_size, buckets)
    return buckets, reduction


def foreign_residuals(state_dict: Dict[str, Any], name: str, rank: int, world_size: int,
                      remedy: str = ("opt.save(path) / opt.load(path) on every rank, which "
                                     "keep each rank's own residuals, or each rank's own "
                                     "state_dict()")) -> Optional[str]:
    """The warning for a state_dict whose residuals (or compression state) another rank
    saved (``"residuals_of"``), or None; ``remedy``: what keeps each rank's own. A warning,
    not a refusal: the ranks that find their own would go on into the next collective and
    wait there for the others."""
    held = "residuals" in state_dict or "compression" in state_dict
    saved = state_dict.get("residuals_of")
    if not held or not isinstance(saved, dict) or world_size == 1 or (
        saved.get("rank") == rank and saved.get("world_size") == world_size
    ):
        return None
    what = " and ".join(f"state_dict[{k!r}]" for k in ("residuals", "compression")
                        if k in state_dict)
    return (
        f"{name} on rank {rank} of {world_size}: loaded the per-rank residuals of rank "
        f"{saved.get('rank')} of {saved.get('world_size')} ({what}): each rank keeps the "
        f"error feedback of what it did not send, so this rank now holds another rank's, and "
        f"the run drifts from one that kept its own (expected {remedy})"
    )


class CompiledStateView(Mapping):
    """``opt.state`` of a compiled ``DataParallelOptimizer``: a read-only view, parameter ->
    the state the compiled steps hold for it on this rank now (a piece's, sharded), in
    torch.optim's format.

    torch.optim keeps ``state`` itself; the compiled steps keep theirs, so without this view
    ``opt.state`` would stay empty, and torch's ``get_state_dict(model, opt)`` takes an empty
    ``state`` for an optimizer that never stepped and initialises it with a step of lr 0 on
    zero gradients: a silent extra step (step counts + 1, moments decayed). With the view it
    reads the state as it is (``opt.state_dict()``).
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._params = [p for g in engine.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self._params)}

    def _by_index(self) -> Dict[int, Dict[str, Any]]:
        return self._engine.units.torch_state(copy=False)

    def __getitem__(self, param: Any) -> Dict[str, Any]:
        i = self._index.get(id(param))
        state = self._by_index()
        if i is None or i not in state:
            raise KeyError(param)
        return _ReadOnlyEntry(state[i])

    def __iter__(self) -> Iterator[Any]:
        return iter([self._params[i] for i in sorted(self._by_index())])

    def __len__(self) -> int:
        return len(self._by_index())

    def items(self) -> List[Tuple[Any, Dict[str, Any]]]:  # type: ignore[override]
        """(parameter, entry) pairs, from one read of the compiled state (Mapping's own
        would read the whole state once per parameter)."""
        state = self._by_index()
        return [(self._params[i], _ReadOnlyEntry(state[i])) for i in sorted(state)]

    def values(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        """The entries, from one read of the compiled state."""
        return [entry for _, entry in self.items()]

    def __deepcopy__(self, memo: Dict[int, Any]) -> Dict[Any, Any]:
        """A plain dict, as torch.optim's ``state`` copies (the view holds threads)."""
        return {copy.deepcopy(p, memo): copy.deepcopy(dict(e), memo) for p, e in self.items()}

    def __reduce__(self) -> Any:
        return (dict, (dict((p, dict(e)) for p, e in self.items()),))


class _ReadOnlyEntry(dict):
    """One parameter's entry of ``CompiledStateView``: its tensors are the compiled steps'
    own (written in place, they change the state), but a key set or removed would change
    nothing, so it raises instead of doing nothing. Copies are plain dicts."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "Invalid change of opt.state[p]: the state of a compiled DataParallelOptimizer "
            "is held by its compiled steps, and opt.state is a read-only view of it "
            "(expected opt.load_state_dict(...) to replace it, or an in-place write into "
            "one of its tensors)"
        )

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse

    def __deepcopy__(self, memo: Dict[int, Any]) -> Dict[str, Any]:
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))

