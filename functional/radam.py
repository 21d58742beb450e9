"""RAdam (rectified Adam), as torch.optim.RAdam."""
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


def radam_sizes_on_host(
    steps: List[Tensor], beta1: float, beta2: float, lr: float
) -> Tuple[List[Union[int, float, complex]], List[Union[int, float, complex]]]:
    """Per parameter: the step size of the adaptive term (0 while rho_t <= 5, which sends
    that term to zero in ``radam_update``) and of the plain momentum term (0 once rho_t > 5),
    from the step counts read on the host.

    Foreach ScalarList overloads take TorchScript's `number`, not List[float].
    """
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    adaptive_sizes: List[Union[int, float, complex]] = []
    plain_sizes: List[Union[int, float, complex]] = []
    for s in steps:
        t = float(s.item())
        rho_t = rho_inf - 2.0 * t * (beta2 ** t) / (1.0 - beta2 ** t)
        rect = 0.0
        if rho_t > 5.0:
            rect = (
                (rho_t - 4.0) * (rho_t - 2.0) * rho_inf
                / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)
            ) ** 0.5
        unrectified = 0.0 if rect > 0.0 else 1.0
        bias_correction1 = 1.0 - beta1 ** t
        plain_sizes.append(-(lr * unrectified / bias_correction1))
        adaptive_sizes.append(-(((1.0 - beta2 ** t) ** 0.5) * (lr * rect / bias_correction1)))
    return adaptive_sizes, plain_sizes


def radam_sizes_on_device(
    t: Tensor, beta1: float, beta2: float, lr: float, lr_t: Optional[Tensor]
) -> List[Tensor]:
    """``radam_sizes_on_host``'s ``[adaptive, plain]`` step sizes for each step count of ``t``
    (``step_counts``), computed on its device (capturable steps)."""
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    decay = beta2 ** t
    rho_t = rho_inf - 2.0 * t * decay / (1.0 - decay)
    # Where rho_t <= 5 the ratio may be negative; its root is masked out.
    ratio = (rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)
    rect = ratio.sqrt().masked_fill(rho_t <= 5.0, 0.0)
    sizes = adam_step_sizes(t, beta1, lr, lr_t)
    return [sizes * rect * (1.0 - decay).sqrt(), sizes.masked_fill(rect > 0.0, 0.0)]


class RAdamOperand(enum.Enum):
    """Positions of ``FunctionalRAdam``'s state in an operand set (``Operand``)."""

    STEP = 2
    EXP_AVG = 3
    EXP_AVG_SQ = 4


@native_op
def radam_native(
    ops: List[List[Tensor]],
    lr: float,
    betas: Tuple[float, float],
    maximize: bool,
    weight_decay: float,
    decoupled_weight_decay: bool,
    eps: float,
) -> None:
    """``radam_update`` on the fused CPU kernel (``csrc/elementwise_ops.cpp``)."""
    torch.ops.distopt_kernels.radam_(
        ops[Operand.PARAMS.value], ops[Operand.GRADS.value], ops[RAdamOperand.STEP.value],
        ops[RAdamOperand.EXP_AVG.value], ops[RAdamOperand.EXP_AVG_SQ.value],
        lr, betas[0], betas[1], eps, weight_decay, decoupled_weight_decay, maximize,
    )


def radam_update(
    ops: List[List[Tensor]],
    lr: float,
    betas: Tuple[float, float],
    maximize: bool,
    weight_decay: float,
    decoupled_weight_decay: bool,
    eps: float,
    capturable: bool,
    lr_t: Optional[Tensor],
    native: bool = False,
) -> None:
    """One RAdam step over ``gather``'s operands ``[params, grads, step, exp_avg, exp_avg_sq]``:
    on the fused CPU kernel when ``native`` (``native_kernels``) and the parameters are on the
    CPU, else on foreach ops (the graph-safe form when ``capturable``; ``lr_t``:
    ``step_lr``'s Tensor lr)."""
    params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
    steps = ops[RAdamOperand.STEP.value]
    exp_avgs = ops[RAdamOperand.EXP_AVG.value]
    exp_avg_sqs = ops[RAdamOperand.EXP_AVG_SQ.value]
    if len(params) == 0:
        return
    if native and params[0].device.type == "cpu":
        radam_native(ops, lr, betas, maximize, weight_decay, decoupled_weight_decay, eps)
        return
    beta1, beta2 = betas
    increment_steps(steps)
    grads = signed(grads, maximize)
    grads = decayed(params, grads, weight_decay, lr, decoupled_weight_decay, lr_t)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    # factor = adaptive_size / (sqrt(v) + eps) + plain_size; division by a zero
    # adaptive size gives an infinity whose reciprocal is the wanted zero.
    factors = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(factors, eps)
    if capturable:
        sizes = radam_sizes_on_device(step_counts(steps), beta1, beta2, lr, lr_t)
        torch._foreach_div_(factors, sizes[0].unbind(0))
        torch._foreach_reciprocal_(factors)
        torch._foreach_add_(factors, sizes[1].unbind(0))
    else:
        adaptive_sizes, plain_sizes = radam_sizes_on_host(steps, beta1, beta2, lr)
        torch._foreach_div_(factors, adaptive_sizes)
        torch._foreach_reciprocal_(factors)
        torch._foreach_add_(factors, plain_sizes)
    torch._foreach_addcmul_(params, exp_avgs, factors)


class FunctionalRAdam:
    r"""RAdam, taking gradients as a list.

    Same arguments, defaults, state (``step``, ``exp_avg``, ``exp_avg_sq``) and results as
    :class:`torch.optim.RAdam`. With gradient :math:`g_t`, weight decay :math:`\lambda`,
    betas :math:`\beta_1, \beta_2` and learning rate :math:`\gamma`, the adaptive term is
    used only once the variance of the adaptive learning rate is tractable
    (:math:`\rho_t > 5`):

    .. math::
        g_t &\leftarrow g_t + \lambda \theta_{t-1}
            \text{ (or } \theta_{t-1} \leftarrow (1 - \gamma \lambda) \theta_{t-1}
            \text{ with decoupled weight decay)} \\
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t, \quad
            v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2, \quad
            \hat m_t = m_t / (1 - \beta_1^t) \\
        \rho_\infty &= \frac{2}{1 - \beta_2} - 1, \quad
            \rho_t = \rho_\infty - \frac{2 t \beta_2^t}{1 - \beta_2^t} \\
        r_t &= \sqrt{\frac{(\rho_t - 4)(\rho_t - 2)\rho_\infty}
            {(\rho_\infty - 4)(\rho_\infty - 2)\rho_t}} \\
        \theta_t &= \begin{cases}
            \theta_{t-1} - \gamma \hat m_t r_t \sqrt{1 - \beta_2^t} / (\sqrt{v_t} + \epsilon)
                & \rho_t > 5 \\
            \theta_{t-1} - \gamma \hat m_t & \text{otherwise} \end{cases}

    torch has no fused RAdam kernel: CPU steps run on this project's fused kernel where it
    was built (at the first import), else and with ``foreach=True`` or ``capturable=True``
    on the foreach kernels.

    Args:
        params: the parameters to update (any iterable of Tensors, e.g.
            ``model.parameters()``), in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator for numerical stability.
        weight_decay: L2 penalty (decoupled from the gradient when
            ``decoupled_weight_decay``).
        decoupled_weight_decay: decay the parameters directly, as AdamW does (RAdamW).
        foreach: ``True`` selects the foreach kernels.
        maximize: maximize the objective instead of minimizing it.
        capturable: make the step graph-safe (CUDA graphs): ``step`` lives on the
            parameter's device and every step-dependent number is computed there, none read
            on the host; a Tensor lr is read there too, so that a replayed graph sees changes
            to it.
        differentiable: accepted for compatibility; steps never record autograd history.

    Raises:
        ValueError: for a negative lr, eps or weight_decay, or a beta outside [0, 1).
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalRAdam)
            params = check_params(params)
            check_types(FunctionalRAdam, locals())
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
        self.decoupled_weight_decay = bool(decoupled_weight_decay)
        self.foreach = optional_flag(foreach)
        self.maximize = bool(maximize)
        self.capturable = bool(capturable)
        self.differentiable = bool(differentiable)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.spec = state_spec(
            ['step', 'exp_avg', 'exp_avg_sq'], [0.0, 0.0, 0.0], ["step"], self.capturable
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
                unknown_hyperparameter("RAdam", name, ["lr", "betas", "eps", "weight_decay"])
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
                self.spec, "dense", "RAdam does not support sparse gradients", False
            )
            gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            for s in range(len(self.operand_sets)):
                radam_update(
                    self.operand_sets[s], lr, self.betas, self.maximize, self.weight_decay,
                    self.decoupled_weight_decay, self.eps, self.capturable, lr_t, self.native,
                )
            release(self.operand_sets, self.groups)
