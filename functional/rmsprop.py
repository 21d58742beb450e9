"""RMSprop (steps divided by a running RMS of gradients), as torch.optim.RMSprop."""
import enum
from typing import Dict, List, Optional, Tuple, Union

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
    descend_,
    gather,
    increment_steps,
    native_kernels,
    native_op,
    no_operands,
    release,
    signed,
)
from functional._spec import Operand, StateSpec, state_spec


def rmsprop_keys(momentum: float, centered: bool) -> List[str]:
    """RMSprop's state keys under these options, in torch.optim's order."""
    keys = ["step", "square_avg"]
    if momentum > 0.0:
        keys.append("momentum_buffer")
    if centered:
        keys.append("grad_avg")
    return keys


def rmsprop_spec(momentum: float, centered: bool, capturable: bool) -> StateSpec:
    """RMSprop's state under these options: zeros, ``step`` on the device when
    ``capturable``."""
    keys = rmsprop_keys(momentum, centered)
    return state_spec(keys, [0.0 for _ in keys], ["step"], capturable)


class RMSpropOperand(enum.Enum):
    """Positions of ``FunctionalRMSprop``'s state in an operand set (``Operand``;
    ``rmsprop_keys``). ``momentum_buffer`` and ``grad_avg`` are there only where the options
    ask for them, so ``grad_avg`` is read as the last set (``rmsprop_buffers``)."""

    STEP = 2
    SQUARE_AVG = 3
    MOMENTUM_BUFFER = 4


def rmsprop_buffers(
    ops: List[List[Tensor]], momentum: float, centered: bool
) -> Tuple[List[Tensor], List[Tensor]]:
    """An operand set's momentum buffers and grad_avgs, each empty where the options keep
    none."""
    params = ops[Operand.PARAMS.value]
    bufs = ops[RMSpropOperand.MOMENTUM_BUFFER.value] if momentum > 0.0 else params[:0]
    grad_avgs = ops[len(ops) - 1] if centered else params[:0]
    return bufs, grad_avgs


@native_op
def rmsprop_native(
    ops: List[List[Tensor]],
    lr: float,
    alpha: float,
    maximize: bool,
    weight_decay: float,
    centered: bool,
    eps: float,
    momentum: float,
) -> None:
    """``rmsprop_update`` on the fused CPU kernel (``csrc/elementwise_ops.cpp``)."""
    bufs, grad_avgs = rmsprop_buffers(ops, momentum, centered)
    torch.ops.distopt_kernels.rmsprop_(
        ops[Operand.PARAMS.value], ops[Operand.GRADS.value], ops[RMSpropOperand.STEP.value],
        ops[RMSpropOperand.SQUARE_AVG.value], bufs, grad_avgs, lr, alpha, eps, weight_decay,
        momentum, centered, maximize,
    )


def rmsprop_update(
    ops: List[List[Tensor]],
    lr: float,
    alpha: float,
    maximize: bool,
    weight_decay: float,
    centered: bool,
    eps: float,
    momentum: float,
    lr_t: Optional[Tensor],
    native: bool = False,
) -> None:
    """One RMSprop step over ``gather``'s operands ``[params, grads, steps, square_avgs,
    (momentum_buffers with momentum), (grad_avgs when centered)]`` (``rmsprop_keys``), on the
    fused CPU kernel when ``native`` (``native_kernels``) and the parameters are on the CPU,
    else on foreach ops.

    Nothing is read on the host: the foreach step is graph-safe as it is, and with ``lr_t``
    (``step_lr``'s Tensor lr of a capturable step) reads the lr on the device too.
    """
    params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
    steps = ops[RMSpropOperand.STEP.value]
    square_avgs = ops[RMSpropOperand.SQUARE_AVG.value]
    bufs, grad_avgs = rmsprop_buffers(ops, momentum, centered)
    if len(params) == 0:
        return
    if native and params[0].device.type == "cpu":
        rmsprop_native(ops, lr, alpha, maximize, weight_decay, centered, eps, momentum)
        return
    grads = signed(grads, maximize)
    increment_steps(steps)
    grads = decayed(params, grads, weight_decay, lr, False)
    torch._foreach_mul_(square_avgs, alpha)
    torch._foreach_addcmul_(square_avgs, grads, grads, value=1.0 - alpha)
    if centered:
        torch._foreach_lerp_(grad_avgs, grads, 1.0 - alpha)
        avg = torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, value=-1.0)
        torch._foreach_sqrt_(avg)
    else:
        avg = torch._foreach_sqrt(square_avgs)
    torch._foreach_add_(avg, eps)
    if momentum > 0.0:
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_addcdiv_(bufs, grads, avg)
        descend_(params, bufs, lr, lr_t)
    elif lr_t is None:
        torch._foreach_addcdiv_(params, grads, avg, value=-lr)
    else:
        torch._foreach_div_(avg, lr_t)
        torch._foreach_addcdiv_(params, grads, avg, value=-1.0)


class FunctionalRMSprop:
    r"""RMSprop with momentum, centering and weight decay, taking gradients as a list.

    Same arguments, defaults, state (``step``, ``square_avg``, plus ``momentum_buffer`` when
    momentum > 0 and ``grad_avg`` when centered) and results as :class:`torch.optim.RMSprop`.
    With gradient :math:`g_t`, weight decay :math:`\lambda`, smoothing constant
    :math:`\alpha`, momentum :math:`\mu` and learning rate :math:`\gamma`:

    .. math::
        g_t &\leftarrow g_t + \lambda \theta_{t-1} \\
        v_t &= \alpha v_{t-1} + (1 - \alpha) g_t^2 \\
        \bar g_t &= \alpha \bar g_{t-1} + (1 - \alpha) g_t \\
        \tilde v_t &= v_t - \bar g_t^2 \text{ (centered) or } v_t \\
        b_t &= \mu b_{t-1} + g_t / (\sqrt{\tilde v_t} + \epsilon) \\
        \theta_t &= \theta_{t-1} - \gamma b_t

    (without momentum, :math:`\mu = 0` and no buffer is kept).

    torch has no fused RMSprop: CPU steps run on this project's fused kernel where it was
    built (at the first import), else and with ``foreach=True`` or ``capturable=True`` on
    the foreach kernels; sparse gradients are rejected, as torch.optim rejects them.

    Args:
        params: the parameters to update (any iterable of Tensors, e.g.
            ``model.parameters()``), in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        alpha: smoothing constant of the squared-gradient average.
        eps: term added to the denominator for numerical stability.
        weight_decay: L2 penalty.
        momentum: momentum factor.
        centered: normalize by an estimate of the gradient's variance instead of its second
            moment.
        capturable: keep ``step`` on the parameter's device, and read a Tensor lr there
            (CUDA graphs: a replayed graph sees changes to it). The update reads no tensor
            on the host either way.
        foreach: ``True`` selects the foreach kernels.
        maximize: maximize the objective instead of minimizing it.
        differentiable: accepted for compatibility; steps never record autograd history.

    Raises:
        ValueError: for a negative lr, eps, momentum, weight_decay or alpha.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        capturable: bool = False,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        differentiable: bool = False,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalRMSprop)
            params = check_params(params)
            check_types(FunctionalRMSprop, locals())
            check_lr(lr)
            check_at_least("eps", eps, 0.0)
            check_at_least("momentum", momentum, 0.0)
            check_at_least("weight_decay", weight_decay, 0.0)
            check_at_least("alpha", alpha, 0.0)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.momentum = float(momentum)
        self.centered = bool(centered)
        self.capturable = bool(capturable)
        self.foreach = optional_flag(foreach)
        self.maximize = bool(maximize)
        self.differentiable = bool(differentiable)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.spec = rmsprop_spec(self.momentum, self.centered, self.capturable)
        self.native = native_kernels(foreach, self.capturable)
        self.operand_sets = no_operands()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, alpha, eps, weight_decay, momentum).

        Values are lists so that every class shares the signature (pairs take two). Turning
        momentum on later gives each parameter with state a zero ``momentum_buffer``.
        """
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        if name == "lr":
            self.lr = new_lr(self.lr_tensor, value)
        elif name == "alpha":
            self.alpha = scalar(name, value)
        elif name == "eps":
            self.eps = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        elif name == "momentum":
            self.momentum = scalar(name, value)
            self.spec = rmsprop_spec(self.momentum, self.centered, self.capturable)
            self._complete_state()
        else:
            raise ValueError(
                unknown_hyperparameter(
                    "RMSprop", name, ["lr", "alpha", "eps", "weight_decay", "momentum"]
                )
            )

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError (``checked_state``)."""
        # A state without momentum_buffer / grad_avg is complete (set_state adds what the
        # options ask for); one with them must have them shaped like the parameter.
        spec = self.spec
        return check_spec_state(
            self.params, state, StateSpec(spec.keys[:2], spec.fills[:2], spec.places[:2])
        )

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Replace the whole state, checked first (``check_state``): a bad one changes nothing."""
        self.state = self.check_state(state)
        self._complete_state()

    def _complete_state(self) -> None:
        """Give every entry the buffers the current options need (zeros), so that turning
        momentum on, or loading a state saved without it, needs no check in ``step``."""
        for i, entry in self.state.items():
            for key in self.spec.keys:
                if key not in entry:
                    entry[key] = torch.zeros_like(self.params[i], memory_format=torch.preserve_format)

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
                self.spec, "dense", "RMSprop does not support sparse gradients", False
            )
            gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            for s in range(len(self.operand_sets)):
                rmsprop_update(
                    self.operand_sets[s], lr, self.alpha, self.maximize, self.weight_decay,
                    self.centered, self.eps, self.momentum, lr_t, self.native,
                )
            release(self.operand_sets, self.groups)
