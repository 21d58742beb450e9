"""Rprop (sign-based steps with per-element adaptive step sizes), as torch.optim.Rprop."""
import enum
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_etas,
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
    step_lr,
    unknown_hyperparameter,
)
from functional._flat import device_dtype_groups
from functional._kernels import (
    GatherRules,
    check_spec_state,
    gather,
    increment_steps,
    native_kernels,
    native_op,
    no_operands,
    release,
)
from functional._spec import Operand, StateSpec, state_spec


class RpropOperand(enum.Enum):
    """Positions of ``FunctionalRprop``'s state in an operand set (``Operand``)."""

    STEP = 2
    PREV = 3
    STEP_SIZE = 4


@native_op
def rprop_native(
    ops: List[List[Tensor]],
    etas: Tuple[float, float],
    step_size_bounds: Tuple[float, float],
    maximize: bool,
) -> None:
    """``rprop_update`` on the fused CPU kernel (``csrc/elementwise_ops.cpp``)."""
    torch.ops.distopt_kernels.rprop_(
        ops[Operand.PARAMS.value], ops[Operand.GRADS.value], ops[RpropOperand.STEP.value],
        ops[RpropOperand.PREV.value], ops[RpropOperand.STEP_SIZE.value],
        etas[0], etas[1], step_size_bounds[0], step_size_bounds[1], maximize,
    )


def rprop_update(
    ops: List[List[Tensor]],
    etas: Tuple[float, float],
    step_size_bounds: Tuple[float, float],
    maximize: bool,
    native: bool = False,
) -> None:
    """One Rprop step over ``gather``'s operands ``[params, grads, step, prev, step_size]``,
    on the fused CPU kernel when ``native`` (``native_kernels``) and the parameters are on the
    CPU, else on foreach ops."""
    params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
    steps = ops[RpropOperand.STEP.value]
    prevs = ops[RpropOperand.PREV.value]
    step_sizes = ops[RpropOperand.STEP_SIZE.value]
    if len(params) == 0:
        return
    if native and params[0].device.type == "cpu":
        rprop_native(ops, etas, step_size_bounds, maximize)
        return
    etaminus, etaplus = etas
    step_size_min, step_size_max = step_size_bounds
    increment_steps(steps)
    signs = torch._foreach_mul(grads, prevs)
    if maximize:
        torch._foreach_neg_(signs)
    # From here on ``prevs`` holds this step's (signed, then masked) gradient.
    torch._foreach_copy_(prevs, grads)
    if maximize:
        torch._foreach_neg_(prevs)
    torch._foreach_sign_(signs)
    for sign in signs:
        sign.masked_fill_(sign.gt(0), etaplus)
        sign.masked_fill_(sign.lt(0), etaminus)
        sign.masked_fill_(sign.eq(0), 1.0)
    torch._foreach_mul_(step_sizes, signs)
    for j in range(len(step_sizes)):
        step_sizes[j].clamp_(step_size_min, step_size_max)
        prevs[j].masked_fill_(signs[j].eq(etaminus), 0.0)
    grad_signs = torch._foreach_sign(prevs)
    torch._foreach_addcmul_(params, grad_signs, step_sizes, value=-1.0)


class FunctionalRprop:
    r"""Resilient backpropagation, taking gradients as a list.

    Same arguments, defaults, state (``step``, ``prev``, ``step_size``) and results as
    :class:`torch.optim.Rprop`. Each element's step size starts at the learning rate in
    effect when the parameter first gets a gradient; later lr changes do not touch it. With
    gradient :math:`g_t`, etas :math:`(\eta^-, \eta^+)` and step-size bounds
    :math:`(\Gamma_{min}, \Gamma_{max})`:

    .. math::
        \eta_t &= \begin{cases} \eta^+ & g_t g_{t-1} > 0 \\ \eta^- & g_t g_{t-1} < 0 \\
            1 & \text{otherwise} \end{cases} \\
        \Gamma_t &= \mathrm{clamp}(\eta_t \Gamma_{t-1}, \Gamma_{min}, \Gamma_{max}) \\
        g_t &\leftarrow 0 \text{ where } \eta_t = \eta^- \\
        \theta_t &= \theta_{t-1} - \mathrm{sign}(g_t) \Gamma_t

    and :math:`g_t` (after zeroing) is kept as ``prev``. torch has no fused Rprop: CPU steps
    run on this project's fused kernel where it was built (at the first import), else and
    with ``foreach=True`` or ``capturable=True`` on the foreach kernels; sparse gradients are
    rejected, as torch.optim rejects them.

    Args:
        params: the parameters to update (any iterable of Tensors, e.g.
            ``model.parameters()``), in the order gradients will be given.
        lr: initial step size (a float or a 1-element Tensor).
        etas: multiplicative decrease and increase factors ``(etaminus, etaplus)``.
        step_sizes: minimal and maximal step size.
        capturable: keep ``step`` on the parameter's device (CUDA graphs). The update reads
            no tensor on the host either way; a Tensor lr is read on the host only by a step
            that gives a parameter its first state (whose step size starts at lr, as in
            torch.optim), not at every step.
        foreach: ``True`` selects the foreach kernels.
        maximize: maximize the objective instead of minimizing it.
        differentiable: accepted for compatibility; steps never record autograd history.

    Raises:
        ValueError: for a negative lr, or etas not satisfying ``0 < etaminus < 1 < etaplus``.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-2,
        etas: Tuple[float, float] = (0.5, 1.2),
        step_sizes: Tuple[float, float] = (1e-6, 50.0),
        capturable: bool = False,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        differentiable: bool = False,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalRprop)
            params = check_params(params)
            check_types(FunctionalRprop, locals())
            check_lr(lr)
            check_etas(etas)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.etas = (float(etas[0]), float(etas[1]))
        self.step_sizes = (float(step_sizes[0]), float(step_sizes[1]))
        self.capturable = bool(capturable)
        self.foreach = optional_flag(foreach)
        self.maximize = bool(maximize)
        self.differentiable = bool(differentiable)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.spec = state_spec(
            ['step', 'prev', 'step_size'], [0.0, 0.0, 0.0], ["step"], self.capturable
        )
        self.native = native_kernels(foreach, self.capturable)
        self.operand_sets = no_operands()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, etas, step_sizes).

        Values are lists so that every class shares the signature (pairs take two). A new lr
        only sets the first step size of parameters that have no state yet.
        """
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        if name == "lr":
            self.lr = new_lr(self.lr_tensor, value)
        elif name == "etas":
            etas = pair(name, value)
            self.etas = (etas[0], etas[1])
        elif name == "step_sizes":
            step_sizes = pair(name, value)
            self.step_sizes = (step_sizes[0], step_sizes[1])
        else:
            raise ValueError(unknown_hyperparameter("Rprop", name, ["lr", "etas", "step_sizes"]))

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
        # lr only starts new step sizes: a capturable step reads a Tensor lr only for those.
        lr, _ = step_lr(self.lr, self.lr_tensor, self.capturable, self.state, gradients)
        with torch.no_grad():
            spec = StateSpec(self.spec.keys, [0.0, 0.0, lr], self.spec.places)
            rules = GatherRules(spec, "dense", "Rprop does not support sparse gradients", False)
            gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            for s in range(len(self.operand_sets)):
                rprop_update(self.operand_sets[s], self.etas, self.step_sizes, self.maximize, self.native)
            release(self.operand_sets, self.groups)
