"""Stochastic gradient descent (optionally with momentum), as torch.optim.SGD."""
from typing import Dict, List, Optional, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_at_least,
    check_flags,
    check_lr,
    check_nesterov,
    check_params,
    check_types,
)
from functional._common import (
    optional_flag,
    checked_state,
    meta_params,
    copy_back,
    fit_fused_layouts,
    gather,
    group_by_device_dtype,
    index_of,
    lr_float,
    lr_of,
    lr_tensor,
    no_lists,
    one_gradient,
    scalar,
    unknown_hyperparameter,
    use_fused_kernel,
)


class FunctionalSGD:
    r"""SGD with momentum, dampening, Nesterov and weight decay, taking gradients as a list.

    Same arguments, defaults, state (``momentum_buffer``) and results as
    :class:`torch.optim.SGD`. With gradient :math:`g_t`, weight decay :math:`\lambda`,
    momentum :math:`\mu`, dampening :math:`\tau` and learning rate :math:`\gamma`:

    .. math::
        g_t &\leftarrow g_t + \lambda \theta_{t-1} \\
        b_t &= \begin{cases} g_t & t = 1 \\ \mu b_{t-1} + (1 - \tau) g_t & t > 1 \end{cases} \\
        g_t &\leftarrow g_t + \mu b_t \text{ (Nesterov) or } b_t \\
        \theta_t &= \theta_{t-1} - \gamma g_t

    Dense gradients run on ``torch._fused_sgd_`` (``fused=False`` selects the foreach
    kernels); sparse gradients take the per-tensor path, as torch.optim does.

    Args:
        params: the parameters to update, in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        momentum: momentum factor.
        dampening: dampening for momentum.
        weight_decay: L2 penalty.
        nesterov: use Nesterov momentum.
        maximize: maximize the objective instead of minimizing it.
        foreach: accepted for compatibility; ``foreach=True`` selects the foreach kernels.
        differentiable: accepted for compatibility; steps never record autograd history.
        fused: ``False`` selects the foreach kernels; otherwise the fused kernel is used.

    Raises:
        ValueError: for a negative lr, momentum or weight_decay, or Nesterov without
            momentum or with dampening.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        differentiable: bool = False,
        fused: Optional[bool] = None,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalSGD)
            check_params(params)
            check_types(FunctionalSGD, locals())
            check_lr(lr)
            check_at_least("momentum", momentum, 0.0)
            check_at_least("weight_decay", weight_decay, 0.0)
            check_flags("SGD", foreach, fused)
            if nesterov and (momentum <= 0.0 or dampening != 0.0):
                check_nesterov(momentum, dampening)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.momentum = float(momentum)
        self.dampening = float(dampening)
        self.weight_decay = float(weight_decay)
        self.nesterov = bool(nesterov)  # the fused kernel takes no int or None
        self.maximize = bool(maximize)
        self.foreach = optional_flag(foreach)
        self.differentiable = bool(differentiable)
        self.fused = optional_flag(fused)
        self.use_fused = use_fused_kernel(foreach, fused)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = group_by_device_dtype(params)
        self.live = no_lists()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, momentum, dampening, weight_decay).

        Values are lists so that every class shares the signature (pairs take two).
        """
        if name == "lr":
            self.lr = scalar(name, value)
            lr_tensor = self.lr_tensor
            if lr_tensor is not None:
                lr_tensor.fill_(self.lr)
        elif name == "momentum":
            self.momentum = scalar(name, value)
        elif name == "dampening":
            self.dampening = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        else:
            raise ValueError(
                unknown_hyperparameter("SGD", name, ["lr", "momentum", "dampening", "weight_decay"])
            )

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError (``checked_state``)."""
        fresh = {i: self._new_state(p) for i, p in meta_params(self.params, state)}
        # torch.optim keeps a sparse gradient's momentum buffer sparse.
        return checked_state(self.params, state, fresh, ["momentum_buffer"])

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
        """
        batches = gather(self.params, gradients, self.groups)
        lr = lr_of(self.lr, self.lr_tensor)
        with torch.no_grad():
            for idx, grads in batches:
                # Split by whether a momentum buffer exists yet: the kernels treat a
                # parameter's first momentum step differently (the buffer starts as g).
                # New buffers are laid out as their parameter (torch.optim's state layout)
                # and enter the state once the kernel has filled them.
                first_i: List[int] = []
                first_p: List[Tensor] = []
                first_g: List[Tensor] = []
                first_b: List[Tensor] = []
                later_p: List[Tensor] = []
                later_g: List[Tensor] = []
                later_b: List[Tensor] = []
                # Locals, not attributes, in the per-parameter loop: each attribute read is
                # an interpreter instruction per parameter.
                params = self.params
                state = self.state
                has_momentum = self.momentum != 0.0
                for k in range(len(idx)):
                    i = idx[k]
                    g = grads[k]
                    p = params[i]
                    if g.is_sparse:
                        self._sparse_update(i, p, g, lr)
                    elif has_momentum and i in state:
                        later_p.append(p)
                        later_g.append(g)
                        later_b.append(state[i]["momentum_buffer"])
                    else:
                        first_p.append(p)
                        first_g.append(g)
                        if has_momentum:
                            first_i.append(i)
                            first_b.append(self._new_state(p)["momentum_buffer"])
                self.live = [first_p, first_b, later_p, later_b]
                if self.use_fused:
                    self._fused_update(first_p, first_g, first_b, lr, True)
                    self._fused_update(later_p, later_g, later_b, lr, False)
                else:
                    self._foreach_update(first_p, first_g, first_b, lr, True)
                    self._foreach_update(later_p, later_g, later_b, lr, False)
                for j in range(len(first_i)):
                    state[first_i[j]] = {"momentum_buffer": first_b[j]}
            self.live = no_lists()

    def _new_state(self, p: Tensor) -> Dict[str, Tensor]:
        """A fresh state entry for ``p`` (the template ``set_state`` checks against): a
        momentum buffer laid out as ``p``, none without momentum."""
        if self.momentum != 0.0:
            return {"momentum_buffer": torch.empty_like(p)}
        return torch.jit.annotate(Dict[str, Tensor], {})

    def _fused_update(
        self, params: List[Tensor], grads: List[Tensor], bufs: List[Tensor], lr: float, first: bool
    ) -> None:
        if len(params) == 0:
            return
        staged = fit_fused_layouts(params, grads)
        torch._fused_sgd_(
            params,
            grads,
            bufs,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            lr=lr,
            dampening=self.dampening,
            nesterov=self.nesterov,
            maximize=self.maximize,
            is_first_step=first,
        )
        copy_back(staged)

    def _foreach_update(
        self, params: List[Tensor], grads: List[Tensor], bufs: List[Tensor], lr: float, first: bool
    ) -> None:
        if len(params) == 0:
            return
        if self.maximize:
            grads = torch._foreach_neg(grads)
        if self.weight_decay != 0.0:
            grads = torch._foreach_add(grads, params, alpha=self.weight_decay)
        if self.momentum != 0.0:
            if first:
                torch._foreach_copy_(bufs, grads)
            else:
                torch._foreach_mul_(bufs, self.momentum)
                torch._foreach_add_(bufs, grads, alpha=1.0 - self.dampening)
            if self.nesterov:
                grads = torch._foreach_add(grads, bufs, alpha=self.momentum)
            else:
                grads = bufs
        torch._foreach_add_(params, grads, alpha=-lr)

    def _sparse_update(self, i: int, param: Tensor, grad: Tensor, lr: float) -> None:
        # torch.optim's per-tensor rule, which is the only one that accepts sparse gradients.
        if self.maximize:
            grad = -grad
        if self.weight_decay != 0.0:
            grad = grad.add(param, alpha=self.weight_decay)
        if self.momentum != 0.0:
            if i in self.state:
                buf = self.state[i]["momentum_buffer"]
                buf.mul_(self.momentum).add_(grad, alpha=1.0 - self.dampening)
            else:
                buf = torch.clone(grad).detach()
                self.state[i] = {"momentum_buffer": buf}
            if self.nesterov:
                grad = grad.add(buf, alpha=self.momentum)
            else:
                grad = buf
        param.add_(grad, alpha=-lr)
