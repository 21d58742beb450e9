"""The kernel layer's shared half: one pass that gathers a step's operands, and the helpers
every update function uses. Each algorithm module adds its own update functions beside its
class (``adam_update``, ``radam_update``, ...), as torch.optim keeps ``_multi_tensor_adam``
and ``_fused_adam`` beside ``Adam``.

A step is: ``gather`` (check every gradient, create missing state, collect the operands of
each (device, dtype) group) then one update call per group, on the fused kernel where torch
has a CPU one, on this project's fused CPU kernel (``csrc/elementwise_ops.cpp``, see
``native_kernels``) for the elementwise algorithms torch has none for, and on foreach ops
otherwise. A class built with ``capturable=True`` keeps its
scalar state on the parameter's device and takes the graph-safe form of its foreach update:
every step-dependent number computed there from ``step_counts``, none read on the host.

Two TorchScript limits (torch 2.13) are handled here, once:

- In-place foreach and fused kernels whose tensor lists were built inside a compiled method
  are removed as dead code, although they write to parameters and state. ``gather`` writes
  the operand lists into the caller's ``operand_sets`` attribute, where the compiler sees them
  escape; ``release`` empties it after the update. A class cannot forget it: ``gather``
  takes the attribute as its first argument.
- Identical ``zeros_like(p)`` calls are merged by common-subexpression elimination, and
  ``torch.zeros(())`` with constant arguments is folded into one tensor shared by every
  parameter. ``new_state`` makes every entry from one call site in a loop, so no two
  entries can be merged.

Errors: bad values raise in one form, ``ValueError("Invalid gradients[3]: ... (expected ...)")``;
the ``RuntimeError`` refusals of a gradient kind or a complex parameter keep torch.optim's exact
wording, for code that matches on it.
"""
import enum
from typing import Callable, Dict, List, NamedTuple, Optional, TypeVar, Union

import torch
from torch import Tensor

from functional import _native
from functional._common import checked_state, dtype_name, layout_name, meta_params
from functional._flat import Groups, flat_operands, split_flats, spread
from functional._spec import Operand, Place, StateSpec, scalar_device
from functional._torch import unscale_and_check_

_F = TypeVar("_F", bound=Callable[..., None])


#: The classes whose fused kernel is not bit for bit torch.optim's step (a few ulps: see
#: ``csrc/elementwise_ops.cpp``): it runs only when asked for with ``foreach=False``, and
#: the foreach path stays their default, as torch keeps a fused kernel off by default.
INEXACT_KERNELS = ("Adafactor",)


def native_kernels(foreach: Optional[bool], capturable: bool, exact: bool = True) -> bool:
    """Whether a class without a torch fused kernel steps its CPU parameters on this
    project's fused kernel (``torch.ops.distopt_kernels``, ``csrc/elementwise_ops.cpp``): one
    pass over parameter, gradient and state instead of one per foreach op, with the foreach
    path's results (see that file). Yes where ``functional._native`` built it (for the
    classes not ``exact``, ``INEXACT_KERNELS``, only with ``foreach=False``), unless
    ``foreach=True`` (the foreach path, as asked) or ``capturable=True`` (its graph-safe
    foreach form, which reads nothing on the host). Parameters off the CPU always take the
    foreach path."""
    if not _native.KERNELS:
        return False
    if foreach is not None and foreach:
        return False
    if not exact and foreach is None:
        return False  # not bit for bit torch.optim's: only when asked (foreach=False)
    return not capturable


def native_op(fn: _F) -> _F:
    """Decorate a function that calls a ``torch.ops.distopt_kernels`` op: where the kernels
    were not built the op does not exist, so TorchScript compiles the function's callers
    against its signature alone (``torch.jit.unused``; ``native_kernels`` is then False and
    the function is never called)."""
    if not _native.KERNELS:
        torch.jit.unused(fn)
    return fn


def new_state(p: Tensor, spec: StateSpec) -> Dict[str, Tensor]:
    """A fresh state entry for ``p``: ``spec.keys[k]`` holds ``spec.fills[k]``, as a 0-dim
    float32 tensor where ``spec.places[k]`` is a scalar place (the CPU, or ``p``'s device),
    a vector of ``p``'s rows (its dtype and device) where it is ``Place.ROW``, else a tensor
    laid out as ``p`` (torch.optim's ``memory_format=torch.preserve_format``).

    Also each class's template for ``check_state`` (run on a meta parameter, at no cost: a
    scalar template on the meta device stands for the parameter's device).
    """
    keys, fills, places = spec.keys, spec.fills, spec.places
    entry: Dict[str, Tensor] = {}
    cx = p.is_complex()
    for k in range(len(keys)):
        if places[k] == Place.ROW:
            entry[keys[k]] = torch.full((p.shape[0],), fills[k], dtype=p.dtype, device=p.device)
        elif places[k] != Place.PARAM_LAYOUT:
            device = scalar_device(p, places[k])
            entry[keys[k]] = torch.full((), fills[k], dtype=torch.float32, device=device)
        elif cx:
            # torch.optim fills a complex parameter's state with complex(v, v): every real
            # component of its ``view_as_real`` holds v, as a real parameter's would.
            t = torch.empty_like(p, memory_format=torch.preserve_format)
            torch.view_as_real(t).fill_(fills[k])
            entry[keys[k]] = t
        else:
            entry[keys[k]] = torch.full_like(p, fills[k], memory_format=torch.preserve_format)
    return entry


def check_spec_state(
    params: List[Tensor], state: Dict[int, Dict[str, Tensor]], spec: StateSpec
) -> Dict[int, Dict[str, Tensor]]:
    """``state`` checked against the fresh state ``new_state`` would make (``checked_state``)."""
    fresh = {i: new_state(p, spec) for i, p in meta_params(params, state)}
    return checked_state(params, state, fresh)


def check_length(params: List[Tensor], gradients: List[Optional[Tensor]]) -> None:
    """One gradient (or None) per parameter, or ValueError."""
    if len(gradients) != len(params):
        raise ValueError(
            f"Invalid gradients: {len(gradients)} gradients for {len(params)} parameters "
            f"(expected one gradient or None per parameter)"
        )


class GatherRules(NamedTuple):
    """What a class's ``gather`` makes and accepts.

    Attributes:
        spec: the state each parameter gets (``new_state``) and its operand sets carry.
        kinds: the gradients the class takes: "dense", "sparse" or "both" (read once per
            step).
        refusal: the ``RuntimeError`` message for a gradient of another kind.
        fused: the class steps on a fused kernel, so ``gather`` says where
            ``fit_fused_layouts`` must run.
    """

    spec: StateSpec
    kinds: str
    refusal: str
    fused: bool


class GatherPass(NamedTuple):
    """One gathering pass's results so far, filled by ``_gather_groups``.

    Attributes:
        operand_sets: the operand sets (the class's ``operand_sets`` attribute).
        fits: per operand set, whether ``fit_fused_layouts`` must run.
        created: the parameters given new state in this pass (removed again on a refusal).
        sparse_ops: the one operand set of parameters with a sparse gradient (kinds "both").
    """

    operand_sets: List[List[List[Tensor]]]
    fits: List[bool]
    created: List[int]
    sparse_ops: List[List[Tensor]]


def gather(
    operand_sets: List[List[List[Tensor]]],
    params: List[Tensor],
    state: Dict[int, Dict[str, Tensor]],
    groups: Groups,
    gradients: List[Optional[Tensor]],
    rules: GatherRules,
) -> List[bool]:
    """Check every gradient, create missing state, and put the operands in ``operand_sets``.

    One pass over the parameters. ``operand_sets`` (the class's attribute, see the module
    note) is filled with one operand set per (device, dtype) group of ``groups.dense``: ``[params,
    grads, state[keys[0]], state[keys[1]], ...]`` (positions named by ``Operand``) of the
    parameters whose gradient is not None, plus one set of the parameters with a sparse
    gradient when ``rules.kinds`` is "both". A parameter without state gets
    ``new_state(p, rules.spec)``. A flat buffer of ``groups.flats`` adds one operand set of
    single flat tensors when it can step whole (``_flat.flat_gradients``,
    ``_flat.flat_operands``), else its members are gathered as a dense group; ``release``
    finishes its scalar state after the update.

    Returns:
        Per operand set, whether ``fit_fused_layouts`` must run before a fused kernel (only
        computed when ``rules.fused``: a parameter or gradient that is not contiguous).

    Raises:
        ValueError: a gradient list of another length, or a gradient whose shape or dtype
            differs from its parameter's. RuntimeError(``rules.refusal``): a gradient of a
            kind the class does not take. In either case the state made in this pass is
            removed again, so nothing has changed.
    """
    check_length(params, gradients)
    operand_sets.clear()
    groups.pending.clear()
    out = GatherPass(
        operand_sets, torch.jit.annotate(List[bool], []), torch.jit.annotate(List[int], []),
        new_operands(len(rules.spec.keys)),
    )
    todo, whole = split_flats(groups, gradients, rules.kinds)
    _gather_groups(out, params, state, gradients, todo, rules)
    # Flat buffers last: every gradient is accepted by now, so their state (made flat here)
    # never needs undoing.
    for k in range(len(whole)):
        f = whole[k]
        ops = flat_operands(f, state, rules.spec, groups.pending)
        if len(ops) == 0:
            _gather_groups(out, params, state, gradients, [f.members], rules)
        else:
            operand_sets.append(ops)
            out.fits.append(False)
    if rules.kinds == "both":
        operand_sets.append(out.sparse_ops)
        out.fits.append(False)
    return out.fits


def _gather_groups(
    out: GatherPass,
    params: List[Tensor],
    state: Dict[int, Dict[str, Tensor]],
    gradients: List[Optional[Tensor]],
    todo: List[List[int]],
    rules: GatherRules,
) -> None:
    """``gather``'s per-parameter pass over the index groups ``todo``: one operand set each
    into ``out.operand_sets`` (and its fit into ``out.fits``), sparse gradients into
    ``out.sparse_ops``."""
    operand_sets, fits, created = out.operand_sets, out.fits, out.created
    spec, refusal, fused = rules.spec, rules.refusal, rules.fused
    keys = spec.keys
    n = len(keys)
    k0 = keys[0] if n > 0 else ""
    k1 = keys[1] if n > 1 else ""
    k2 = keys[2] if n > 2 else ""
    k3 = keys[3] if n > 3 else ""
    klay = _layout_key(spec)
    sparse_only = rules.kinds == "sparse"
    sparse_too = rules.kinds == "both"
    # One layout compare per gradient also refuses sparse compressed and mkldnn gradients.
    want = torch.sparse_coo if sparse_only else torch.strided
    for group in todo:
        ops = new_operands(n)
        # The lists as locals: each ops[k] in the loop would be an interpreter instruction
        # per parameter (this loop is the per-parameter cost of every step).
        p_list, g_list = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
        s0 = ops[Operand.STATE.value] if n > 0 else p_list
        s1 = ops[Operand.STATE.value + 1] if n > 1 else p_list
        s2 = ops[Operand.STATE.value + 2] if n > 2 else p_list
        s3 = ops[Operand.STATE.value + 3] if n > 3 else p_list
        fit = False
        for i in group:
            g = gradients[i]
            if g is not None:
                p = params[i]
                if not g.is_same_size(p) or g.dtype != p.dtype or g.layout != want or g.device != p.device:
                    if sparse_too and g.is_sparse and g.is_same_size(p) and g.dtype == p.dtype and g.device == p.device:
                        _gather_one(out, p, g, state, i, spec)
                        continue
                    refuse(state, created, i, g, p, refusal)
                if i not in state:
                    state[i] = new_state(p, spec)
                    created.append(i)
                entry = state[i]
                p_list.append(p)
                g_list.append(g)
                # Unrolled over at most four keys: a loop here costs an interpreter
                # iteration per key and parameter.
                if n > 0:
                    s0.append(entry[k0])
                    if n > 1:
                        s1.append(entry[k1])
                        if n > 2:
                            s2.append(entry[k2])
                            if n > 3:
                                s3.append(entry[k3])
                if fused and not fit:
                    fit = not (
                        p.is_contiguous() and g.is_contiguous()
                        and (klay == "" or entry[klay].is_contiguous())
                    )
        if len(group) > 0 and params[group[0]].is_complex():
            # A group is of one dtype (``_flat.device_dtype_groups``; flat buffers are never
            # complex).
            ops = real_views(ops, spec.places)
        operand_sets.append(ops)
        fits.append(fit)


def _layout_key(spec: StateSpec) -> str:
    """The first key laid out as the parameter (its entries carry the state's memory
    layout), or "" where there is none."""
    for k in range(len(spec.keys)):
        if spec.places[k] == Place.PARAM_LAYOUT:
            return spec.keys[k]
    return ""


def _gather_one(
    out: GatherPass,
    p: Tensor,
    g: Tensor,
    state: Dict[int, Dict[str, Tensor]],
    i: int,
    spec: StateSpec,
) -> None:
    """``gather``'s slow path for one parameter (a sparse gradient beside dense ones) into
    ``out.sparse_ops``."""
    if i not in state:
        state[i] = new_state(p, spec)
        out.created.append(i)
    entry = state[i]
    ops = out.sparse_ops
    ops[Operand.PARAMS.value].append(p)
    ops[Operand.GRADS.value].append(g)
    for k in range(len(spec.keys)):
        ops[Operand.STATE.value + k].append(entry[spec.keys[k]])


def real_views(ops: List[List[Tensor]], places: List[Place]) -> List[List[Tensor]]:
    """An operand set ``[params, grads, state[keys[0]], ...]`` of complex parameters with
    every complex tensor as its ``view_as_real`` view (a conjugate's resolved first): the
    kernels take real tensors only, and torch.optim steps a complex parameter's real and
    imaginary parts as real elements. The scalar state (a scalar ``places[k]``: ``step``,
    ...) is real already. The state itself stays complex, as torch.optim keeps it."""
    out: List[List[Tensor]] = []
    for k in range(len(ops)):
        state_k = k - Operand.STATE.value
        if state_k >= 0 and places[state_k] != Place.PARAM_LAYOUT:
            out.append(ops[k])
        else:
            out.append([torch.view_as_real(t.resolve_conj()) for t in ops[k]])
    return out


def new_operands(n: int) -> List[List[Tensor]]:
    """An empty operand set: lists for params, grads and ``n`` state keys."""
    return [torch.jit.annotate(List[Tensor], []) for _ in range(Operand.STATE.value + n)]


def refuse(
    state: Dict[int, Dict[str, Tensor]], created: List[int], i: int, g: Tensor, p: Tensor, refusal: str
) -> None:
    """Undo a gathering pass's new state (``created``), then raise the error that gradient
    ``i`` deserves: its shape, its dtype, or else ``RuntimeError(refusal)`` for its kind."""
    for j in created:
        del state[j]
    if g.layout != torch.strided and g.layout != torch.sparse_coo:
        raise ValueError(
            f"Invalid gradients[{i}]: layout {layout_name(g.layout)} (expected torch.strided, "
            f"or torch.sparse_coo where the class takes sparse gradients)"
        )
    if g.shape != p.shape:
        raise ValueError(
            f"Invalid gradients[{i}]: shape {g.shape} (expected {p.shape}, "
            f"the shape of params[{i}])"
        )
    if g.dtype != p.dtype:
        raise ValueError(
            f"Invalid gradients[{i}]: dtype {dtype_name(g.dtype)} (expected "
            f"{dtype_name(p.dtype)}, the dtype of params[{i}])"
        )
    if g.device != p.device:
        raise ValueError(
            f"Invalid gradients[{i}]: device {g.device} (expected {p.device}, the device of "
            f"params[{i}])"
        )
    # torch.optim's own wording, kept so that code matching torch's message keeps working.
    raise RuntimeError(refusal)


def release(operand_sets: List[List[List[Tensor]]], groups: Groups) -> None:
    """After the update: drop the operand lists (the references ``gather`` put in ``operand_sets``)
    and spread the flat buffers' advanced scalar state to all their members."""
    operand_sets.clear()
    spread(groups)


def no_operands() -> List[List[List[Tensor]]]:
    """An empty ``operand_sets`` attribute for a class's constructor."""
    return torch.jit.annotate(List[List[List[Tensor]]], [])


def add_sparse_(dense: Tensor, sparse: Tensor, alpha: float = 1.0) -> None:
    """``dense += alpha * sparse`` for a sparse COO ``sparse``, exact wherever ``dense`` lies.

    ``Tensor.add_`` of a sparse tensor to a dense one that does not start its storage (a flat
    parameter's view, a slice) writes at the storage's start instead, and past its end: wrong
    numbers, then a heap abort (torch 2.13 CPU, measured; torch.optim meets it too). Such a
    ``dense`` gets ``index_put_`` with accumulation, the same sums in the same order.
    """
    if dense.storage_offset() == 0 and dense.is_contiguous():
        dense.add_(sparse, alpha=alpha)
        return
    indices = sparse._indices()
    values = sparse._values()
    if alpha != 1.0:
        values = values * alpha
    rows: List[Optional[Tensor]] = []
    for d in range(indices.size(0)):
        rows.append(indices[d])
    dense.index_put_(rows, values, accumulate=True)


def increment_steps(steps: List[Tensor]) -> None:
    """Add 1 to every ``step`` tensor (all on one device: ``gather`` groups by device).

    On the CPU a Tensor operand, not the number 1: with a number, foreach ops on CPU 0-dim
    tensors wrap it into a new tensor once per element (measured: 1,000 steps, 1.5 ms instead
    of 0.36 ms, more than a fused Adam step over the same parameters). On a GPU the number:
    a CPU tensor operand there sends the foreach op down its per-tensor path.
    """
    if len(steps) == 0:
        return
    if steps[0].device.type == "cpu":
        torch._foreach_add_(steps, torch.ones((), dtype=torch.float32), alpha=1.0)
    else:
        torch._foreach_add_(steps, 1.0)


def unscale_gradients(
    gradients: List[Optional[Tensor]], grad_scale: Optional[Tensor], found_inf: Optional[Tensor]
) -> bool:
    """What torch.optim meets under a ``GradScaler`` when its step takes no ``grad_scale``
    (every class but the fused ones): each gradient divided in place by the scale as
    ``GradScaler.unscale_`` divides it (times the reciprocal taken in float64, then float32;
    a sparse gradient's values), and whether the step is to be skipped (``found_inf``, the
    scaler's inf/NaN check, is not 0: torch.optim's ``step`` is then not called at all, so
    no state is made). ``grad_scale`` None: the gradients are unscaled already
    (``scaler.unscale_(opt)`` ran)."""
    if grad_scale is not None:
        inv_scale = grad_scale.double().reciprocal().float()
        # By device and dtype, as GradScaler.unscale_ groups them.
        groups: List[List[Tensor]] = []
        for g in gradients:
            if g is not None:
                t = g._values() if g.is_sparse else g
                placed = False
                for group in groups:
                    if not placed and group[0].device == t.device and group[0].dtype == t.dtype:
                        group.append(t)
                        placed = True
                if not placed:
                    groups.append([t])
        for group in groups:
            device = group[0].device
            seen = torch.zeros((), dtype=torch.float32, device=device)
            unscale_and_check_(group, seen, inv_scale.to(device))
    if found_inf is None:
        return False
    return bool(found_inf.item() != 0.0)


class ScaledRoute(enum.Enum):
    """How a class's ``step_scaled`` steps under a ``GradScaler`` (``scaled_route``)."""

    #: Its plain update: no scaler, or the gradients unscaled in place without an inf.
    PLAIN = 0
    #: No update at all: an inf or NaN, as torch.optim's step is then not called.
    SKIP = 1
    #: Its fused kernel, given ``grad_scale`` and ``found_inf``, as torch.optim's fused
    #: classes are given them.
    FUSED = 2


def scaled_route(
    gradients: List[Optional[Tensor]],
    grad_scale: Optional[Tensor],
    found_inf: Optional[Tensor],
    fused: bool,
) -> ScaledRoute:
    """How a class's ``step_scaled`` steps under a ``GradScaler``: ``FUSED`` when ``fused``
    (the step runs on its fused kernel) and there is a scaler; else the gradients unscaled
    in place here by ``unscale_gradients``, then ``SKIP`` after an inf or NaN and ``PLAIN``
    otherwise (also without a scaler)."""
    if grad_scale is None and found_inf is None:
        return ScaledRoute.PLAIN
    if fused:
        return ScaledRoute.FUSED
    if unscale_gradients(gradients, grad_scale, found_inf):
        return ScaledRoute.SKIP
    return ScaledRoute.PLAIN


def count_back(steps: List[Tensor], found_inf: Optional[Tensor]) -> None:
    """After a fused kernel given ``found_inf``: ``step -= found_inf``, so that a step the
    kernel skipped is not counted (torch.optim's fused classes do the same)."""
    if found_inf is None or len(steps) == 0:
        return
    flag = found_inf.to(steps[0].device)
    torch._foreach_sub_(steps, [flag for _ in range(len(steps))])


def on_device(t: Optional[Tensor], like: Tensor) -> Optional[Tensor]:
    """``t`` on ``like``'s device (a fused kernel's ``grad_scale`` / ``found_inf``), or None."""
    if t is None:
        return None
    return t.to(like.device)


def step_values(steps: List[Tensor]) -> List[float]:
    """The step counts as floats, read once each (the foreach paths' per-tensor sizes)."""
    return [float(s.item()) for s in steps]


def step_counts(steps: List[Tensor]) -> Tensor:
    """The step counts as one 1-D float32 tensor on their device (``gather`` groups by device).

    The capturable updates compute every step-dependent number (bias corrections, step
    sizes, NAdam's momentum, ASGD's eta and mu) from it with tensor ops, and hand it back
    per parameter as 0-dim foreach operands (``unbind``): nothing is read on the host, where
    each read of a GPU tensor is a device synchronisation and a CUDA graph cannot record one.
    On the CPU the numbers are those of ``step_values``' float path to float32 rounding.
    """
    return torch.stack(steps)


def lr_scaled(x: Tensor, lr: float, lr_t: Optional[Tensor]) -> Tensor:
    """``x * lr``, by the Tensor lr where a capturable step has one (``step_lr``), else by the
    float."""
    if lr_t is None:
        return x * lr
    return x * lr_t


def adam_step_sizes(t: Tensor, beta1: float, lr: float, lr_t: Optional[Tensor]) -> Tensor:
    """Adam's bias-corrected step size ``-lr / (1 - beta1 ** t)`` for each step count of ``t``
    (``step_counts``), on its device; Adam's, Adamax's and RAdam's capturable updates."""
    return lr_scaled(1.0 / (beta1 ** t - 1.0), lr, lr_t)


def descend_(params: List[Tensor], updates: List[Tensor], lr: float, lr_t: Optional[Tensor]) -> None:
    """``params -= lr * updates``; a Tensor lr (``step_lr``) is read on its device."""
    if lr_t is None:
        torch._foreach_add_(params, updates, alpha=-lr)
    else:
        torch._foreach_sub_(params, torch._foreach_mul(updates, lr_t))


def signed(grads: List[Tensor], maximize: bool) -> List[Tensor]:
    """The gradients to descend: negated (a new list) when maximizing, else as given."""
    if maximize:
        return torch._foreach_neg(grads)
    return grads


def decayed(
    params: List[Tensor],
    grads: List[Tensor],
    weight_decay: float,
    lr: float,
    decoupled: bool,
    lr_t: Optional[Tensor] = None,
) -> List[Tensor]:
    """Apply weight decay: to the parameters in place when ``decoupled`` (AdamW's
    ``p *= 1 - lr * wd``, by the Tensor lr ``lr_t`` of a capturable step where it has one),
    else to a new gradient list (``g + wd * p``). The gradients to use."""
    if weight_decay == 0.0:
        return grads
    if decoupled:
        if lr_t is None:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        else:
            torch._foreach_mul_(params, 1.0 - lr_t * weight_decay)
        return grads
    return torch._foreach_add(grads, params, alpha=weight_decay)


def numbers(values: List[float]) -> List[Union[int, float, complex]]:
    """``values`` typed as foreach ScalarList overloads take them in TorchScript (``number``,
    not ``float``)."""
    out: List[Union[int, float, complex]] = []
    for v in values:
        out.append(v)
    return out


def dense_layout(t: Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive memory slots (in any order).

    That is what the fused CPU kernels need: they walk ``numel`` elements from the data
    pointer, so a tensor with gaps (a slice) or overlaps (stride 0) is stepped wrongly or
    written outside its own elements.
    """
    if t.is_contiguous():
        return True
    sizes = t.size()
    strides = t.stride()
    dims: List[int] = []
    for d in range(len(sizes)):
        if sizes[d] != 1:
            # Insertion by stride: a handful of dimensions at most.
            k = len(dims)
            while k > 0 and strides[dims[k - 1]] > strides[d]:
                k -= 1
            dims.insert(k, d)
    expected = 1
    for d in dims:
        if strides[d] != expected:
            return False
        expected *= sizes[d]
    return True


def fit_fused_layouts(
    params: List[Tensor], grads: List[Tensor], like: List[Tensor]
) -> List[List[Tensor]]:
    """Make the fused kernels' operands exact for every memory layout; in place.

    A fused CPU kernel treats a parameter, its gradient and its state as ``numel`` elements
    from each data pointer, element k of one matching element k of the others. That holds
    when the parameter's layout is dense, its state's strides equal it and so do the
    gradient's; state is made in ``torch.empty_like(param)``'s layout, the parameter's own
    when dense. Otherwise the parameter (a slice with gaps, stride 0, or a dense parameter
    whose layout changed since its state was made: ``p.data`` transposed, a module moved to
    channels_last) is replaced in ``params`` by a copy laid out as its state (``like[k]``,
    a non-scalar state tensor, when the class has made it), to be copied back by
    ``copy_back`` after the kernel, and a gradient laid out differently is replaced in
    ``grads`` by a copy in that layout (gradients read from a dist_autograd context carry
    no layout promise). ``gather`` says when this is needed, so contiguous operands pay
    nothing here.

    Returns:
        ``[originals, copies]`` of the replaced parameters, for ``copy_back``.
    """
    originals: List[Tensor] = []
    copies: List[Tensor] = []
    has_like = len(like) == len(params)
    for k in range(len(params)):
        p = params[k]
        g = grads[k]
        s = like[k] if has_like else p
        if not (p.is_contiguous() and g.is_contiguous() and s.is_contiguous()):
            if not dense_layout(p) or (has_like and p.stride() != s.stride()):
                if has_like:
                    work = torch.empty_strided(s.size(), s.stride(), dtype=p.dtype, device=p.device)
                else:
                    work = torch.empty_like(p)
                work.copy_(p)
                originals.append(p)
                copies.append(work)
                params[k] = work
                p = work
            if g.stride() != p.stride():
                fitted = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device=p.device)
                fitted.copy_(g)
                grads[k] = fitted
    return [originals, copies]


def copy_back(staged: List[List[Tensor]]) -> None:
    """Write the dense copies made by ``fit_fused_layouts`` back into their parameters."""
    originals = staged[0]
    copies = staged[1]
    for k in range(len(originals)):
        originals[k].copy_(copies[k])
