"""Adam and AdamW (Adam with decoupled weight decay), as torch.optim.Adam and torch.optim.AdamW.

The math lives in the module-level functions, shared by both classes; what the two classes
still repeat (constructor body, setters, the few lines of ``step``) is there because
TorchScript classes cannot inherit.
"""
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_at_least,
    check_betas,
    check_betas_kind,
    check_flags,
    check_fused_differentiable,
    check_lr,
    check_no_tensor_lr_with_foreach,
    check_params,
    check_types,
)
from functional._common import (
    optional_flag,
    checked_state,
    meta_params,
    copy_back,
    fit_fused_layouts,
    increment_steps,
    check_gradients,
    group_by_device_dtype,
    index_of,
    lr_float,
    lr_of,
    lr_tensor,
    new_step,
    no_lists,
    one_gradient,
    pair,
    scalar,
    unknown_hyperparameter,
    use_fused_kernel,
)

def adam_state(param: Tensor, amsgrad: bool) -> Dict[str, Tensor]:
    """A parameter's fresh Adam state: torch.optim's keys, ``max_exp_avg_sq`` only with amsgrad."""
    # TorchScript limit: once inlined into a step, identical zeros_like(param) calls are
    # merged into one tensor (common-subexpression elimination), so that exp_avg and
    # exp_avg_sq would alias; each buffer is made from the previous one instead.
    exp_avg = torch.zeros_like(param, memory_format=torch.preserve_format)
    exp_avg_sq = torch.zeros_like(exp_avg, memory_format=torch.preserve_format)
    state = {"step": new_step(), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if amsgrad:
        state["max_exp_avg_sq"] = torch.zeros_like(exp_avg_sq, memory_format=torch.preserve_format)
    return state


def adam_lists(
    params: List[Tensor],
    state: Dict[int, Dict[str, Tensor]],
    group: List[int],
    gradients: List[Optional[Tensor]],
    amsgrad: bool,
) -> List[List[Tensor]]:
    """The kernels' operands for one group: params, grads, exp_avgs, exp_avg_sqs,
    max_exp_avg_sqs (empty without amsgrad) and steps of the parameters with a gradient.

    A parameter's state is created (``adam_state``) the first time it has a gradient; one
    pass over the group does both.
    """
    p_list: List[Tensor] = []
    g_list: List[Tensor] = []
    m_list: List[Tensor] = []
    v_list: List[Tensor] = []
    vmax_list: List[Tensor] = []
    s_list: List[Tensor] = []
    for i in group:
        g = gradients[i]
        if g is not None:
            if g.is_sparse:
                raise RuntimeError(
                    "Adam does not support sparse gradients, please consider SparseAdam instead"
                )
            if i not in state:
                state[i] = adam_state(params[i], amsgrad)
            entry = state[i]
            p_list.append(params[i])
            g_list.append(g)
            m_list.append(entry["exp_avg"])
            v_list.append(entry["exp_avg_sq"])
            if amsgrad:
                vmax_list.append(entry["max_exp_avg_sq"])
            s_list.append(entry["step"])
    return [p_list, g_list, m_list, v_list, vmax_list, s_list]


def adam_update(
    lists: List[List[Tensor]],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
    fused: bool,
) -> None:
    """One Adam step over the operands from ``adam_lists``, on the fused or foreach kernels."""
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = (
        lists[0], lists[1], lists[2], lists[3], lists[4], lists[5]
    )
    if len(params) == 0:
        return
    if fused:
        staged = fit_fused_layouts(params, grads)
        # The fused kernels read the already incremented step, as torch.optim arranges.
        increment_steps(steps)
        if decoupled_weight_decay:
            torch._fused_adamw_(
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                amsgrad=amsgrad, maximize=maximize,
            )
        else:
            torch._fused_adam_(
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                amsgrad=amsgrad, maximize=maximize,
            )
        copy_back(staged)
        return
    if maximize:
        grads = torch._foreach_neg(grads)
    increment_steps(steps)
    if weight_decay != 0.0:
        if decoupled_weight_decay:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    # Foreach ScalarList overloads take TorchScript's `number`, not List[float].
    step_sizes: List[Union[int, float, complex]] = []
    bias_correction2_sqrts: List[Union[int, float, complex]] = []
    for s in steps:
        t = float(s.item())
        step_sizes.append(-(lr / (1.0 - beta1 ** t)))
        bias_correction2_sqrts.append((1.0 - beta2 ** t) ** 0.5)
    if amsgrad:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        denom = torch._foreach_sqrt(max_exp_avg_sqs)
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrts)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)


def adam_set_hyperparameter(
    cls_name: str, name: str, value: List[float]
) -> Tuple[float, float]:
    """Validate a hyper-parameter change for Adam or AdamW; the new value(s) as a pair."""
    if name == "betas":
        betas = pair(name, value)
        return (betas[0], betas[1])
    if name == "lr" or name == "eps" or name == "weight_decay":
        v = scalar(name, value)
        return (v, v)
    raise ValueError(unknown_hyperparameter(cls_name, name, ["lr", "betas", "eps", "weight_decay"]))


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
        params: the parameters to update, in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator for numerical stability.
        weight_decay: L2 penalty (decoupled from the gradient when
            ``decoupled_weight_decay``).
        amsgrad: use the maximum of past squared-gradient averages (AMSGrad).
        foreach: ``True`` selects the foreach kernels.
        maximize: maximize the objective instead of minimizing it.
        capturable: accepted for compatibility; state always lives where torch.optim keeps
            it without CUDA graphs.
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
            check_params(params)
            check_types(FunctionalAdam, locals())
            check_no_tensor_lr_with_foreach(lr, foreach, capturable)
            check_lr(lr)
            check_at_least("eps", eps, 0.0)
            check_betas(betas)
            check_at_least("weight_decay", weight_decay, 0.0)
            check_betas_kind(betas, foreach, capturable)
            check_fused_differentiable(fused, differentiable)
            check_flags("Adam", foreach, fused)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.betas = (float(betas[0]), float(betas[1]))
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
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = group_by_device_dtype(params)
        self.live = no_lists()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, betas, eps, weight_decay).

        Values are lists so that every class shares the signature (betas take two).
        """
        new = adam_set_hyperparameter("Adam", name, value)
        if name == "lr":
            self.lr = new[0]
            lr_tensor = self.lr_tensor
            if lr_tensor is not None:
                lr_tensor.fill_(self.lr)
        elif name == "betas":
            self.betas = new
        elif name == "eps":
            self.eps = new[0]
        else:
            self.weight_decay = new[0]

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError (``checked_state``)."""
        fresh = {i: adam_state(p, self.amsgrad) for i, p in meta_params(self.params, state)}
        return checked_state(self.params, state, fresh)

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Replace the whole state, checked first (``check_state``): a bad one changes nothing."""
        self.state = self.check_state(state)

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Update one parameter with its gradient (None: leave it and its state as they are)."""
        i = index_of(self.params, param)
        self.step(one_gradient(len(self.params), i, grad))

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None.

        Args:
            gradients: one gradient (or None to skip that parameter) per parameter.

        Raises:
            ValueError: if the list's length, or a gradient's shape or dtype, does not match.
            RuntimeError: for a sparse gradient.
        """
        check_gradients(self.params, gradients)
        lr = lr_of(self.lr, self.lr_tensor)
        with torch.no_grad():
            for group in self.groups:
                lists = adam_lists(self.params, self.state, group, gradients, self.amsgrad)
                self.live = lists
                adam_update(
                    lists, lr, self.betas[0], self.betas[1], self.eps, self.weight_decay,
                    self.amsgrad, self.maximize, self.decoupled_weight_decay, self.use_fused,
                )
            self.live = no_lists()


class FunctionalAdamW:
    r"""AdamW: Adam with weight decay applied to the parameters, not the gradient.

    Same arguments, defaults (``weight_decay=0.01``), state and results as
    :class:`torch.optim.AdamW`; the update is :class:`FunctionalAdam`'s with
    ``decoupled_weight_decay=True``:

    .. math::
        \theta_{t-1} &\leftarrow (1 - \gamma \lambda) \theta_{t-1} \\
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t \\
        v_t &= \beta_2 v_{t-1} + (1 - \beta_2) g_t^2
            \quad (\hat v_t = \max(\hat v_{t-1}, v_t) \text{ with amsgrad, else } v_t) \\
        \theta_t &= \theta_{t-1} - \frac{\gamma}{1 - \beta_1^t} \,
            \frac{m_t}{\sqrt{\hat v_t / (1 - \beta_2^t)} + \epsilon}

    Runs on ``torch._fused_adamw_``; ``fused=False`` or ``foreach=True`` selects the
    foreach kernels.

    Args:
        params: the parameters to update, in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator for numerical stability.
        weight_decay: decoupled weight decay coefficient.
        amsgrad: use the maximum of past squared-gradient averages (AMSGrad).
        maximize: maximize the objective instead of minimizing it.
        foreach: ``True`` selects the foreach kernels.
        capturable: accepted for compatibility; state always lives where torch.optim keeps
            it without CUDA graphs.
        differentiable: accepted for compatibility; steps never record autograd history.
        fused: ``False`` selects the foreach kernels; otherwise the fused kernel is used.

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
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalAdamW)
            check_params(params)
            check_types(FunctionalAdamW, locals())
            check_no_tensor_lr_with_foreach(lr, foreach, capturable)
            check_lr(lr)
            check_at_least("eps", eps, 0.0)
            check_betas(betas)
            check_at_least("weight_decay", weight_decay, 0.0)
            check_betas_kind(betas, foreach, capturable)
            check_fused_differentiable(fused, differentiable)
            check_flags("AdamW", foreach, fused)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.amsgrad = bool(amsgrad)  # the fused kernels take no int or None
        self.maximize = bool(maximize)
        self.foreach = optional_flag(foreach)
        self.capturable = bool(capturable)
        self.differentiable = bool(differentiable)
        self.fused = optional_flag(fused)
        # torch.optim.AdamW keeps this in its param groups too (always True).
        self.decoupled_weight_decay = True
        self.use_fused = use_fused_kernel(foreach, fused)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = group_by_device_dtype(params)
        self.live = no_lists()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, betas, eps, weight_decay).

        Values are lists so that every class shares the signature (betas take two).
        """
        new = adam_set_hyperparameter("AdamW", name, value)
        if name == "lr":
            self.lr = new[0]
            lr_tensor = self.lr_tensor
            if lr_tensor is not None:
                lr_tensor.fill_(self.lr)
        elif name == "betas":
            self.betas = new
        elif name == "eps":
            self.eps = new[0]
        else:
            self.weight_decay = new[0]

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError (``checked_state``)."""
        fresh = {i: adam_state(p, self.amsgrad) for i, p in meta_params(self.params, state)}
        return checked_state(self.params, state, fresh)

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Replace the whole state, checked first (``check_state``): a bad one changes nothing."""
        self.state = self.check_state(state)

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Update one parameter with its gradient (None: leave it and its state as they are)."""
        i = index_of(self.params, param)
        self.step(one_gradient(len(self.params), i, grad))

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None.

        Args:
            gradients: one gradient (or None to skip that parameter) per parameter.

        Raises:
            ValueError: if the list's length, or a gradient's shape or dtype, does not match.
            RuntimeError: for a sparse gradient.
        """
        check_gradients(self.params, gradients)
        lr = lr_of(self.lr, self.lr_tensor)
        with torch.no_grad():
            for group in self.groups:
                lists = adam_lists(self.params, self.state, group, gradients, self.amsgrad)
                self.live = lists
                adam_update(
                    lists, lr, self.betas[0], self.betas[1], self.eps, self.weight_decay,
                    self.amsgrad, self.maximize, True, self.use_fused,
                )
            self.live = no_lists()
