"""Adadelta (steps scaled by running RMS of updates over gradients), as torch.optim.Adadelta."""
import enum
from typing import Dict, List, Optional, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_at_least,
    check_in_range,
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
    descend_,
    gather,
    increment_steps,
    native_kernels,
    native_op,
    no_operands,
    release,
    signed,
)
from functional._spec import Operand, state_spec


class AdadeltaOperand(enum.Enum):
    """Positions of ``FunctionalAdadelta``'s state in an operand set (``Operand``)."""

    STEP = 2
    SQUARE_AVG = 3
    ACC_DELTA = 4


@native_op
def adadelta_native(
    ops: List[List[Tensor]], lr: float, rho: float, maximize: bool, weight_decay: float, eps: float
) -> None:
    """``adadelta_update`` on the fused CPU kernel (``csrc/elementwise_ops.cpp``)."""
    torch.ops.distopt_kernels.adadelta_(
        ops[Operand.PARAMS.value], ops[Operand.GRADS.value], ops[AdadeltaOperand.STEP.value],
        ops[AdadeltaOperand.SQUARE_AVG.value], ops[AdadeltaOperand.ACC_DELTA.value],
        lr, rho, eps, weight_decay, maximize,
    )


def adadelta_update(
    ops: List[List[Tensor]],
    lr: float,
    rho: float,
    maximize: bool,
    weight_decay: float,
    eps: float,
    lr_t: Optional[Tensor],
    native: bool = False,
) -> None:
    """One Adadelta step over ``gather``'s operands ``[params, grads, step, square_avg,
    acc_delta]``, on the fused CPU kernel when ``native`` (``native_kernels``) and the
    parameters are on the CPU, else on foreach ops.

    Nothing is read on the host: the foreach step is graph-safe as it is, and with ``lr_t``
    (``step_lr``'s Tensor lr of a capturable step) reads the lr on the device too.
    """
    params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
    steps = ops[AdadeltaOperand.STEP.value]
    square_avgs = ops[AdadeltaOperand.SQUARE_AVG.value]
    acc_deltas = ops[AdadeltaOperand.ACC_DELTA.value]
    if len(params) == 0:
        return
    if native and params[0].device.type == "cpu":
        adadelta_native(ops, lr, rho, maximize, weight_decay, eps)
        return
    increment_steps(steps)
    grads = signed(grads, maximize)
    grads = decayed(params, grads, weight_decay, lr, False)
    torch._foreach_mul_(square_avgs, rho)
    torch._foreach_addcmul_(square_avgs, grads, grads, value=1.0 - rho)
    std = torch._foreach_add(square_avgs, eps)
    torch._foreach_sqrt_(std)
    deltas = torch._foreach_add(acc_deltas, eps)
    torch._foreach_sqrt_(deltas)
    torch._foreach_div_(deltas, std)
    torch._foreach_mul_(deltas, grads)
    torch._foreach_mul_(acc_deltas, rho)
    torch._foreach_addcmul_(acc_deltas, deltas, deltas, value=1.0 - rho)
    descend_(params, deltas, lr, lr_t)


class FunctionalAdadelta:
    r"""Adadelta with weight decay, taking gradients as a list.

    Same arguments, defaults, state (``step``, ``square_avg``, ``acc_delta``) and results as
    :class:`torch.optim.Adadelta`. With gradient :math:`g_t`, weight decay :math:`\lambda`,
    decay rate :math:`\rho` and learning rate :math:`\gamma`:

    .. math::
        g_t &\leftarrow g_t + \lambda \theta_{t-1} \\
        v_t &= \rho v_{t-1} + (1 - \rho) g_t^2 \\
        \Delta_t &= \frac{\sqrt{u_{t-1} + \epsilon}}{\sqrt{v_t + \epsilon}} g_t \\
        u_t &= \rho u_{t-1} + (1 - \rho) \Delta_t^2 \\
        \theta_t &= \theta_{t-1} - \gamma \Delta_t

    torch has no fused Adadelta: CPU steps run on this project's fused kernel where it was
    built (at the first import), else and with ``foreach=True`` or ``capturable=True`` on
    the foreach kernels; sparse gradients are rejected, as torch.optim rejects them.

    Args:
        params: the parameters to update (any iterable of Tensors, e.g.
            ``model.parameters()``), in the order gradients will be given.
        lr: factor applied to each update (a float or a 1-element Tensor).
        rho: decay rate of the running averages.
        eps: term added inside the square roots for numerical stability.
        weight_decay: L2 penalty.
        foreach: ``True`` selects the foreach kernels.
        capturable: keep ``step`` on the parameter's device, and read a Tensor lr there
            (CUDA graphs: a replayed graph sees changes to it). The update reads no tensor
            on the host either way.
        maximize: maximize the objective instead of minimizing it.
        differentiable: accepted for compatibility; steps never record autograd history.

    Raises:
        ValueError: for a negative lr, eps or weight_decay, or rho outside [0, 1].
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        maximize: bool = False,
        differentiable: bool = False,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalAdadelta)
            params = check_params(params)
            check_types(FunctionalAdadelta, locals())
            check_lr(lr)
            check_in_range("rho", rho, 0.0, 1.0, False)
            check_at_least("eps", eps, 0.0)
            check_at_least("weight_decay", weight_decay, 0.0)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.rho = float(rho)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.foreach = optional_flag(foreach)
        self.capturable = bool(capturable)
        self.maximize = bool(maximize)
        self.differentiable = bool(differentiable)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.spec = state_spec(
            ['step', 'square_avg', 'acc_delta'], [0.0, 0.0, 0.0], ["step"], self.capturable
        )
        self.native = native_kernels(foreach, self.capturable)
        self.operand_sets = no_operands()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, rho, eps, weight_decay).

        Values are lists so that every class shares the signature (pairs take two).
        """
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        if name == "lr":
            self.lr = new_lr(self.lr_tensor, value)
        elif name == "rho":
            self.rho = scalar(name, value)
        elif name == "eps":
            self.eps = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        else:
            raise ValueError(
                unknown_hyperparameter("Adadelta", name, ["lr", "rho", "eps", "weight_decay"])
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
                self.spec, "dense", "Adadelta does not support sparse gradients", False
            )
            gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            for s in range(len(self.operand_sets)):
                adadelta_update(
                    self.operand_sets[s], lr, self.rho, self.maximize, self.weight_decay, self.eps, lr_t,
                    self.native,
                )
            release(self.operand_sets, self.groups)
