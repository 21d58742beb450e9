"""Averaged SGD (SGD with decaying steps and a running parameter average), as torch.optim.ASGD."""
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

    with :math:`\eta_0 = \gamma` and :math:`\mu_0 = 1`. Every step runs on the foreach
    kernels (torch has no fused ASGD); sparse gradients are rejected, as torch.optim rejects
    them.

    Args:
        params: the parameters to update, in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        lambd: decay term.
        alpha: power of the step-size decay.
        t0: step at which averaging starts.
        weight_decay: L2 penalty.
        foreach: accepted for compatibility; the foreach kernels are always used.
        maximize: maximize the objective instead of minimizing it.
        differentiable: accepted for compatibility; steps never record autograd history.
        capturable: accepted for compatibility (CUDA-graph capture has no CPU meaning).

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
            check_params(params)
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
        self.groups = group_by_device_dtype(params)
        self.live = no_lists()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, lambd, alpha, t0, weight_decay).

        Values are lists so that every class shares the signature (pairs take two).
        """
        if name == "lr":
            self.lr = scalar(name, value)
            lr_tensor = self.lr_tensor
            if lr_tensor is not None:
                lr_tensor.fill_(self.lr)
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
        fresh = {i: self._new_state(p, self.lr) for i, p in meta_params(self.params, state)}
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
                axs: List[Tensor] = []
                mus: List[Tensor] = []
                etas: List[Tensor] = []
                steps: List[Tensor] = []
                for i in group:
                    g = gradients[i]
                    if g is not None:
                        if g.is_sparse:
                            raise RuntimeError("ASGD does not support sparse gradients")
                        if i not in self.state:
                            self._init_state(i, lr)
                        state = self.state[i]
                        params.append(self.params[i])
                        grads.append(g)
                        axs.append(state["ax"])
                        mus.append(state["mu"])
                        etas.append(state["eta"])
                        steps.append(state["step"])
                self.live = [params, axs, mus, etas, steps]
                self._foreach_update(params, grads, axs, mus, etas, steps, lr)
            self.live = no_lists()

    def _init_state(self, i: int, lr: float) -> None:
        self.state[i] = self._new_state(self.params[i], lr)

    def _new_state(self, p: Tensor, lr: float) -> Dict[str, Tensor]:
        """A fresh state entry for ``p`` (also the template ``set_state`` checks against)."""
        return {
            "step": new_step(),
            "eta": torch.full((), lr, dtype=torch.float32, device=p.device),
            "mu": torch.ones((), dtype=torch.float32, device=p.device),
            "ax": fresh_zeros_like(p),
        }

    def _foreach_update(
        self,
        params: List[Tensor],
        grads: List[Tensor],
        axs: List[Tensor],
        mus: List[Tensor],
        etas: List[Tensor],
        steps: List[Tensor],
        lr: float,
    ) -> None:
        if len(params) == 0:
            return
        lambd = self.lambd
        if self.maximize:
            grads = torch._foreach_neg(grads)
        increment_steps(steps)
        if self.weight_decay != 0.0:
            grads = torch._foreach_add(grads, params, alpha=self.weight_decay)
        eta0 = float(etas[0].item())
        mu0 = float(mus[0].item())
        uniform = True
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
            decayed = torch._foreach_add(grads, params, alpha=lambd)
            torch._foreach_addcmul_(params, decayed, etas, value=-1.0)
            diff = torch._foreach_sub(params, axs)
            torch._foreach_addcmul_(axs, diff, mus)
        for j in range(len(steps)):
            step_t = steps[j]
            # torch.optim computes eta from the float32 step tensor, and lr / x as
            # x.reciprocal() * lr; mu from the step as a Python float.
            etas[j].copy_((step_t * (lambd * lr) + 1.0).pow(self.alpha).reciprocal() * lr)
            mus[j].fill_(1.0 / max(1.0, float(step_t.item()) - self.t0))
