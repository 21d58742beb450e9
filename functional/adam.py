"""Adam and AdamW (Adam with decoupled weight decay), as torch.optim.Adam and torch.optim.AdamW.

``adam_update`` is the kernel layer (fused or foreach); ``FunctionalAdam`` the thin class
around it. ``FunctionalAdamW`` builds a ``FunctionalAdam`` with decoupled weight decay and
AdamW's defaults, as torch.optim.AdamW is Adam with ``decoupled_weight_decay=True``.
"""
import enum
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_at_least,
    check_betas,
    check_betas_kind,
    check_flags,
    check_fused,
    check_lr,
    check_no_tensor_lr_with_foreach,
    check_params,
    check_types,
    hyperparameter_argument,
)
from functional._common import (
    new_lr,
    index_of,
    lr_float,
    lr_tensor,
    new_pair,
    one_gradient,
    optional_flag,
    pair_of,
    scalar,
    step_lr,
    tensor_pair,
    unknown_hyperparameter,
    use_fused_kernel,
)
from functional._flat import device_dtype_groups
from functional._kernels import (
    GatherRules,
    ScaledRoute,
    adam_step_sizes,
    check_spec_state,
    copy_back,
    count_back,
    decayed,
    fit_fused_layouts,
    gather,
    increment_steps,
    no_operands,
    numbers,
    on_device,
    release,
    signed,
    step_counts,
    step_values,
    scaled_route,
)
from functional._spec import Operand, state_spec


class AdamOperand(enum.Enum):
    """Positions of ``FunctionalAdam``'s state in an operand set (``Operand``; ``adam_keys``:
    ``MAX_EXP_AVG_SQ`` with amsgrad only)."""

    STEP = 2
    EXP_AVG = 3
    EXP_AVG_SQ = 4
    MAX_EXP_AVG_SQ = 5


def adam_keys(amsgrad: bool) -> List[str]:
    """Adam's state keys, in torch.optim's order (``max_exp_avg_sq`` only with amsgrad)."""
    if amsgrad:
        return ["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    return ["step", "exp_avg", "exp_avg_sq"]


def adam_operands(
    ops: List[List[Tensor]], amsgrad: bool
) -> Tuple[List[Tensor], List[Tensor], List[Tensor], List[Tensor], List[Tensor], List[Tensor]]:
    """``gather``'s operand set by name: params, grads, steps, exp_avgs, exp_avg_sqs and
    max_exp_avg_sqs (an empty list without amsgrad)."""
    max_exp_avg_sqs = (
        ops[AdamOperand.MAX_EXP_AVG_SQ.value] if amsgrad else torch.jit.annotate(List[Tensor], [])
    )
    return (
        ops[Operand.PARAMS.value], ops[Operand.GRADS.value], ops[AdamOperand.STEP.value],
        ops[AdamOperand.EXP_AVG.value], ops[AdamOperand.EXP_AVG_SQ.value], max_exp_avg_sqs,
    )


def adam_fused_update(
    ops: List[List[Tensor]], fit: bool, lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, amsgrad: bool, maximize: bool, decoupled_weight_decay: bool,
    grad_scale: Optional[Tensor], found_inf: Optional[Tensor],
) -> None:
    """``adam_update`` of a non-empty operand set on torch's fused kernel
    (``torch._fused_adamw_`` with decoupled weight decay)."""
    params, grads, steps, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = adam_operands(ops, amsgrad)
    staged = fit_fused_layouts(params, grads, exp_avgs) if fit else [params[:0], params[:0]]
    # The fused kernels read the already incremented step, as torch.optim arranges.
    increment_steps(steps)
    scale = on_device(grad_scale, params[0])
    inf = on_device(found_inf, params[0])
    if decoupled_weight_decay:
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
            amsgrad=amsgrad, maximize=maximize, grad_scale=scale, found_inf=inf,
        )
    else:
        torch._fused_adam_(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
            amsgrad=amsgrad, maximize=maximize, grad_scale=scale, found_inf=inf,
        )
    count_back(steps, found_inf)
    copy_back(staged)


def adam_update(
    ops: List[List[Tensor]],
    fit: bool,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
    fused: bool,
    capturable: bool,
    lr_t: Optional[Tensor],
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
) -> None:
    """One Adam step over ``gather``'s operands ``[params, grads, steps, exp_avgs,
    exp_avg_sqs, (max_exp_avg_sqs)]``, on the fused kernel (``adam_fused_update``) or on
    foreach ops (their graph-safe form when ``capturable``; ``lr_t``: ``step_lr``'s Tensor
    lr). ``grad_scale`` and ``found_inf`` (a GradScaler's, fused only) go to the kernel,
    which divides the gradients by the one and skips the update where the other is 1."""
    params, grads, steps, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = adam_operands(ops, amsgrad)
    if len(params) == 0:
        return
    if fused:
        adam_fused_update(
            ops, fit, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize,
            decoupled_weight_decay, grad_scale, found_inf,
        )
        return
    grads = signed(grads, maximize)
    increment_steps(steps)
    grads = decayed(params, grads, weight_decay, lr, decoupled_weight_decay, lr_t)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    if capturable:
        # theta -= m / ((sqrt(v / (1 - beta2^t)) + eps) / step_size), all on the device.
        t = step_counts(steps)
        if amsgrad:
            torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
            denom = torch._foreach_sqrt(max_exp_avg_sqs)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, (1.0 - beta2 ** t).sqrt().unbind(0))
        torch._foreach_add_(denom, eps)
        torch._foreach_div_(denom, adam_step_sizes(t, beta1, lr, lr_t).unbind(0))
        torch._foreach_addcdiv_(params, exp_avgs, denom)
        return
    ts = step_values(steps)
    step_sizes = numbers([-(lr / (1.0 - beta1 ** t)) for t in ts])
    bias_correction2_sqrts = numbers([(1.0 - beta2 ** t) ** 0.5 for t in ts])
    if amsgrad:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        denom = torch._foreach_sqrt(max_exp_avg_sqs)
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrts)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)


class FunctionalAdam:
    r"""Adam, taking gradients as a list.

    Same arguments, defaults, state (``step``, ``exp_avg``, ``exp_avg_sq`` and, with
    ``amsgrad``, ``max_exp_avg_sq``) and results as :class:`torch.optim.Adam`. With gradient
    :math:`g_t`, weight decay :math:`\lambda`, betas :math:`\beta_1, \beta_2` and learning
    rate :math:`\gamma`:

    .. math::
        g_t &\leftarrow g_t + \lambda \theta_{t-1}
            \text{ (or } \theta_{t-1} \leftarrow (1 - \gamma \lambda) \theta_{t-1}
            \text{ with decoupled weight decay)} \\
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t \\
        v_t &= \beta_2 v_{t-1} + (1 - \beta_2) g_t^2
            \quad (\hat v_t = \max(\hat v_{t-1}, v_t) \text{ with amsgrad, else } v_t) \\
        \theta_t &= \theta_{t-1} - \frac{\gamma}{1 - \beta_1^t} \,
            \frac{m_t}{\sqrt{\hat v_t / (1 - \beta_2^t)} + \epsilon}

    Runs on ``torch._fused_adam_`` (``torch._fused_adamw_`` with decoupled weight decay);
    ``fused=False`` or ``foreach=True`` selects the foreach kernels.

    Args:
        params: the parameters to update (any iterable of Tensors, e.g.
            ``model.parameters()``), in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        betas: coefficients of the running averages of the gradient and its square (two
            floats, or two 1-element Tensors read at every step, so that changing them in
            place takes effect, as in torch.optim).
        eps: term added to the denominator for numerical stability.
        weight_decay: L2 penalty (decoupled from the gradient when
            ``decoupled_weight_decay``).
        amsgrad: use the maximum of past squared-gradient averages (AMSGrad).
        foreach: ``True`` selects the foreach kernels.
        maximize: maximize the objective instead of minimizing it.
        capturable: make the foreach step graph-safe (CUDA graphs): ``step`` lives on the
            parameter's device and every step-dependent number is computed there, none read
            on the host; a Tensor lr is read there too, so that a replayed graph sees changes
            to it. The fused kernel keeps ``step`` on the device either way.
        differentiable: accepted for compatibility; steps never record autograd history.
        fused: ``False`` selects the foreach kernels; otherwise the fused kernel is used.
        decoupled_weight_decay: decay the parameters directly, as AdamW does.

    Raises:
        ValueError: for a negative lr, eps or weight_decay, a beta outside [0, 1), or a
            Tensor lr or betas with ``foreach=True`` and ``capturable=False``.
        RuntimeError: for ``fused=True`` with ``foreach=True`` or ``differentiable=True``.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        decoupled_weight_decay: bool = False,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalAdam)
            params = check_params(params)
            check_types(FunctionalAdam, locals())
            check_no_tensor_lr_with_foreach(lr, foreach, capturable)
            check_lr(lr)
            check_at_least("eps", eps, 0.0)
            check_betas(betas)
            check_at_least("weight_decay", weight_decay, 0.0)
            check_betas_kind(betas, foreach, capturable)
            check_fused(params, fused, differentiable)
            check_flags(foreach, fused)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        # Tensor betas are read at every step (``pair_of``), as a Tensor lr is.
        self.betas_tensor = torch.jit.annotate(Optional[List[Tensor]], None)
        if not torch.jit.is_scripting():
            self.betas_tensor = tensor_pair(betas)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.amsgrad = bool(amsgrad)  # the fused kernels take no int or None
        self.foreach = optional_flag(foreach)
        self.maximize = bool(maximize)
        self.capturable = bool(capturable)
        self.differentiable = bool(differentiable)
        self.fused = optional_flag(fused)
        self.decoupled_weight_decay = bool(decoupled_weight_decay)
        self.use_fused = use_fused_kernel(foreach, fused)
        self.name = "Adam"  # "AdamW" when built by FunctionalAdamW
        keys = adam_keys(self.amsgrad)
        self.spec = state_spec(
            keys, [0.0 for _ in keys], ["step"], self.capturable or self.use_fused
        )
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.operand_sets = no_operands()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, betas, eps, weight_decay).

        Values are lists so that every class shares the signature (betas take two).
        """
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        if name == "lr":
            self.lr = new_lr(self.lr_tensor, value)
        elif name == "betas":
            self.betas = new_pair(name, self.betas_tensor, value)
        elif name == "eps":
            self.eps = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        else:
            raise ValueError(
                unknown_hyperparameter(self.name, name, ["lr", "betas", "eps", "weight_decay"])
            )

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError (``checked_state``)."""
        return check_spec_state(self.params, state, self.spec)

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
            RuntimeError: for a sparse gradient.
        """
        self._update(gradients, None, None)

    def step_scaled(
        self,
        gradients: List[Optional[Tensor]],
        grad_scale: Optional[Tensor],
        found_inf: Optional[Tensor],
    ) -> None:
        """``step`` under a ``GradScaler``, as torch.optim.Adam steps with the scaler's
        ``grad_scale`` (None once ``scaler.unscale_`` ran) and ``found_inf``: on the fused
        kernel, which divides the gradients by the scale and, where ``found_inf`` is not 0,
        changes nothing but new (zero) state, the step counted back; on the foreach kernels
        as torch.optim's foreach Adam under ``GradScaler.unscale_``: the gradients divided
        in place, and no step at all after an inf or NaN (``unscale_gradients``)."""
        route = scaled_route(gradients, grad_scale, found_inf, self.use_fused)
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
        # The fused kernel takes a float lr; a capturable foreach step reads a Tensor lr on
        # its device.
        lr, lr_t = step_lr(self.lr, self.lr_tensor, self.capturable and not self.use_fused)
        beta1, beta2 = pair_of(self.betas, self.betas_tensor, self.capturable)
        with torch.no_grad():
            rules = GatherRules(
                self.spec, "dense",
                "Adam does not support sparse gradients, please consider SparseAdam instead",
                self.use_fused,
            )
            fits = gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            for g in range(len(fits)):
                adam_update(
                    self.operand_sets[g], fits[g], lr, beta1, beta2, self.eps,
                    self.weight_decay, self.amsgrad, self.maximize,
                    self.decoupled_weight_decay, self.use_fused, self.capturable, lr_t,
                    grad_scale, found_inf,
                )
            release(self.operand_sets, self.groups)


def FunctionalAdamW(
    params: List[Tensor],
    lr: Union[float, Tensor] = 1e-3,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    foreach: Optional[bool] = None,
    capturable: bool = False,
    differentiable: bool = False,
    fused: Optional[bool] = None,
) -> FunctionalAdam:
    r"""AdamW: a :class:`FunctionalAdam` with weight decay applied to the parameters.

    Same arguments, defaults (``weight_decay=0.01``), state and results as
    :class:`torch.optim.AdamW`, which is torch.optim.Adam with ``decoupled_weight_decay=True``;
    so is this (a function, not a class: TorchScript classes cannot inherit):

    .. math::
        \theta_{t-1} \leftarrow (1 - \gamma \lambda) \theta_{t-1}, \text{ then Adam's update}

    Runs on ``torch._fused_adamw_``; ``fused=False`` or ``foreach=True`` selects the
    foreach kernels. Arguments and errors are :class:`FunctionalAdam`'s.
    """
    if not torch.jit.is_scripting():
        check_types(FunctionalAdamW, locals())
    optim = FunctionalAdam(
        params, lr, betas, eps, weight_decay, amsgrad, foreach, maximize, capturable,
        differentiable, fused, True,
    )
    optim.name = "AdamW"
    return optim
