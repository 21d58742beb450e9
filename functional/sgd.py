"""Stochastic gradient descent (optionally with momentum), as torch.optim.SGD."""
import enum
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_at_least,
    check_flags,
    check_fused,
    check_lr,
    check_nesterov,
    check_params,
    check_types,
    hyperparameter_argument,
)
from functional._common import (
    new_lr,
    checked_state,
    index_of,
    lr_float,
    lr_of,
    lr_tensor,
    meta_params,
    one_gradient,
    optional_flag,
    scalar,
    unknown_hyperparameter,
    use_fused_kernel,
)
from functional._flat import Groups, flat_operands, device_dtype_groups, split_flats
from functional._kernels import (
    add_sparse_,
    check_length,
    copy_back,
    fit_fused_layouts,
    new_operands,
    no_operands,
    on_device,
    real_views,
    refuse,
    release,
    signed,
    scaled_route,
    ScaledRoute,
)
from functional._spec import Operand, Place, StateSpec


class SGDOperand(enum.Enum):
    """Positions of ``FunctionalSGD``'s state in ``sgd_gather``'s operand sets (``Operand``;
    an empty list without momentum)."""

    MOMENTUM_BUFFER = 2


def momentum_spec(momentum: bool) -> StateSpec:
    """SGD's state as a flat buffer keeps it: a momentum buffer laid out as the parameter,
    none without momentum."""
    if momentum:
        return StateSpec(["momentum_buffer"], [0.0], [Place.PARAM_LAYOUT])
    return StateSpec(
        torch.jit.annotate(List[str], []), torch.jit.annotate(List[float], []),
        torch.jit.annotate(List[Place], []),
    )


def sgd_gather(
    operand_sets: List[List[List[Tensor]]],
    params: List[Tensor],
    state: Dict[int, Dict[str, Tensor]],
    groups: Groups,
    gradients: List[Optional[Tensor]],
    momentum: bool,
    fused: bool,
    weight_decay: float,
    nesterov: bool,
) -> Tuple[List[bool], List[int], List[Tensor], List[int]]:
    """SGD's one pass (``_kernels.gather``'s, split by momentum history): per group, the
    operand set ``[params, grads, bufs]`` of first momentum steps (new buffers laid out as
    their parameters, which the kernel fills with the gradient: torch.optim's ``b_1 = g``),
    then that of later steps. A flat buffer that steps whole adds such a pair too, one of
    them empty; its members' state entries are views of the flat momentum buffer.

    Returns:
        Per operand set whether ``fit_fused_layouts`` must run (when ``fused``); the indices
        of the new per-parameter buffers and the buffers (they enter the state after the
        kernel); the indices of parameters with a sparse gradient (stepped one by one, as
        torch.optim does).
    """
    check_length(params, gradients)
    operand_sets.clear()
    groups.pending.clear()
    fits: List[bool] = []
    first_indices: List[int] = []
    first_bufs: List[Tensor] = []
    sparse_indices: List[int] = []
    todo, whole = split_flats(groups, gradients, "both")
    spec = momentum_spec(momentum)
    for group in todo:
        _sgd_group(operand_sets, fits, params, state, group, gradients, momentum, fused,
                   weight_decay, nesterov, first_indices, first_bufs, sparse_indices)
    # Flat buffers last: every gradient is accepted by now, so their state (made flat here)
    # never needs undoing.
    for k in range(len(whole)):
        f = whole[k]
        # All members or none have a momentum buffer once the flat state is made (else the
        # buffer steps per parameter); none: the kernel's first step fills the new one.
        first = momentum and f.members[0] not in state
        ops = flat_operands(f, state, spec, groups.pending)
        if len(ops) == 0:
            _sgd_group(operand_sets, fits, params, state, f.members, gradients, momentum, fused,
                       weight_decay, nesterov, first_indices, first_bufs, sparse_indices)
            continue
        if not momentum:
            ops.append(torch.jit.annotate(List[Tensor], []))
        empty = new_operands(1)
        operand_sets.append(ops if first else empty)
        operand_sets.append(empty if first else ops)
        fits.append(False)
        fits.append(False)
    return fits, first_indices, first_bufs, sparse_indices


def _sgd_group(
    operand_sets: List[List[List[Tensor]]],
    fits: List[bool],
    params: List[Tensor],
    state: Dict[int, Dict[str, Tensor]],
    group: List[int],
    gradients: List[Optional[Tensor]],
    momentum: bool,
    fused: bool,
    weight_decay: float,
    nesterov: bool,
    first_indices: List[int],
    first_bufs: List[Tensor],
    sparse_indices: List[int],
) -> None:
    """``sgd_gather``'s per-parameter pass over one index group: its pair of operand sets.

    Also refuses, before anything changes, the three mixes that torch.optim.SGD fails on
    part-way through its update: a sparse gradient with weight decay, a sparse gradient with
    Nesterov momentum on a dense buffer, a dense gradient on a sparse buffer (one that a
    sparse first step made)."""
    first = new_operands(1)
    later = new_operands(1)
    first_fit = False
    later_fit = False
    for i in group:
        g = gradients[i]
        if g is not None:
            p = params[i]
            if not g.is_same_size(p) or g.dtype != p.dtype or g.device != p.device:
                refuse(state, torch.jit.annotate(List[int], []), i, g, p, "")
            if g.layout != torch.strided:
                check_sparse_gradient(state, i, g, p, weight_decay, nesterov)
                sparse_indices.append(i)
            elif momentum and i in state:
                buf = state[i]["momentum_buffer"]
                if buf.is_sparse:
                    sparse_mix(i, f"a dense gradient, and a sparse momentum buffer in "
                               f"state[{i}] (from a sparse first step)")
                later[Operand.PARAMS.value].append(p)
                later[Operand.GRADS.value].append(g)
                later[SGDOperand.MOMENTUM_BUFFER.value].append(buf)
                if fused and not later_fit:
                    later_fit = not (p.is_contiguous() and g.is_contiguous() and buf.is_contiguous())
            else:
                first[Operand.PARAMS.value].append(p)
                first[Operand.GRADS.value].append(g)
                if momentum:
                    buf = torch.empty_like(p)
                    first_indices.append(i)
                    first_bufs.append(buf)
                    first[SGDOperand.MOMENTUM_BUFFER.value].append(buf)
                if fused and not first_fit:
                    first_fit = not (p.is_contiguous() and g.is_contiguous())
    if len(group) > 0 and params[group[0]].is_complex():
        # torch.optim steps complex parameters as real pairs (a group is of one dtype).
        first = real_views(first, [Place.PARAM_LAYOUT])
        later = real_views(later, [Place.PARAM_LAYOUT])
    operand_sets.append(first)
    operand_sets.append(later)
    fits.append(first_fit)
    fits.append(later_fit)


def check_sparse_gradient(
    state: Dict[int, Dict[str, Tensor]], i: int, g: Tensor, p: Tensor, weight_decay: float,
    nesterov: bool,
) -> None:
    """Refuse gradient ``i`` of a layout other than strided unless it is sparse COO, and a
    sparse one that torch.optim.SGD fails on part-way through its update: with weight decay,
    or with Nesterov momentum on a dense buffer."""
    if not g.is_sparse:
        refuse(state, torch.jit.annotate(List[int], []), i, g, p, "")
    if weight_decay != 0.0:
        sparse_mix(i, f"a sparse gradient with weight_decay={weight_decay}")
    if nesterov and i in state and not state[i]["momentum_buffer"].is_sparse:
        sparse_mix(i, f"a sparse gradient with nesterov=True, and a dense "
                   f"momentum buffer in state[{i}]")


def sgd_update(
    ops: List[List[Tensor]],
    fit: bool,
    first: bool,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    fused: bool,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
) -> None:
    """One SGD step over ``[params, grads, momentum_buffers]`` (no buffers without momentum),
    on the fused kernel or on foreach ops; ``first``: the buffers are new (``b_1 = g``).
    ``grad_scale`` and ``found_inf`` (a GradScaler's; ``FunctionalSGD.step_scaled`` gives
    them to the fused kernel only) make the kernel divide the gradients by the one and skip
    the update where the other is 1.

    float16 and bfloat16 groups take the foreach ops even when ``fused``: torch 2.13's fused
    CPU SGD kernel leaves such parameters of 16 or more elements unchanged (and, with
    momentum, writes wrong buffers), measured against torch.optim's for-loop and float64.
    """
    params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
    bufs = ops[SGDOperand.MOMENTUM_BUFFER.value]
    if len(params) == 0:
        return
    low = params[0].dtype == torch.float16 or params[0].dtype == torch.bfloat16
    if fused and not low:
        staged = fit_fused_layouts(params, grads, bufs) if fit else [params[:0], params[:0]]
        torch._fused_sgd_(
            params, grads, bufs, weight_decay=weight_decay, momentum=momentum, lr=lr,
            dampening=dampening, nesterov=nesterov, maximize=maximize, is_first_step=first,
            grad_scale=on_device(grad_scale, params[0]), found_inf=on_device(found_inf, params[0]),
        )
        copy_back(staged)
        return
    grads = signed(grads, maximize)
    if weight_decay != 0.0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if momentum != 0.0:
        if first:
            torch._foreach_copy_(bufs, grads)
        else:
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, grads, alpha=1.0 - dampening)
        if nesterov:
            grads = torch._foreach_add(grads, bufs, alpha=momentum)
        else:
            grads = bufs
    torch._foreach_add_(params, grads, alpha=-lr)


def _all_fused(params: List[Tensor], gradients: List[Optional[Tensor]]) -> bool:
    """Whether ``sgd_update``'s fused kernel steps every given gradient: dense ones of
    parameters other than float16/bfloat16."""
    for i in range(len(gradients)):
        g = gradients[i]
        if g is not None:
            dtype = params[i].dtype
            if g.is_sparse or dtype == torch.float16 or dtype == torch.bfloat16:
                return False
    return True


def sparse_mix(i: int, what: str) -> None:
    """Raise torch.optim.SGD's error for a sparse/dense mix it cannot add, naming the
    gradient (the wording is torch's, so that code matching it keeps working)."""
    raise RuntimeError(
        f"add(sparse, dense) is not supported. Use add(dense, sparse) instead. "
        f"(Invalid gradients[{i}]: {what}; torch.optim.SGD fails the same way.)"
    )


def sgd_sparse_update(
    param: Tensor,
    grad: Tensor,
    buf: Optional[Tensor],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
) -> Optional[Tensor]:
    """torch.optim's per-tensor rule, the only one that takes a sparse gradient. Returns the
    momentum buffer (new on a first step: a clone of the gradient, sparse as torch.optim
    keeps it), None without momentum."""
    if maximize:
        grad = -grad
    if weight_decay != 0.0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0.0:
        if buf is not None:
            buf.mul_(momentum)
            if grad.is_sparse and not buf.is_sparse:
                add_sparse_(buf, grad, 1.0 - dampening)
            else:
                buf.add_(grad, alpha=1.0 - dampening)
        else:
            buf = torch.clone(grad).detach()
        if nesterov:
            grad = grad.add(buf, alpha=momentum)
        else:
            grad = buf
    if grad.is_sparse:
        add_sparse_(param, grad, -lr)
    else:
        param.add_(grad, alpha=-lr)
    return buf


class FunctionalSGD:
    r"""SGD with momentum, dampening, Nesterov and weight decay, taking gradients as a list.

    Same arguments, defaults, state (``momentum_buffer``) and results as
    :class:`torch.optim.SGD`. With gradient :math:`g_t`, weight decay :math:`\lambda`,
    momentum :math:`\mu`, dampening :math:`\tau` and learning rate :math:`\gamma`:

    .. math::
        g_t &\leftarrow g_t + \lambda \theta_{t-1} \\
        b_t &= \begin{cases} g_t & t = 1 \\ \mu b_{t-1} + (1 - \tau) g_t & t > 1 \end{cases} \\
        g_t &\leftarrow g_t + \mu b_t \text{ (Nesterov) or } b_t \\
        \theta_t &= \theta_{t-1} - \gamma g_t

    Dense gradients run on ``torch._fused_sgd_`` (``fused=False`` selects the foreach
    kernels), except float16/bfloat16 parameters, which always take the foreach kernels:
    torch 2.13's fused CPU kernel does not update them (see ``sgd_update``). Sparse gradients
    take the per-tensor path, as torch.optim does.

    Args:
        params: the parameters to update (any iterable of Tensors, e.g.
            ``model.parameters()``), in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        momentum: momentum factor.
        dampening: dampening for momentum.
        weight_decay: L2 penalty.
        nesterov: use Nesterov momentum.
        maximize: maximize the objective instead of minimizing it.
        foreach: accepted for compatibility; ``foreach=True`` selects the foreach kernels.
        differentiable: accepted for compatibility; steps never record autograd history.
        fused: ``False`` selects the foreach kernels; otherwise the fused kernel is used.

    Raises:
        ValueError: for a negative lr, momentum or weight_decay, or Nesterov without
            momentum or with dampening.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        differentiable: bool = False,
        fused: Optional[bool] = None,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalSGD)
            params = check_params(params)
            check_types(FunctionalSGD, locals())
            check_lr(lr)
            check_at_least("momentum", momentum, 0.0)
            check_at_least("weight_decay", weight_decay, 0.0)
            check_flags(foreach, fused)
            check_fused(params, fused, differentiable)
            check_nesterov(nesterov, momentum, dampening)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.momentum = float(momentum)
        self.dampening = float(dampening)
        self.weight_decay = float(weight_decay)
        self.nesterov = bool(nesterov)  # the fused kernel takes no int or None
        self.maximize = bool(maximize)
        self.foreach = optional_flag(foreach)
        self.differentiable = bool(differentiable)
        self.fused = optional_flag(fused)
        self.use_fused = use_fused_kernel(foreach, fused)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.operand_sets = no_operands()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, momentum, dampening, weight_decay).

        Values are lists so that every class shares the signature (pairs take two).
        """
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        if name == "lr":
            self.lr = new_lr(self.lr_tensor, value)
        elif name == "momentum":
            self.momentum = scalar(name, value)
        elif name == "dampening":
            self.dampening = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        else:
            raise ValueError(
                unknown_hyperparameter("SGD", name, ["lr", "momentum", "dampening", "weight_decay"])
            )

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError (``checked_state``)."""
        fresh = {i: self._new_state(p) for i, p in meta_params(self.params, state)}
        # torch.optim keeps a sparse gradient's momentum buffer sparse.
        return checked_state(self.params, state, fresh, ["momentum_buffer"])

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Replace the whole state, checked first (``check_state``): a bad one changes nothing."""
        self.state = self.check_state(state)

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Update one parameter with its gradient (None: leave it and its state as they are)."""
        self.step(one_gradient(len(self.params), index_of(self.params, param), grad))

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None.

        Args:
            gradients: one gradient (or None to skip that parameter) per parameter.

        Raises:
            ValueError: if the list's length, or a gradient's shape or dtype, does not match.
        """
        self._update(gradients, None, None)

    def step_scaled(
        self,
        gradients: List[Optional[Tensor]],
        grad_scale: Optional[Tensor],
        found_inf: Optional[Tensor],
    ) -> None:
        """``step`` under a ``GradScaler``, as torch.optim.SGD steps with the scaler's
        ``grad_scale`` (None once ``scaler.unscale_`` ran) and ``found_inf``: on the fused
        kernel, which divides the gradients by the scale and changes nothing where
        ``found_inf`` is not 0; elsewhere (foreach, float16/bfloat16 parameters, sparse
        gradients) as torch.optim's other paths under ``GradScaler.unscale_``: the gradients
        divided in place, and no step at all after an inf or NaN (``unscale_gradients``).

        A skipped first momentum step keeps no buffer, so the next step is a first one
        (torch 2.13's fused SGD keeps the uninitialized buffer it made for it and steps the
        next update with that memory).
        """
        fused = self.use_fused and _all_fused(self.params, gradients)
        route = scaled_route(gradients, grad_scale, found_inf, fused)
        if route == ScaledRoute.PLAIN:
            self._update(gradients, None, None)
        elif route == ScaledRoute.FUSED:
            self._update(gradients, grad_scale, found_inf)

    def _update(
        self,
        gradients: List[Optional[Tensor]],
        grad_scale: Optional[Tensor],
        found_inf: Optional[Tensor],
    ) -> None:
        lr = lr_of(self.lr, self.lr_tensor)
        with torch.no_grad():
            fits, first_indices, first_bufs, sparse_indices = sgd_gather(
                self.operand_sets, self.params, self.state, self.groups, gradients,
                self.momentum != 0.0, self.use_fused, self.weight_decay, self.nesterov,
            )
            for s in range(len(fits)):
                sgd_update(
                    self.operand_sets[s], fits[s], s % 2 == 0, lr, self.momentum, self.dampening,
                    self.weight_decay, self.nesterov, self.maximize, self.use_fused,
                    grad_scale, found_inf,
                )
            skipped = (
                len(first_indices) > 0 and found_inf is not None and float(found_inf.item()) != 0.0
            )
            if not skipped:  # a skipped first step's new buffers were never written
                for k in range(len(first_indices)):
                    self.state[first_indices[k]] = {"momentum_buffer": first_bufs[k]}
            release(self.operand_sets, self.groups)
            for i in sparse_indices:
                grad = gradients[i]
                assert grad is not None
                buf: Optional[Tensor] = None
                if i in self.state:
                    buf = self.state[i]["momentum_buffer"]
                buf = sgd_sparse_update(
                    self.params[i], grad, buf, lr, self.momentum, self.dampening,
                    self.weight_decay, self.nesterov, self.maximize,
                )
                if buf is not None:
                    self.state[i] = {"momentum_buffer": buf}

    def _new_state(self, p: Tensor) -> Dict[str, Tensor]:
        """A fresh state entry for ``p`` (the template ``set_state`` checks against): a
        momentum buffer laid out as ``p``, none without momentum."""
        if self.momentum != 0.0:
            return {"momentum_buffer": torch.empty_like(p)}
        return torch.jit.annotate(Dict[str, Tensor], {})
