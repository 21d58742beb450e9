"""The data-parallel optimizers' state: hyper-parameter changes pushed to the compiled steps,
``state_dict`` / ``load_state_dict`` in torch.optim's format (torch's state-dict hooks run,
``distopt.shell``), and what ``DataParallelOptimizer`` keeps beside it: residuals, the
compression's state, ``RoundRobin``'s round, sharded pieces (``distopt.parallel.shard``),
checkpoints (``distopt.parallel.checkpoint``).

Both optimizers step one compiled functional optimizer per *unit*: a (bucket, param group)
for ``DataParallelOptimizer``, a param group for ``OptimizerInBackward``.
"""
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import Tensor

from distopt.local_optimizer import CompiledSteps
from distopt.param_groups import as_keywords, check_groups, pending_changes, snapshot
from distopt.parallel import checkpoint as _checkpoint
from distopt.parallel import shard as _shard
from distopt.parallel.buckets import Bucket
from distopt.parallel.compression import Compression
from distopt.shell import indexed_groups, state_dict_with_hooks
from functional import functional_optim_map
from functional._state import check_hyperparameter, missing_group_keys

__all__ = ["CompiledState", "DataParallelState", "foreign_residuals", "saved_layout"]


class CompiledState:
    """What both data-parallel optimizers keep of their compiled steps (``_local``), one per
    unit, ``_units_of_group[j]`` being param group ``j``'s units."""

    _local: Optional[CompiledSteps] = None
    _units_of_group: List[List[int]]

    def _compile(self, units: List[Tuple[List[Tensor], List[int], Dict[str, Any]]],
                 args: Any, kwargs: Dict[str, Any]) -> None:
        """The compiled steps of ``units`` (parameters, global indices, options), or none."""
        cls = self.optimizer_class
        if self._local is not None:
            self._local.close()
            self._local = None
        if units:
            fargs, fkwargs = as_keywords(cls, args, kwargs)
            self._local = CompiledSteps(functional_optim_map[cls], cls, *map(list, zip(*units)),
                                        fargs, fkwargs)
        self._reset_sent()
        self._settable = self._local.settable(self._hyper_keys) if self._local else None

    def _reset_sent(self) -> None:
        self._sent = [{k: snapshot(g[k]) for k in self._hyper_keys} for g in self.param_groups]

    def _apply_changes(self) -> bool:
        """Send hyper-parameters changed in ``param_groups`` to the compiled steps; whether
        there were any."""
        if self._local is None:
            return False
        changes = pending_changes(
            self.param_groups, self._sent, self._settable, self.optimizer_class.__name__
        )
        for j, values in changes.items():
            self._local.apply_changes(
                [(u, key, value) for u in self._units_of_group[j] for key, value in values.items()]
            )
            self._sent[j].update({k: snapshot(v) for k, v in values.items()})
        return bool(changes)

    def _load_units(self, groups: List[Dict[str, Any]], state: Dict[int, Dict[str, Any]]) -> None:
        """Load ``state`` (global index keys) and ``groups``' hyper-parameters."""
        unit_group = {u: j for j, us in enumerate(self._units_of_group) for u in us}
        hyper = [{k: v for k, v in groups[unit_group[u]].items() if k != "params"}
                 for u in range(len(self._local.group_params))]
        self._local.load_torch_state(hyper, state)

    def _check_saved_hyper(self, saved_groups: List[Dict[str, Any]]) -> None:
        """Every saved group's hyper-parameters, all of them before anything is loaded (the
        load itself would refuse a group lacking a key only when it reached that group,
        after loading the groups before it)."""
        name = self.optimizer_class.__name__
        for j, saved in enumerate(saved_groups):
            missing = missing_group_keys(self.optimizer_class, saved)
            if missing:
                raise ValueError(
                    f"Invalid state_dict: param_groups[{j}] lacks {missing!r}, so it is not a "
                    f"{name} state_dict (expected every key of a {name} param group); nothing "
                    f"was loaded")
        for j, saved in enumerate(saved_groups):
            for key in self._hyper_keys:
                if key in saved:
                    check_hyperparameter(
                        self.optimizer_class, key, saved[key], f"state_dict param group {j}"
                    )

    def _checked_residuals(self, state_dict: Dict[str, Any], position: Dict[Any, int],
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

    #: Whether a load has warned that it gave this rank another rank's residuals.
    _warned_residuals = False

    def _warn_residuals_once(self, foreign: Optional[str], stacklevel: int) -> None:
        """Warn ``foreign`` (``foreign_residuals``), the first time a load gives one."""
        if foreign is not None and not self._warned_residuals:
            self._warned_residuals = True
            warnings.warn(foreign, stacklevel=stacklevel)

    def _adopt_groups(self, saved_groups: List[Dict[str, Any]]) -> None:
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._reset_sent()

    def _state_dict(self, gather: bool = True) -> Dict[str, Any]:
        check_groups(self.param_groups, self._built)
        return state_dict_with_hooks(self, lambda: self._make_state_dict(gather))

    def _compiled_state_dict(self, copy: bool = True) -> Dict[str, Any]:
        state = self._local.torch_state(copy=copy) if self._local is not None else {}
        return {"state": dict(sorted(state.items())),
                "param_groups": indexed_groups(self.param_groups)}


class DataParallelState(CompiledState):
    """``DataParallelOptimizer``'s state beyond the compiled steps' (or the eager
    optimizer's): residuals, the compression's state, ``RoundRobin``'s round; sharded, the
    pieces every rank holds."""

    def _make_state_dict(self, gather: bool) -> Dict[str, Any]:
        """``state_dict``; without ``gather`` (sharded) this rank's pieces only, under
        ``"state"``, where they lie under ``"pieces"`` (global index -> (start, stop)) and
        the shapes of their parameters under ``"shapes"``.

        Residuals and the compression's state are this rank's own: ``"residuals_of"``
        records whose (``{"rank", "world_size"}``). Where what a bucket sends depends on the
        whole bucket (``Compression.bucket_wide``: TopK), ``"layout"`` records the buckets
        (``bucket_layout()``), which a new optimizer takes on load."""
        sharded = self.shard is not None
        if self._eager is not None:
            sd = self._eager.state_dict()
        else:
            sd = self._compiled_state_dict(copy=gather)
        if gather and sharded:
            sd["state"] = dict(sorted(_shard.gathered_state(self, sd["state"]).items()))
        if self._codec.error_feedback:
            sd["residuals"] = self._residuals()
        if not gather and sharded:
            pieces = _shard.piece_index(self._buckets)
            sd["pieces"] = {i: (a, b) for i, (a, b, _) in pieces.items()}
            sd["shapes"] = {i: tuple(self._bucketed[i].shape) for i in pieces}
        extra = self._codec.state_dict()
        if extra is not None:
            sd["compression"] = extra
        if "residuals" in sd or extra is not None:
            sd["residuals_of"] = {"rank": self.rank, "world_size": self.world_size}
        if self._codec.bucket_wide and self._reducer is not None:
            sd["layout"] = self.bucket_layout()
        if self.sync is not None:
            sd["sync"] = {"round": self._round}
        return sd

    def _checked_loader(self, state_dict: Dict[str, Any], plan: Optional[Tuple[Any, Any]] = None,
                        agreed: bool = False) -> Callable[[], None]:
        """Check ``state_dict`` against this optimizer; return what loads it (no check left
        to fail but the eager optimizer's own), cutting the buckets first as the state says
        (``_load_plan``: ``PowerSGD``'s ``layout``, or ``"layout"``).

        ``plan``: ``_load_plan``'s, when the caller made it already. Sharded and not
        ``agreed`` (``load_state_dict``), every rank's checks are joined by one collective,
        so every rank refuses alike, with the same message (``opt.load`` joins its own)."""
        if self.shard is not None and not agreed and self.world_size > 1:
            loader, error = None, None
            try:
                loader = self._checked_loader(state_dict, plan, agreed=True)
            except Exception as exc:  # reported on every rank below
                error = exc
            _checkpoint.refuse_everywhere(self, error, "state_dict", "load_state_dict()",
                                          "load_state_dict")
            return loader
        check_groups(self.param_groups, self._built)
        eager, sharded = self._eager is not None, self.shard is not None
        saved_groups, saved_ids = saved_layout(state_dict, self.param_groups)
        position = {saved: i for i, saved in enumerate(saved_ids)}
        residuals = (self._checked_residuals(state_dict, position, self._bucketed)
                     if self._codec.error_feedback else {})
        foreign = self._foreign_residuals(state_dict)
        relayout, pieces = plan if plan is not None else self._load_plan(state_dict)
        codec = self._codec if relayout is None else relayout[1]
        load_codec = codec.checked_loader(state_dict.get("compression"))
        rounds = state_dict.get("sync", {}).get("round", self._round) if self.sync else 0
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(
                f"Invalid state_dict['sync']['round']: {rounds!r} (expected an int >= 0)")
        if not eager:
            whole = {position[k]: v for k, v in state_dict["state"].items() if k in position}
            self._check_saved_hyper(saved_groups)
            checked = whole
            if sharded:  # every parameter's, on every rank: every rank decides alike
                _shard.check_laid_out(self, whole)
                # The compiled steps are still the construction's: check the state cut as
                # they hold it (keys, dtypes, sizes); it is loaded cut for the layout to be.
                checked = _shard.own_pieces_of(self, whole, saved_ids)
                whole = _shard.own_pieces_of(self, whole, saved_ids, pieces)
            if self._local is not None:
                self._local.check_torch_state(checked)

        def load() -> None:
            if relayout is not None:
                self._rebuild_buckets(*relayout)
                self._rebuild_pending = False
            if eager:
                chosen = state_dict["state"]
                if sharded:  # whole parameters, this rank's only
                    chosen = {k: v for k, v in chosen.items() if position.get(k) in pieces}
                self._eager.load_state_dict({"state": chosen, "param_groups": saved_groups})
                self.param_groups = self._eager.param_groups
                self.state = self._eager.state
            else:
                if self._local is not None:
                    self._load_units(saved_groups, whole)
                self._adopt_groups(saved_groups)
            self._put_residuals(residuals)
            self._round = rounds
            load_codec()
            self._fresh = False
            self._warn_residuals_once(foreign, stacklevel=6)
        return load

    def _load_plan(self, state_dict: Dict[str, Any]) -> Tuple[Any, Optional[Dict[int, Any]]]:
        """What loading ``state_dict`` will make of this optimizer's buckets: the buckets
        (and the scheme bound to them) it cuts first, or None to keep them
        (``_saved_buckets``); and, sharded, this rank's pieces then (global index ->
        ``(start, stop, shape)``, ``shard.piece_index``), from which the state to read is
        chosen."""
        relayout = self._saved_buckets(state_dict)
        if self.shard is None:
            return relayout, None
        if relayout is None:
            return None, _shard.piece_index(self._buckets)
        # Cut as ``_plan_units`` will cut them after the relayout: the same split.
        _shard.attach(relayout[0], self.world_size, self.rank, self.shard, self.optimizer_class)
        return relayout, _shard.piece_index(relayout[0])

    def _foreign_residuals(self, state_dict: Dict[str, Any]) -> Optional[str]:
        """``foreign_residuals`` for this optimizer."""
        return foreign_residuals(state_dict, type(self).__name__, self.rank, self.world_size)

    def _residuals(self) -> Dict[int, Tensor]:
        """Global index -> a copy of this rank's residual, shaped like the parameter."""
        if not self._codec.error_feedback:
            return {}
        return {i: b.residual[o:o + p.numel()].view(p.shape).clone()
                for b in self._buckets for i, p, o in zip(b.positions, b.params, b.offsets)}

    def _put_residuals(self, residuals: Dict[int, Tensor]) -> None:
        for b in self._buckets:
            for i, p, o in zip(b.positions, b.params, b.offsets):
                if i in residuals:
                    b.residual[o:o + p.numel()].copy_(residuals[i].reshape(-1))

    def _saved_buckets(
        self, state_dict: Dict[str, Any]
    ) -> Optional[Tuple[List[Bucket], Compression]]:
        """The buckets (and the scheme bound to them) a state was saved with, where they
        differ from this optimizer's and it takes them; else None.

        A compression state per bucket (PowerSGD's ``layout``) needs its buckets. The
        ``"layout"`` of a scheme whose buckets change what is sent (TopK) is taken by a new
        optimizer that would cut its buckets again after its first step anyway
        (``rebuild_buckets``): it then reduces as the saved run did; others keep theirs."""
        compression = state_dict.get("compression")
        layout = compression.get("layout") if isinstance(compression, dict) else None
        where = "state_dict['compression']['layout']"
        if layout is None and self._fresh and self._rebuild_pending:
            layout, where = state_dict.get("layout"), "state_dict['layout']"
        if layout is None or self._reducer is None or layout == self.bucket_layout():
            return None
        buckets = self._layout_buckets(layout, where)
        if self.shard is not None and not self._fresh:
            raise ValueError(
                f"Invalid {where}: {layout!r} (expected this optimizer's buckets "
                f"{self.bucket_layout()!r}: a sharded optimizer that has stepped or loaded "
                f"state cuts its buckets again only at the end of its first step; load such "
                f"a state into a new DataParallelOptimizer before its first step)"
            )
        codec = self._codec_config.bound(self._comm_group, self.rank, self.world_size, buckets)
        return buckets, codec


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


def saved_layout(state_dict: Any, param_groups: List[Dict[str, Any]]) -> Any:
    """A state_dict's param groups and its ids of the parameters, in order, checked to
    match ``param_groups`` in number.

    Raises:
        ValueError: not a state_dict, another group count or parameter count, named.
    """
    if not isinstance(state_dict, dict) or "state" not in state_dict or (
        "param_groups" not in state_dict
    ):
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"Invalid state_dict: {got!r} (expected a dict with 'state' and 'param_groups')"
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"Invalid state_dict: {len(saved_groups)} param groups (expected "
            f"{len(param_groups)})"
        )
    saved_ids: List[Any] = []
    for j, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"Invalid state_dict: param group {j} holds {len(saved['params'])} "
                f"parameters (expected {len(group['params'])})"
            )
        saved_ids.extend(saved["params"])
    return saved_groups, saved_ids
