"""Averaged SGD (SGD with decaying steps and a running parameter average), as torch.optim.ASGD."""
import enum
from typing import Dict, List, Optional, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_at_least,
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
    release,
    signed,
    step_counts,
)
from functional._spec import Operand, StateSpec, state_spec


class ASGDOperand(enum.Enum):
    """Positions of ``FunctionalASGD``'s state in an operand set (``Operand``)."""

    STEP = 2
    ETA = 3
    MU = 4
    AX = 5


@native_op
def asgd_native(
    ops: List[List[Tensor]],
    lr: float,
    lambd: float,
    maximize: bool,
    weight_decay: float,
    alpha: float,
    t0: float,
) -> None:
    """``asgd_update`` on the fused CPU kernel (``csrc/elementwise_ops.cpp``): torch.optim's
    per-tensor ASGD, its eta and mu included, bit for bit."""
    torch.ops.distopt_kernels.asgd_(
        ops[Operand.PARAMS.value], ops[Operand.GRADS.value], ops[ASGDOperand.STEP.value],
        ops[ASGDOperand.ETA.value], ops[ASGDOperand.MU.value], ops[ASGDOperand.AX.value],
        lr, lambd, alpha, t0, weight_decay, maximize,
    )


def asgd_update(
    ops: List[List[Tensor]],
    lr: float,
    lambd: float,
    maximize: bool,
    weight_decay: float,
    alpha: float,
    t0: float,
    capturable: bool,
    lr_t: Optional[Tensor],
    native: bool = False,
) -> None:
    """One ASGD step over ``gather``'s operands ``[params, grads, step, eta, mu, ax]``: on the
    fused CPU kernel when ``native`` (``native_kernels``) and the parameters are on the CPU,
    else on foreach ops (the graph-safe form when ``capturable``; ``lr_t``: ``step_lr``'s
    Tensor lr)."""
    params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
    steps = ops[ASGDOperand.STEP.value]
    etas = ops[ASGDOperand.ETA.value]
    mus = ops[ASGDOperand.MU.value]
    axs = ops[ASGDOperand.AX.value]
    if len(params) == 0:
        return
    if native and params[0].device.type == "cpu":
        asgd_native(ops, lr, lambd, maximize, weight_decay, alpha, t0)
        return
    grads = signed(grads, maximize)
    increment_steps(steps)
    grads = decayed(params, grads, weight_decay, lr, False)
    eta0 = 0.0
    mu0 = 0.0
    # A capturable step reads no eta or mu on the host: the per-tensor form.
    uniform = not capturable
    if uniform:
        eta0 = float(etas[0].item())
        mu0 = float(mus[0].item())
        for j in range(1, len(etas)):
            if float(etas[j].item()) != eta0 or float(mus[j].item()) != mu0:
                uniform = False
    if uniform:
        # The usual case (every parameter has taken as many steps): scalar kernels, in
        # torch.optim's per-tensor order, and a plain copy while the average is the last
        # iterate (mu == 1), which halves the memory traffic of the foreach form.
        torch._foreach_mul_(params, 1.0 - lambd * eta0)
        torch._foreach_add_(params, grads, alpha=-eta0)
        if mu0 == 1.0:
            torch._foreach_copy_(axs, params)
        else:
            diff = torch._foreach_sub(params, axs)
            torch._foreach_mul_(diff, mu0)
            torch._foreach_add_(axs, diff)
    else:
        # theta - eta * (g + lambd * theta), with per-parameter eta and mu tensors.
        decayed_grads = torch._foreach_add(grads, params, alpha=lambd)
        torch._foreach_addcmul_(params, decayed_grads, etas, value=-1.0)
        diff = torch._foreach_sub(params, axs)
        torch._foreach_addcmul_(axs, diff, mus)
    if capturable:
        # The next eta = lr / (1 + lambd * lr * t) ** alpha and mu = 1 / max(1, t - t0) of
        # every parameter, computed on the device.
        t = step_counts(steps)
        eta = lr_scaled((1.0 + lr_scaled(t * lambd, lr, lr_t)).pow(alpha).reciprocal(), lr, lr_t)
        torch._foreach_copy_(etas, eta.unbind(0))
        torch._foreach_copy_(mus, (t - t0).clamp(min=1.0).reciprocal().unbind(0))
        return
    for j in range(len(steps)):
        step_t = steps[j]
        # torch.optim computes eta from the float32 step tensor, and lr / x as
        # x.reciprocal() * lr; mu from the step as a Python float.
        etas[j].copy_((step_t * (lambd * lr) + 1.0).pow(alpha).reciprocal() * lr)
        mus[j].fill_(1.0 / max(1.0, float(step_t.item()) - t0))


class FunctionalASGD:
    r"""Averaged stochastic gradient descent, taking gradients as a list.

    Same arguments, defaults, state and results as :class:`torch.optim.ASGD`. The state is
    ``step``, ``eta`` (the current step size) and ``mu`` (the averaging weight), all 0-dim
    float32 tensors as torch.optim keeps them whatever the parameter's dtype, and ``ax``
    (the average, shaped like the parameter). With gradient :math:`g_t`, weight decay
    :math:`\lambda`, decay term :math:`\lambda_d` (``lambd``), power :math:`\alpha`,
    averaging start :math:`t_0` and learning rate :math:`\gamma`:

    .. math::
        g_t &\leftarrow g_t + \lambda \theta_{t-1} \\
        \theta_t &= (1 - \lambda_d \eta_{t-1}) \theta_{t-1} - \eta_{t-1} g_t \\
        a_t &= a_{t-1} + \mu_{t-1} (\theta_t - a_{t-1}) \\
        \eta_t &= \gamma / (1 + \lambda_d \gamma t)^\alpha \\
        \mu_t &= 1 / \max(1, t - t_0)

    with :math:`\eta_0 = \gamma` and :math:`\mu_0 = 1`. torch has no fused ASGD: CPU steps
    run on this project's fused kernel where it was built (at the first import), else and
    with ``foreach=True`` or ``capturable=True`` on the foreach kernels; sparse gradients are
    rejected, as torch.optim rejects them.

    Args:
        params: the parameters to update (any iterable of Tensors, e.g.
            ``model.parameters()``), in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        lambd: decay term.
        alpha: power of the step-size decay.
        t0: step at which averaging starts.
        weight_decay: L2 penalty.
        foreach: ``True`` selects the foreach kernels.
        maximize: maximize the objective instead of minimizing it.
        differentiable: accepted for compatibility; steps never record autograd history.
        capturable: make the step graph-safe (CUDA graphs): the next eta and mu are
            computed on the parameter's device and no tensor is read on the host (without
            it, each step reads eta, mu and step there); a Tensor lr is read on the device
            too, so that a replayed graph sees changes to it. (``step``, ``eta`` and ``mu``
            live on the device either way, as torch.optim keeps them.)

    Raises:
        ValueError: for a negative lr or weight_decay.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-2,
        lambd: float = 1e-4,
        alpha: float = 0.75,
        t0: float = 1e6,
        weight_decay: float = 0.0,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        differentiable: bool = False,
        capturable: bool = False,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalASGD)
            params = check_params(params)
            check_types(FunctionalASGD, locals())
            check_lr(lr)
            check_at_least("weight_decay", weight_decay, 0.0)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.lambd = float(lambd)
        self.alpha = float(alpha)
        self.t0 = float(t0)
        self.weight_decay = float(weight_decay)
        self.foreach = optional_flag(foreach)
        self.maximize = bool(maximize)
        self.differentiable = bool(differentiable)
        self.capturable = bool(capturable)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        # torch.optim.ASGD keeps all three on the parameter's device, capturable or not.
        self.spec = state_spec(
            ['step', 'eta', 'mu', 'ax'], [0.0, 0.0, 1.0, 0.0], ["step", "eta", "mu"], True
        )
        self.native = native_kernels(foreach, self.capturable)
        self.operand_sets = no_operands()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, lambd, alpha, t0, weight_decay).

        Values are lists so that every class shares the signature (pairs take two).
        """
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        if name == "lr":
            self.lr = new_lr(self.lr_tensor, value)
        elif name == "lambd":
            self.lambd = scalar(name, value)
        elif name == "alpha":
            self.alpha = scalar(name, value)
        elif name == "t0":
            self.t0 = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        else:
            raise ValueError(
                unknown_hyperparameter(
                    "ASGD", name, ["lr", "lambd", "alpha", "t0", "weight_decay"]
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
        # A new eta starts at lr: a capturable step reads a Tensor lr on the host only for
        # those.
        lr, lr_t = step_lr(self.lr, self.lr_tensor, self.capturable, self.state, gradients)
        with torch.no_grad():
            spec = StateSpec(self.spec.keys, [0.0, lr, 1.0, 0.0], self.spec.places)
            rules = GatherRules(spec, "dense", "ASGD does not support sparse gradients", False)
            gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            for s in range(len(self.operand_sets)):
                asgd_update(
                    self.operand_sets[s], lr, self.lambd, self.maximize, self.weight_decay, self.alpha,
                    self.t0, self.capturable, lr_t, self.native,
                )
            release(self.operand_sets, self.groups)
