"""NAdam (Adam with Nesterov momentum), as torch.optim.NAdam."""
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
    check_spec_state,
    decayed,
    gather,
    increment_steps,
    lr_scaled,
    native_kernels,
    native_op,
    no_operands,
    numbers,
    release,
    signed,
    step_counts,
)
from functional._spec import Operand, state_spec


def nadam_momentum(t: Tensor, beta1: float, momentum_decay: float) -> Tensor:
    """NAdam's momentum coefficient ``beta1 * (1 - 0.96 ** (t * momentum_decay) / 2)`` for
    each step count of ``t`` (``step_counts``), on its device."""
    return beta1 * (1.0 - 0.5 * 0.96 ** (t * momentum_decay))


class NAdamOperand(enum.Enum):
    """Positions of ``FunctionalNAdam``'s state in an operand set (``Operand``)."""

    STEP = 2
    MU_PRODUCT = 3
    EXP_AVG = 4
    EXP_AVG_SQ = 5


def nadam_momenta_on_host(
    steps: List[Tensor], beta1: float, beta2: float, momentum_decay: float
) -> Tuple[List[float], List[float], List[Union[int, float, complex]]]:
    """Per parameter, from the step counts read on the host: the momentum coefficients
    ``mu_t`` and ``mu_{t+1}`` (``nadam_momentum``'s) and ``sqrt(1 - beta2 ** t)`` (foreach
    ScalarList overloads take TorchScript's ``number``, not List[float])."""
    mus: List[float] = []
    mu_nexts: List[float] = []
    bias_correction2_sqrts: List[Union[int, float, complex]] = []
    for s in steps:
        t = float(s.item())
        bias_correction2_sqrts.append((1.0 - beta2 ** t) ** 0.5)
        mus.append(beta1 * (1.0 - 0.5 * (0.96 ** (t * momentum_decay))))
        mu_nexts.append(beta1 * (1.0 - 0.5 * (0.96 ** ((t + 1.0) * momentum_decay))))
    return mus, mu_nexts, bias_correction2_sqrts


def nadam_sizes_on_host(
    mu_products: List[Tensor], mus: List[float], mu_nexts: List[float], lr: float
) -> Tuple[List[Union[int, float, complex]], List[Union[int, float, complex]]]:
    """Per parameter, the step sizes of the gradient and of ``exp_avg``, from the updated
    ``mu_product`` read on the host and ``nadam_momenta_on_host``'s coefficients."""
    grad_sizes: List[Union[int, float, complex]] = []
    exp_avg_sizes: List[Union[int, float, complex]] = []
    for j in range(len(mu_products)):
        mu = mus[j]
        mu_next = mu_nexts[j]
        mu_product = float(mu_products[j].item())
        grad_sizes.append(-(lr * (1.0 - mu) / (1.0 - mu_product)))
        exp_avg_sizes.append(-(lr * mu_next / (1.0 - mu_product * mu_next)))
    return grad_sizes, exp_avg_sizes


@native_op
def nadam_native(
    ops: List[List[Tensor]],
    lr: float,
    betas: Tuple[float, float],
    maximize: bool,
    weight_decay: float,
    decoupled_weight_decay: bool,
    momentum_decay: float,
    eps: float,
) -> None:
    """``nadam_update`` on the fused CPU kernel (``csrc/elementwise_ops.cpp``)."""
    torch.ops.distopt_kernels.nadam_(
        ops[Operand.PARAMS.value], ops[Operand.GRADS.value], ops[NAdamOperand.STEP.value],
        ops[NAdamOperand.MU_PRODUCT.value], ops[NAdamOperand.EXP_AVG.value],
        ops[NAdamOperand.EXP_AVG_SQ.value], lr, betas[0], betas[1], eps, weight_decay,
        momentum_decay, decoupled_weight_decay, maximize,
    )


def nadam_update(
    ops: List[List[Tensor]],
    lr: float,
    betas: Tuple[float, float],
    maximize: bool,
    weight_decay: float,
    decoupled_weight_decay: bool,
    momentum_decay: float,
    eps: float,
    capturable: bool,
    lr_t: Optional[Tensor],
    native: bool = False,
) -> None:
    """One NAdam step over ``gather``'s operands ``[params, grads, step, mu_product, exp_avg,
    exp_avg_sq]``: on the fused CPU kernel when ``native`` (``native_kernels``) and the
    parameters are on the CPU, else on foreach ops (the graph-safe form when ``capturable``;
    ``lr_t``: ``step_lr``'s Tensor lr)."""
    params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
    steps = ops[NAdamOperand.STEP.value]
    mu_products = ops[NAdamOperand.MU_PRODUCT.value]
    exp_avgs = ops[NAdamOperand.EXP_AVG.value]
    exp_avg_sqs = ops[NAdamOperand.EXP_AVG_SQ.value]
    if len(params) == 0:
        return
    if native and params[0].device.type == "cpu":
        nadam_native(
            ops, lr, betas, maximize, weight_decay, decoupled_weight_decay, momentum_decay, eps
        )
        return
    beta1, beta2 = betas
    grads = signed(grads, maximize)
    increment_steps(steps)
    grads = decayed(params, grads, weight_decay, lr, decoupled_weight_decay, lr_t)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    if capturable:
        # The same update, its coefficients computed on the device: one division by
        # denom of grad_size * g + exp_avg_size * m.
        t = step_counts(steps)
        mu = nadam_momentum(t, beta1, momentum_decay)
        mu_next = nadam_momentum(t + 1.0, beta1, momentum_decay)
        torch._foreach_mul_(mu_products, mu.unbind(0))
        mu_product = torch.stack(mu_products)
        torch._foreach_div_(denom, (1.0 - beta2 ** t).sqrt().unbind(0))
        torch._foreach_add_(denom, eps)
        grad_sizes = lr_scaled((mu - 1.0) / (1.0 - mu_product), lr, lr_t)
        exp_avg_sizes = lr_scaled(mu_next / (mu_product * mu_next - 1.0), lr, lr_t)
        numerators = torch._foreach_mul(grads, grad_sizes.unbind(0))
        torch._foreach_addcmul_(numerators, exp_avgs, exp_avg_sizes.unbind(0))
        torch._foreach_addcdiv_(params, numerators, denom)
        return
    mus, mu_nexts, bias_correction2_sqrts = nadam_momenta_on_host(
        steps, beta1, beta2, momentum_decay
    )
    # mu_product is float32, as in torch.optim: the step sizes use its rounded value.
    torch._foreach_mul_(mu_products, numbers(mus))
    torch._foreach_div_(denom, bias_correction2_sqrts)
    torch._foreach_add_(denom, eps)
    grad_sizes, exp_avg_sizes = nadam_sizes_on_host(mu_products, mus, mu_nexts, lr)
    torch._foreach_addcdiv_(params, grads, denom, grad_sizes)
    torch._foreach_addcdiv_(params, exp_avgs, denom, exp_avg_sizes)


class FunctionalNAdam:
    r"""NAdam, taking gradients as a list.

    Same arguments, defaults (``lr=2e-3``), state (``step``, ``mu_product``, ``exp_avg``,
    ``exp_avg_sq``) and results as :class:`torch.optim.NAdam`. With gradient :math:`g_t`,
    weight decay :math:`\lambda`, betas :math:`\beta_1, \beta_2`, momentum decay
    :math:`\psi` and learning rate :math:`\gamma`:

    .. math::
        g_t &\leftarrow g_t + \lambda \theta_{t-1}
            \text{ (or } \theta_{t-1} \leftarrow (1 - \gamma \lambda) \theta_{t-1}
            \text{ with decoupled weight decay)} \\
        \mu_t &= \beta_1 \left(1 - \tfrac{1}{2} \, 0.96^{t \psi}\right), \quad
            \Pi_t = \prod_{i \le t} \mu_i \\
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t, \quad
            v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
        \theta_t &= \theta_{t-1} - \gamma \left(\frac{(1 - \mu_t) g_t}{1 - \Pi_t}
            + \frac{\mu_{t+1} m_t}{1 - \Pi_t \mu_{t+1}}\right) \Big/
            \left(\sqrt{v_t / (1 - \beta_2^t)} + \epsilon\right)

    torch has no fused NAdam kernel: CPU steps run on this project's fused kernel where it
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
        momentum_decay: how fast the momentum coefficient approaches ``betas[0]``.
        decoupled_weight_decay: decay the parameters directly, as AdamW does (NAdamW).
        foreach: ``True`` selects the foreach kernels.
        maximize: maximize the objective instead of minimizing it.
        capturable: make the step graph-safe (CUDA graphs): ``step`` and ``mu_product``
            live on the parameter's device and every step-dependent number is computed
            there, none read on the host; a Tensor lr is read there too, so that a replayed
            graph sees changes to it.
        differentiable: accepted for compatibility; steps never record autograd history.

    Raises:
        ValueError: for a negative lr, eps, weight_decay or momentum_decay, or a beta
            outside [0, 1).
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 2e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum_decay: float = 4e-3,
        decoupled_weight_decay: bool = False,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalNAdam)
            params = check_params(params)
            check_types(FunctionalNAdam, locals())
            check_lr(lr)
            check_at_least("eps", eps, 0.0)
            check_betas(betas)
            check_at_least("weight_decay", weight_decay, 0.0)
            check_at_least("momentum_decay", momentum_decay, 0.0)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.momentum_decay = float(momentum_decay)
        self.decoupled_weight_decay = bool(decoupled_weight_decay)
        self.foreach = optional_flag(foreach)
        self.maximize = bool(maximize)
        self.capturable = bool(capturable)
        self.differentiable = bool(differentiable)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.spec = state_spec(
            ['step', 'mu_product', 'exp_avg', 'exp_avg_sq'],
            [0.0, 1.0, 0.0, 0.0], ["step", "mu_product"], self.capturable,
        )
        self.native = native_kernels(foreach, self.capturable)
        self.operand_sets = no_operands()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, betas, eps, weight_decay,
        momentum_decay).

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
        elif name == "momentum_decay":
            self.momentum_decay = scalar(name, value)
        else:
            raise ValueError(
                unknown_hyperparameter(
                    "NAdam", name, ["lr", "betas", "eps", "weight_decay", "momentum_decay"]
                )
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
                self.spec, "dense", "NAdam does not support sparse gradients", False
            )
            gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            for s in range(len(self.operand_sets)):
                nadam_update(
                    self.operand_sets[s], lr, self.betas, self.maximize, self.weight_decay,
                    self.decoupled_weight_decay, self.momentum_decay, self.eps,
                    self.capturable, lr_t, self.native,
                )
            release(self.operand_sets, self.groups)
