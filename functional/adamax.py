"""Adamax (Adam with the infinity norm), as torch.optim.Adamax."""
import enum
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_at_least,
    check_betas,
    check_lr,
    check_params,
    check_types,
    hyperparameter_argument,
)
from functional._common import (
    new_lr,
    index_of,
    lr_float,
    lr_tensor,
    one_gradient,
    optional_flag,
    pair,
    scalar,
    step_lr,
    unknown_hyperparameter,
)
from functional._flat import device_dtype_groups
from functional._kernels import (
    GatherRules,
    adam_step_sizes,
    check_spec_state,
    decayed,
    gather,
    increment_steps,
    native_kernels,
    native_op,
    no_operands,
    release,
    signed,
    step_counts,
)
from functional._spec import Operand, state_spec


class AdamaxOperand(enum.Enum):
    """Positions of ``FunctionalAdamax``'s state in an operand set (``Operand``)."""

    STEP = 2
    EXP_AVG = 3
    EXP_INF = 4


@native_op
def adamax_native(
    ops: List[List[Tensor]],
    lr: float,
    betas: Tuple[float, float],
    maximize: bool,
    weight_decay: float,
    eps: float,
) -> None:
    """``adamax_update`` on the fused CPU kernel (``csrc/elementwise_ops.cpp``)."""
    torch.ops.distopt_kernels.adamax_(
        ops[Operand.PARAMS.value], ops[Operand.GRADS.value], ops[AdamaxOperand.STEP.value],
        ops[AdamaxOperand.EXP_AVG.value], ops[AdamaxOperand.EXP_INF.value],
        lr, betas[0], betas[1], eps, weight_decay, maximize,
    )


def adamax_update(
    ops: List[List[Tensor]],
    lr: float,
    betas: Tuple[float, float],
    maximize: bool,
    weight_decay: float,
    eps: float,
    capturable: bool,
    lr_t: Optional[Tensor],
    native: bool = False,
) -> None:
    """One Adamax step over ``gather``'s operands ``[params, grads, step, exp_avg, exp_inf]``:
    on the fused CPU kernel when ``native`` (``native_kernels``) and the parameters are on the
    CPU, else on foreach ops (the graph-safe form when ``capturable``; ``lr_t``: ``step_lr``'s
    Tensor lr)."""
    params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
    steps = ops[AdamaxOperand.STEP.value]
    exp_avgs = ops[AdamaxOperand.EXP_AVG.value]
    exp_infs = ops[AdamaxOperand.EXP_INF.value]
    if len(params) == 0:
        return
    if native and params[0].device.type == "cpu":
        adamax_native(ops, lr, betas, maximize, weight_decay, eps)
        return
    beta1, beta2 = betas
    grads = signed(grads, maximize)
    increment_steps(steps)
    grads = decayed(params, grads, weight_decay, lr, False)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_infs, beta2)
    # A new list: the caller's gradients are never changed.
    norms = torch._foreach_abs(grads)
    torch._foreach_add_(norms, eps)
    torch._foreach_maximum_(exp_infs, norms)
    if capturable:
        # theta -= m / (u / step_size), the step sizes computed on the device.
        sizes = adam_step_sizes(step_counts(steps), beta1, lr, lr_t)
        torch._foreach_addcdiv_(params, exp_avgs, torch._foreach_div(exp_infs, sizes.unbind(0)))
        return
    # Foreach ScalarList overloads take TorchScript's `number`, not List[float].
    step_sizes: List[Union[int, float, complex]] = []
    for s in steps:
        step_sizes.append(-(lr / (1.0 - beta1 ** float(s.item()))))
    torch._foreach_addcdiv_(params, exp_avgs, exp_infs, step_sizes)


class FunctionalAdamax:
    r"""Adamax, taking gradients as a list.

    Same arguments, defaults (``lr=2e-3``), state (``step``, ``exp_avg``, ``exp_inf``) and
    results as :class:`torch.optim.Adamax`. With gradient :math:`g_t`, weight decay
    :math:`\lambda`, betas :math:`\beta_1, \beta_2` and learning rate :math:`\gamma`:

    .. math::
        g_t &\leftarrow g_t + \lambda \theta_{t-1} \\
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t \\
        u_t &= \max(\beta_2 u_{t-1}, |g_t| + \epsilon) \\
        \theta_t &= \theta_{t-1} - \frac{\gamma}{1 - \beta_1^t} \frac{m_t}{u_t}

    torch has no fused Adamax kernel: CPU steps run on this project's fused kernel where it
    was built (at the first import), else and with ``foreach=True`` or ``capturable=True``
    on the foreach kernels.

    Args:
        params: the parameters to update (any iterable of Tensors, e.g.
            ``model.parameters()``), in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        betas: coefficients of the running average of the gradient and of the decay of the
            infinity norm.
        eps: term added to the infinity norm for numerical stability.
        weight_decay: L2 penalty.
        foreach: ``True`` selects the foreach kernels.
        maximize: maximize the objective instead of minimizing it.
        differentiable: accepted for compatibility; steps never record autograd history.
        capturable: make the step graph-safe (CUDA graphs): ``step`` lives on the
            parameter's device and every step-dependent number is computed there, none read
            on the host; a Tensor lr is read there too, so that a replayed graph sees changes
            to it.

    Raises:
        ValueError: for a negative lr, eps or weight_decay, or a beta outside [0, 1).
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 2e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        differentiable: bool = False,
        capturable: bool = False,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalAdamax)
            params = check_params(params)
            check_types(FunctionalAdamax, locals())
            check_lr(lr)
            check_at_least("eps", eps, 0.0)
            check_betas(betas)
            check_at_least("weight_decay", weight_decay, 0.0)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.foreach = optional_flag(foreach)
        self.maximize = bool(maximize)
        self.differentiable = bool(differentiable)
        self.capturable = bool(capturable)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.spec = state_spec(
            ['step', 'exp_avg', 'exp_inf'], [0.0, 0.0, 0.0], ["step"], self.capturable
        )
        self.native = native_kernels(foreach, self.capturable)
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
            betas = pair(name, value)
            self.betas = (betas[0], betas[1])
        elif name == "eps":
            self.eps = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        else:
            raise ValueError(
                unknown_hyperparameter("Adamax", name, ["lr", "betas", "eps", "weight_decay"])
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
        lr, lr_t = step_lr(self.lr, self.lr_tensor, self.capturable)
        with torch.no_grad():
            rules = GatherRules(
                self.spec, "dense", "Adamax does not support sparse gradients", False
            )
            gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            for s in range(len(self.operand_sets)):
                adamax_update(
                    self.operand_sets[s], lr, self.betas, self.maximize, self.weight_decay, self.eps,
                    self.capturable, lr_t, self.native,
                )
            release(self.operand_sets, self.groups)
