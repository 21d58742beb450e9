"""RMSprop (steps divided by a running RMS of gradients), as torch.optim.RMSprop."""
from typing import Dict, List, Optional, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import check_at_least, check_lr, check_params, check_types
from functional._common import (
    optional_flag,
    checked_state,
    meta_params,
    increment_steps,
    check_gradients,
    new_step,
    fresh_zeros_like,
    group_by_device_dtype,
    index_of,
    lr_float,
    lr_of,
    lr_tensor,
    no_lists,
    one_gradient,
    scalar,
    unknown_hyperparameter,
)


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

    Every step runs on the foreach kernels (torch has no fused RMSprop); sparse gradients
    are rejected, as torch.optim rejects them.

    Args:
        params: the parameters to update, in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        alpha: smoothing constant of the squared-gradient average.
        eps: term added to the denominator for numerical stability.
        weight_decay: L2 penalty.
        momentum: momentum factor.
        centered: normalize by an estimate of the gradient's variance instead of its second
            moment.
        capturable: accepted for compatibility (CUDA-graph capture has no CPU meaning).
        foreach: accepted for compatibility; the foreach kernels are always used.
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
            check_params(params)
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
        self.groups = group_by_device_dtype(params)
        self.live = no_lists()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, alpha, eps, weight_decay, momentum).

        Values are lists so that every class shares the signature (pairs take two). Turning
        momentum on later gives each parameter a zero ``momentum_buffer`` at its next step.
        """
        if name == "lr":
            self.lr = scalar(name, value)
            lr_tensor = self.lr_tensor
            if lr_tensor is not None:
                lr_tensor.fill_(self.lr)
        elif name == "alpha":
            self.alpha = scalar(name, value)
        elif name == "eps":
            self.eps = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        elif name == "momentum":
            self.momentum = scalar(name, value)
        else:
            raise ValueError(
                unknown_hyperparameter(
                    "RMSprop", name, ["lr", "alpha", "eps", "weight_decay", "momentum"]
                )
            )

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError (``checked_state``)."""
        fresh = {i: self._new_state(p) for i, p in meta_params(self.params, state)}
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
                params: List[Tensor] = []
                grads: List[Tensor] = []
                square_avgs: List[Tensor] = []
                grad_avgs: List[Tensor] = []
                bufs: List[Tensor] = []
                steps: List[Tensor] = []
                for i in group:
                    g = gradients[i]
                    if g is not None:
                        if g.is_sparse:
                            raise RuntimeError("RMSprop does not support sparse gradients")
                        self._init_state(i)
                        state = self.state[i]
                        params.append(self.params[i])
                        grads.append(g)
                        square_avgs.append(state["square_avg"])
                        steps.append(state["step"])
                        if self.momentum > 0.0:
                            bufs.append(state["momentum_buffer"])
                        if self.centered:
                            grad_avgs.append(state["grad_avg"])
                self.live = [params, square_avgs, grad_avgs, bufs, steps]
                self._foreach_update(params, grads, square_avgs, grad_avgs, bufs, steps, lr)
            self.live = no_lists()

    def _init_state(self, i: int) -> None:
        # Creates whatever parameter i's state lacks under the current options (all of it
        # on its first gradient), so that momentum or centering switched on later works.
        p = self.params[i]
        if i not in self.state:
            self.state[i] = self._new_state(p)
        state = self.state[i]
        if self.momentum > 0.0 and "momentum_buffer" not in state:
            state["momentum_buffer"] = fresh_zeros_like(p)
        if self.centered and "grad_avg" not in state:
            state["grad_avg"] = fresh_zeros_like(p)

    def _new_state(self, p: Tensor) -> Dict[str, Tensor]:
        """The state every parameter has (also the template ``set_state`` checks against);
        ``_init_state`` adds the momentum buffer and gradient average as the options ask, so a
        state without them is complete (one with them must have them shaped like ``p``)."""
        return {"step": new_step(), "square_avg": fresh_zeros_like(p)}

    def _foreach_update(
        self,
        params: List[Tensor],
        grads: List[Tensor],
        square_avgs: List[Tensor],
        grad_avgs: List[Tensor],
        bufs: List[Tensor],
        steps: List[Tensor],
        lr: float,
    ) -> None:
        if len(params) == 0:
            return
        alpha = self.alpha
        if self.maximize:
            grads = torch._foreach_neg(grads)
        increment_steps(steps)
        if self.weight_decay != 0.0:
            grads = torch._foreach_add(grads, params, alpha=self.weight_decay)
        torch._foreach_mul_(square_avgs, alpha)
        torch._foreach_addcmul_(square_avgs, grads, grads, value=1.0 - alpha)
        if self.centered:
            torch._foreach_lerp_(grad_avgs, grads, 1.0 - alpha)
            avg = torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, value=-1.0)
            torch._foreach_sqrt_(avg)
        else:
            avg = torch._foreach_sqrt(square_avgs)
        torch._foreach_add_(avg, self.eps)
        if self.momentum > 0.0:
            torch._foreach_mul_(bufs, self.momentum)
            torch._foreach_addcdiv_(bufs, grads, avg)
            torch._foreach_add_(params, bufs, alpha=-lr)
        else:
            torch._foreach_addcdiv_(params, grads, avg, value=-lr)
