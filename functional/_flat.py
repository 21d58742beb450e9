"""Flat parameter buffers: one kernel call per step over many small parameters.

On CPU a fused or foreach kernel pays microseconds per tensor, so a step over thousands of
small parameters is mostly bookkeeping. ``flatten_parameters`` makes the small parameters of
one (device, dtype) views of one contiguous buffer (``p.data = buffer[a:b].view_as(p)``: the
caller's Parameter objects stay the same leaves); the gathering pass (``_kernels.gather``)
then steps such a buffer as one tensor when it can (``flat_operands``):

- every member has a dense gradient of its shape and dtype, and still views the buffer
  (``p.data = other`` or ``p.set_(...)`` since flattening is noticed here);
- the members' state is flat as well: one buffer per state key, each member's entry a view
  of it, so ``state`` and state_dict conversion stay per parameter as in torch.optim;
- the members' scalar state (``step``, ``eta``, ``mu``, ``mu_product``) agrees.

Otherwise the members step one by one on their views, as parameters that were never
flattened do, exactly as before; the next step checks again, and state that stopped being
flat (a loaded state_dict, a parameter stepped alone) is copied back into flat buffers once
its members agree again.

All of this is TorchScript-compilable except ``flatten_parameters``, which runs in Python
before compiling. The per-member work of a flat step (check each gradient and member, copy
the gradients into the flat gradient buffer) runs in one native op where ``functional._native``
built it, else in the interpreter (``fill_flat_gradients``).
"""
import enum
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from functional import _native
from functional._compile import script
from functional._spec import Place, StateSpec, scalar_device
from functional._torch import chunk_cat, is_view, storage_use_count


class GradientFill(enum.Enum):
    """How a flat step fills a buffer's ``grad`` from its members' gradients (without the
    native op): they lie back to back in buffer order, so one concatenation can."""

    #: One ``cat`` (about 0.16 us a gradient on CPU): every member is 1-D.
    CAT = 0
    #: One ``_chunk_cat``, which flattens each (0.36 us) but takes no 0-dim one.
    CHUNK_CAT = 1
    #: ``_foreach_copy_`` into ``grad_views`` (0.45 us): some member is 0-dim.
    COPY = 2


@script
class FlatBuffer(object):
    """One flat parameter buffer and the state kept flat beside it.

    Attributes:
        members: indices of the parameters that view ``param``, in buffer order.
        params: those parameters (the objects the optimizer steps).
        views: the view each member was given (what it must still be set to).
        offsets: where each member starts in ``param``.
        param: the 1-D buffer.
        grad: the flat gradient buffer (same size), filled at each flat step.
        grad_row: ``grad`` as one row (``_chunk_cat``'s output shape).
        grad_views: ``grad``'s views shaped as the members.
        fill: how a flat step fills ``grad`` from the members' gradients (``GradientFill``).
        keys: the state keys ``state`` holds flat buffers for.
        state: state key -> flat buffer (1-D; a scalar key holds one element per member).
        seen: the optimizer's state dict at the last flat step (a new dict from
            ``set_state`` means its entries must be checked again).
        given: each member's entry tensors then (eager steps check they are still there).
        valid: the members' entries in ``seen`` are views of ``state`` and agree.
    """

    def __init__(self, members: List[int], params: List[Tensor], views: List[Tensor],
                 offsets: List[int], param: Tensor) -> None:
        self.members = members
        #: members[0] when the members are consecutive indices (their gradients are then
        #: one slice of the list), else -1.
        self.start = members[0] if members == list(range(members[0], members[0] + len(members))) else -1
        self.params = params
        self.views = views
        self.offsets = offsets
        self.param = param
        self.grad = torch.zeros_like(param)
        self.grad_row = self.grad.view(1, -1)
        self.grad_views = [
            self.grad[offsets[k]:offsets[k] + views[k].numel()].view_as(views[k])
            for k in range(len(views))
        ]
        self.fill = GradientFill.CAT
        for v in views:
            if v.dim() == 0:
                self.fill = GradientFill.COPY
            elif v.dim() > 1 and self.fill == GradientFill.CAT:
                self.fill = GradientFill.CHUNK_CAT
        self.keys: List[str] = []
        self.state: Dict[str, Tensor] = {}
        self.seen: Dict[int, Dict[str, Tensor]] = {}
        self.given: List[Dict[str, Tensor]] = []
        self.valid = False


@script
class Groups(object):
    """How an optimizer's parameters are stepped: ``dense`` index groups of one (device,
    dtype) each, stepped per parameter, and ``flats``, flat buffers stepped whole when they
    can be. ``pending`` holds, during a step, the flat scalar state to spread from its first
    element to all members after the update (``spread``)."""

    def __init__(self, dense: List[List[int]], flats: List[FlatBuffer]) -> None:
        self.dense = dense
        self.flats = flats
        self.pending: List[Tensor] = []


def device_dtype_groups(params: List[Tensor]) -> Groups:
    """Every parameter stepped per parameter, grouped by (device, dtype) in first-seen order
    (a class's starting grouping; ``flatten_parameters`` replaces it)."""
    keys: List[str] = []
    groups: Dict[str, List[int]] = {}
    for i in range(len(params)):
        p = params[i]
        key = str(p.device) + "|" + str(p.dtype)
        if key not in groups:
            keys.append(key)
            groups[key] = [i]
        else:
            groups[key].append(i)
    return Groups([groups[k] for k in keys], torch.jit.annotate(List[FlatBuffer], []))


def split_flats(
    groups: Groups, gradients: List[Optional[Tensor]], kinds: str
) -> Tuple[List[List[int]], List[FlatBuffer]]:
    """The start of a gathering pass: the index groups to gather per parameter (the members
    of each flat buffer that cannot step whole this time, then ``groups.dense``), and the
    buffers that can as far as their gradients say, their ``grad`` filled
    (``flat_gradients``)."""
    todo: List[List[int]] = []
    whole: List[FlatBuffer] = []
    for f in groups.flats:
        if flat_gradients(f, gradients, kinds):
            whole.append(f)
        else:
            todo.append(f.members)
    for group in groups.dense:
        todo.append(group)
    return todo, whole


def flat_gradients(f: FlatBuffer, gradients: List[Optional[Tensor]], kinds: str) -> bool:
    """Whether buffer ``f`` can step whole this time as far as its members' gradients and
    storage say, and if so ``f.grad`` filled with the gradients: each present, dense, of its
    member's shape and dtype, and each member still set to its view. Else False, nothing
    written (the members then step one by one, where a bad gradient gets its error)."""
    if kinds == "sparse":
        return False
    if fill_flat_gradients(f, gradients):
        return True
    f.valid = False
    return False


def _fill_script(f: FlatBuffer, gradients: List[Optional[Tensor]]) -> bool:
    """``flat_gradients``'s work in TorchScript (without the native ops): the same checks,
    about a microsecond a member in the interpreter."""
    m = len(f.members)
    mine: List[Optional[Tensor]] = []
    if f.start >= 0:
        mine = gradients[f.start:f.start + m]
    else:
        for i in f.members:
            mine.append(gradients[i])
    grads: List[Tensor] = []
    # zip, not indexing: each index is one more interpreter instruction per member.
    for g, p, v in zip(mine, f.params, f.views):
        if g is None:
            return False
        if (
            g.layout != torch.strided
            or not p.is_set_to(v)
            or g.dtype != v.dtype
            or not g.is_same_size(v)
            or g.device != v.device
        ):
            return False
        grads.append(g)
    if f.fill == GradientFill.CAT:
        torch.cat(grads, out=f.grad)
    elif f.fill == GradientFill.CHUNK_CAT:
        chunk_cat(grads, 0, 1, f.grad_row)
    else:
        torch._foreach_copy_(f.grad_views, grads)
    return True


def _fill_native(f: FlatBuffer, gradients: List[Optional[Tensor]]) -> bool:
    """``flat_gradients``'s work in one native op (``functional/csrc/flat_ops.cpp``): the
    same checks (shapes and dtypes always) and copy, tens of nanoseconds a member."""
    return torch.ops.distopt_flat.fill(gradients, f.members, f.params, f.views, f.offsets, f.grad)


#: The native op where it was built (``functional._native``), else the TorchScript loop;
#: chosen at import, before anything is compiled (TorchScript resolves the name then).
fill_flat_gradients = _fill_native if _native.AVAILABLE else _fill_script


def flat_operands(
    f: FlatBuffer,
    state: Dict[int, Dict[str, Tensor]],
    spec: StateSpec,
    pending: List[Tensor],
) -> List[List[Tensor]]:
    """The operand set ``[[param], [grad], [state[key]]...]`` (positions named by
    ``Operand``) that steps buffer ``f`` whole (its ``grad`` filled by ``flat_gradients``);
    an empty list when the members' state does not allow it (``flat_state``).

    A scalar key's operand is the first member's element; its buffer goes to ``pending``,
    for ``spread`` to copy that element to the others after the update.
    """
    keys = spec.keys
    # Checked at every step: the same state dict (a compiled optimizer's state changes only
    # by set_state, which replaces it), each scalar state buffer agreeing (one member's step
    # edited in place shows here), and in eager code, where the dict itself can be edited
    # (state.clear(), del state[i], state[i]["exp_avg"] = ...), every member's entry still
    # holding the tensors it held.
    if not (
        f.valid and state is f.seen and f.keys == keys
        and _scalars_agree(f, spec, False)
        and (torch.jit.is_scripting() or _entries_unchanged(f, state, keys))
    ):
        if not flat_state(f, state, spec):
            return torch.jit.annotate(List[List[Tensor]], [])
    ops = [[f.param], [f.grad]]  # Operand.PARAMS, Operand.GRADS
    for k in range(len(keys)):
        buf = f.state[keys[k]]
        if spec.places[k] != Place.PARAM_LAYOUT:
            ops.append([buf[0]])
            pending.append(buf)
        else:
            ops.append([buf])
    return ops


def flat_state(f: FlatBuffer, state: Dict[int, Dict[str, Tensor]], spec: StateSpec) -> bool:
    """Make the members' state flat, if it can be stepped whole: all members without state
    (each gets fresh entries, views of new buffers filled as ``new_state`` fills them), or
    all with every key and agreeing scalars (entries copied into new flat buffers unless
    they already view ``f.state``). Whether the buffer can step whole."""
    keys = spec.keys
    if len(keys) == 0:
        f.valid = True
        f.keys = keys
        f.seen = state
        return True
    members = f.members
    n_with = 0
    for i in members:
        if i in state:
            n_with += 1
    if n_with != 0 and n_with != len(members):
        f.valid = False
        return False
    if n_with == 0:
        f.state = _fresh_flat_state(f, state, spec)
    else:
        for i in members:
            entry = state[i]
            for key in keys:
                # A sparse entry (SGD's momentum after sparse gradients) cannot be made flat.
                if key not in entry or entry[key].is_sparse:
                    f.valid = False
                    return False
        if not (f.keys == keys and _entries_are_views(f, state, spec)):
            flat = _copied(f, state, spec)
            for j in range(len(members)):
                entry = state[members[j]]
                views = _entry_views(f, flat, j, spec)
                for name in keys:
                    entry[name] = views[name]
            f.state = flat
    f.keys = keys
    f.seen = state
    f.given = [_entry_of(state[i], keys) for i in members]
    f.valid = _scalars_agree(f, spec, True)
    return f.valid


def _fresh_flat_state(
    f: FlatBuffer, state: Dict[int, Dict[str, Tensor]], spec: StateSpec
) -> Dict[str, Tensor]:
    """New flat buffers filled as ``new_state`` fills each key (a scalar key one element per
    member, where its ``Place`` says), and every member's entry in ``state`` made of their
    views."""
    keys, fills, places = spec.keys, spec.fills, spec.places
    m = len(f.members)
    flat: Dict[str, Tensor] = {}
    for k in range(len(keys)):
        if places[k] != Place.PARAM_LAYOUT:
            device = scalar_device(f.param, places[k])
            flat[keys[k]] = torch.full([m], fills[k], dtype=torch.float32, device=device)
        else:
            flat[keys[k]] = torch.full(
                [f.param.numel()], fills[k], dtype=f.param.dtype, device=f.param.device
            )
    for j in range(m):
        state[f.members[j]] = _entry_views(f, flat, j, spec)
    return flat


def _entry_of(entry: Dict[str, Tensor], keys: List[str]) -> Dict[str, Tensor]:
    """The tensors of ``entry`` under ``keys``, in a dict of their own."""
    out: Dict[str, Tensor] = {}
    for key in keys:
        out[key] = entry[key]
    return out


def _entries_unchanged(f: FlatBuffer, state: Dict[int, Dict[str, Tensor]], keys: List[str]) -> bool:
    """Whether every member's entry still holds the tensor objects it held when the flat
    state was checked (an identity test: about 0.1 µs a tensor in eager Python)."""
    if len(keys) == 0:
        return True
    for j in range(len(f.members)):
        i = f.members[j]
        if i not in state:
            return False
        entry = state[i]
        given = f.given[j]
        for key in keys:
            if key not in entry or not (entry[key] is given[key]):
                return False
    return True


def _scalars_agree(f: FlatBuffer, spec: StateSpec, every: bool) -> bool:
    """Whether every member holds the same value of each scalar key (``step``, ...).

    Reading a GPU buffer is a device synchronisation (and is refused inside a CUDA graph), so
    those are compared only when ``every`` (when the flat state is built or rebuilt); on the
    CPU, at every step.
    """
    for k in range(len(spec.keys)):
        if spec.places[k] != Place.PARAM_LAYOUT:
            buf = f.state[spec.keys[k]]
            if (every or buf.device.type == "cpu") and not bool(torch.all(buf == buf[0])):
                return False
    return True


def _copied(
    f: FlatBuffer, state: Dict[int, Dict[str, Tensor]], spec: StateSpec
) -> Dict[str, Tensor]:
    """New flat buffers holding the members' state entries (which may be views of the
    current ones, so these are not written in place)."""
    flat: Dict[str, Tensor] = {}
    for k in range(len(spec.keys)):
        name = spec.keys[k]
        if spec.places[k] != Place.PARAM_LAYOUT:
            flat[name] = _copied_scalars(f, state, name)
        else:
            flat[name] = _copied_tensors(f, state, name)
    return flat


def _copied_scalars(f: FlatBuffer, state: Dict[int, Dict[str, Tensor]], name: str) -> Tensor:
    """The members' 0-dim entries ``name``, one element each."""
    values: List[Tensor] = []
    for i in f.members:
        values.append(state[i][name].reshape([1]))
    return torch.cat(values).to(torch.float32)


def _copied_tensors(f: FlatBuffer, state: Dict[int, Dict[str, Tensor]], name: str) -> Tensor:
    """The members' entries ``name`` at their offsets in one new buffer."""
    out = torch.zeros_like(f.param)
    for k in range(len(f.members)):
        src = state[f.members[k]][name]
        a = f.offsets[k]
        out[a:a + src.numel()].view_as(src).copy_(src)
    return out


def _entry_views(
    f: FlatBuffer, flat: Dict[str, Tensor], j: int, spec: StateSpec
) -> Dict[str, Tensor]:
    """Member ``j``'s state entry as views of the flat buffers ``flat``."""
    v = f.views[j]
    a = f.offsets[j]
    entry: Dict[str, Tensor] = {}
    for k in range(len(spec.keys)):
        name = spec.keys[k]
        buf = flat[name]
        if spec.places[k] != Place.PARAM_LAYOUT:
            entry[name] = buf[j]
        else:
            entry[name] = buf[a:a + v.numel()].view_as(v)
    return entry


def _entries_are_views(
    f: FlatBuffer, state: Dict[int, Dict[str, Tensor]], spec: StateSpec
) -> bool:
    """Whether every member's entries are still the views of ``f.state`` it was given."""
    for j in range(len(f.members)):
        entry = state[f.members[j]]
        v = f.views[j]
        a = f.offsets[j]
        for k in range(len(spec.keys)):
            name = spec.keys[k]
            buf = f.state[name]
            if spec.places[k] != Place.PARAM_LAYOUT:
                if not entry[name].is_set_to(buf[j]):
                    return False
            elif not entry[name].is_set_to(buf[a:a + v.numel()].view_as(v)):
                return False
    return True


def spread(groups: Groups) -> None:
    """After the update: copy each flat scalar state's first element (the one the kernel
    advanced) to every member, on its device (no host synchronisation)."""
    for buf in groups.pending:
        if buf.numel() > 1:
            buf[1:].copy_(buf[0].expand(buf.numel() - 1))
    groups.pending.clear()


#: The functional classes (by name) whose update is elementwise, so that stepping a buffer
#: whole equals stepping its members one by one; "FunctionalAdamW" is the builder of an
#: AdamW FunctionalAdam, listed so that a class or builder's ``__name__`` can be looked up.
#: Adafactor and Muon update by a parameter's shape (row and column statistics,
#: orthogonalisation); SparseAdam takes sparse gradients only.
FLAT_CLASSES = frozenset({
    "FunctionalSGD", "FunctionalAdam", "FunctionalAdamW", "FunctionalAdagrad", "FunctionalAdadelta",
    "FunctionalAdamax", "FunctionalRMSprop", "FunctionalRprop", "FunctionalNAdam",
    "FunctionalRAdam", "FunctionalASGD",
})

#: Parameters with more elements step on their own: the per-tensor cost of a kernel is
#: small beside theirs, and the copy into the flat gradient buffer would add to it.
DEFAULT_MAX_NUMEL = 1 << 15


def flatten_parameters(
    optim: Any, max_numel: int = DEFAULT_MAX_NUMEL
) -> Any:
    """Put ``optim``'s small parameters into flat buffers, one per (device, dtype); in place.

    A parameter is flattened when its storage is its own: dense, contiguous, the whole of
    its storage, held by no other tensor (another parameter, a view kept somewhere, a
    tied copy in another module, a numpy array: they would stop seeing its values), of a
    floating dtype, requiring grad where any of ``optim``'s parameters does (a frozen one
    gets no gradient), with at most ``max_numel`` elements. Each becomes a view of its
    buffer (``p.data = view``), with its
    values; the Parameter objects, their ``requires_grad`` and their place in autograd stay
    as they were. Others keep the per-parameter path. Call it before ``script_optimizer``.
    State the optimizer already has is made flat at the next step that can use it.

    Args:
        optim: an eager instance of one of the elementwise functional classes
            (``FLAT_CLASSES``: SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, RMSprop, Rprop,
            NAdam, RAdam, ASGD).
        max_numel: parameters with more elements are not flattened.

    Returns:
        ``optim``.

    Raises:
        ValueError: for a class that does not step elementwise, a compiled optimizer, or a
            negative ``max_numel``.
    """
    name = type(optim).__name__
    if isinstance(optim, torch.jit.ScriptModule):
        raise ValueError(
            "Invalid optim: a compiled optimizer (expected the functional instance; flatten "
            "it before script_optimizer)"
        )
    if name not in FLAT_CLASSES:
        raise ValueError(
            f"Invalid optim: {name} (expected one of the elementwise classes "
            f"{sorted(FLAT_CLASSES)}; "
            f"Adafactor and Muon update by a parameter's shape, SparseAdam takes sparse gradients)"
        )
    if isinstance(max_numel, bool) or not isinstance(max_numel, int) or max_numel < 0:
        raise ValueError(f"Invalid max_numel: {max_numel!r} (expected an int >= 0)")
    params: List[Tensor] = optim.params
    chosen = _flattenable(params, max_numel)
    flats: List[FlatBuffer] = []
    members_of: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
    for i in chosen:
        members_of.setdefault((params[i].device, params[i].dtype), []).append(i)
    flat_members = set(chosen)
    for (device, dtype), members in members_of.items():
        if len(members) < 2:
            flat_members.difference_update(members)
            continue
        total = sum(params[i].numel() for i in members)
        buf = torch.empty(total, dtype=dtype, device=device)
        views: List[Tensor] = []
        offsets: List[int] = []
        a = 0
        with torch.no_grad():
            for i in members:
                p = params[i]
                v = buf[a:a + p.numel()].view_as(p)
                v.copy_(p)
                p.data = v
                views.append(v)
                offsets.append(a)
                a += p.numel()
        flats.append(FlatBuffer(
            members, [params[i] for i in members], views, offsets, buf
        ))
    dense = [[i for i in group if i not in flat_members] for group in device_dtype_groups(params).dense]
    optim.groups = Groups([g for g in dense if g], flats)
    return optim


def _storage_shared_elsewhere(p: Tensor) -> bool:
    """Whether another tensor (a view, a tied copy in another module, a numpy array) holds
    ``p``'s storage: flattening would cut it off from ``p``'s values. Counted by torch's
    storage use count: ``p`` and the Storage object asked for it hold two references."""
    storage = p.untyped_storage()
    if not storage.resizable():
        return True  # memory torch does not own (torch.from_numpy, dlpack)
    count = storage_use_count(storage)
    return count is not None and count > 2


def _flattenable(params: List[Tensor], max_numel: int) -> List[int]:
    """Indices of the parameters whose storage is their own (see ``flatten_parameters``)."""
    storages: Dict[int, int] = {}
    for p in params:
        if p.layout == torch.strided:
            ptr = p.untyped_storage().data_ptr()
            storages[ptr] = storages.get(ptr, 0) + 1
    # Where some parameters require grad, the others are frozen: autograd gives them no
    # gradient, and one member without a gradient keeps its whole buffer per parameter.
    trained = any(p.requires_grad for p in params)
    out: List[int] = []
    for i, p in enumerate(params):
        if (
            p.layout == torch.strided
            and (p.requires_grad or not trained)
            and p.dtype.is_floating_point
            and 0 < p.numel() <= max_numel
            and p.is_contiguous()
            and p.storage_offset() == 0
            and p.untyped_storage().nbytes() == p.numel() * p.element_size()
            and storages[p.untyped_storage().data_ptr()] == 1
            and not is_view(p)
            and not _storage_shared_elsewhere(p)
        ):
            out.append(i)
    return out
