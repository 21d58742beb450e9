"""Adagrad (per-coordinate step sizes from summed squared gradients), as torch.optim.Adagrad."""
from typing import Dict, List, Optional, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_at_least,
    check_flags,
    check_fused,
    check_lr,
    check_params,
    check_types,
)
from functional._common import (
    optional_flag,
    checked_state,
    meta_params,
    copy_back,
    fit_fused_layouts,
    increment_steps,
    check_gradients,
    new_step,
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


class FunctionalAdagrad:
    r"""Adagrad with learning-rate decay and weight decay, taking gradients as a list.

    Same arguments, defaults, state (``step``, ``sum``) and results as
    :class:`torch.optim.Adagrad`. As there, every parameter's state exists from construction,
    ``sum`` starting at ``initial_accumulator_value``. With gradient :math:`g_t`, weight decay
    :math:`\lambda`, learning-rate decay :math:`\eta` and learning rate :math:`\gamma`:

    .. math::
        g_t &\leftarrow g_t + \lambda \theta_{t-1} \\
        \tilde\gamma_t &= \gamma / (1 + (t - 1) \eta) \\
        s_t &= s_{t-1} + g_t^2 \\
        \theta_t &= \theta_{t-1} - \tilde\gamma_t \, g_t / (\sqrt{s_t} + \epsilon)

    Dense gradients run on ``torch._fused_adagrad_`` (``fused=False`` or ``foreach=True``
    selects the foreach kernels); sparse gradients take the per-tensor path, as torch.optim
    does, and only the rows they hold change.

    Args:
        params: the parameters to update, in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        lr_decay: learning-rate decay per step.
        weight_decay: L2 penalty (not allowed with sparse gradients).
        initial_accumulator_value: starting value of every ``sum`` element.
        eps: term added to the denominator for numerical stability.
        foreach: ``True`` selects the foreach kernels.
        maximize: maximize the objective instead of minimizing it.
        differentiable: accepted for compatibility; steps never record autograd history.
        fused: ``False`` selects the foreach kernels; otherwise the fused kernel is used.

    Raises:
        ValueError: for a negative lr, lr_decay, weight_decay, initial_accumulator_value or
            eps.
        RuntimeError: for ``foreach=True`` with ``fused=True``, or ``fused=True`` with
            ``differentiable=True`` or non-floating-point parameters; at a step, for a sparse
            gradient with weight decay.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalAdagrad)
            check_params(params)
            check_types(FunctionalAdagrad, locals())
            check_lr(lr)
            check_at_least("lr_decay", lr_decay, 0.0)
            check_at_least("weight_decay", weight_decay, 0.0)
            check_at_least("initial_accumulator_value", initial_accumulator_value, 0.0)
            check_at_least("eps", eps, 0.0)
            check_fused(params, fused, differentiable)
            check_flags(foreach, fused)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.lr_decay = float(lr_decay)
        self.weight_decay = float(weight_decay)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.eps = float(eps)
        self.foreach = optional_flag(foreach)
        self.maximize = bool(maximize)  # the fused kernel takes no int or None
        self.differentiable = bool(differentiable)
        self.fused = optional_flag(fused)
        self.use_fused = use_fused_kernel(foreach, fused)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = group_by_device_dtype(params)
        self.live = no_lists()
        # torch.optim.Adagrad creates every parameter's state in its constructor.
        for i in range(len(params)):
            self._init_state(i)

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, lr_decay, weight_decay, eps).

        Values are lists so that every class shares the signature (pairs take two).
        """
        if name == "lr":
            self.lr = scalar(name, value)
            lr_tensor = self.lr_tensor
            if lr_tensor is not None:
                lr_tensor.fill_(self.lr)
        elif name == "lr_decay":
            self.lr_decay = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        elif name == "eps":
            self.eps = scalar(name, value)
        else:
            raise ValueError(
                unknown_hyperparameter("Adagrad", name, ["lr", "lr_decay", "weight_decay", "eps"])
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
            RuntimeError: for a sparse gradient while weight_decay is not 0.
        """
        check_gradients(self.params, gradients)
        lr = lr_of(self.lr, self.lr_tensor)
        with torch.no_grad():
            for group in self.groups:
                params: List[Tensor] = []
                grads: List[Tensor] = []
                sums: List[Tensor] = []
                steps: List[Tensor] = []
                for i in group:
                    g = gradients[i]
                    if g is not None:
                        if i not in self.state:
                            self._init_state(i)
                        p = self.params[i]
                        if g.is_sparse:
                            self._sparse_update(i, p, g, lr)
                        else:
                            params.append(p)
                            grads.append(g)
                            sums.append(self.state[i]["sum"])
                            steps.append(self.state[i]["step"])
                self.live = [params, sums, steps]
                if self.use_fused:
                    self._fused_update(params, grads, sums, steps, lr)
                else:
                    self._foreach_update(params, grads, sums, steps, lr)
            self.live = no_lists()

    def _init_state(self, i: int) -> None:
        self.state[i] = self._new_state(self.params[i])

    def _new_state(self, p: Tensor) -> Dict[str, Tensor]:
        """A fresh state entry for ``p`` (also the template ``set_state`` checks against)."""
        return {
            "step": new_step(),
            "sum": torch.full_like(p, self.initial_accumulator_value),
        }

    def _fused_update(
        self,
        params: List[Tensor],
        grads: List[Tensor],
        sums: List[Tensor],
        steps: List[Tensor],
        lr: float,
    ) -> None:
        if len(params) == 0:
            return
        staged = fit_fused_layouts(params, grads)
        # The kernel reads the already-incremented step, as in torch.optim's fused path.
        increment_steps(steps)
        torch._fused_adagrad_(
            params,
            grads,
            sums,
            steps,
            lr=lr,
            lr_decay=self.lr_decay,
            weight_decay=self.weight_decay,
            eps=self.eps,
            maximize=self.maximize,
        )
        copy_back(staged)

    def _foreach_update(
        self,
        params: List[Tensor],
        grads: List[Tensor],
        sums: List[Tensor],
        steps: List[Tensor],
        lr: float,
    ) -> None:
        if len(params) == 0:
            return
        if self.maximize:
            grads = torch._foreach_neg(grads)
        increment_steps(steps)
        if self.weight_decay != 0.0:
            grads = torch._foreach_add(grads, params, alpha=self.weight_decay)
        # Foreach ScalarList overloads take TorchScript's `number`, not List[float].
        minus_clr: List[Union[int, float, complex]] = []
        for step_t in steps:
            minus_clr.append(-lr / (1.0 + (float(step_t.item()) - 1.0) * self.lr_decay))
        torch._foreach_addcmul_(sums, grads, grads, value=1.0)
        std = torch._foreach_sqrt(sums)
        torch._foreach_add_(std, self.eps)
        numerator = torch._foreach_mul(grads, minus_clr)
        torch._foreach_addcdiv_(params, numerator, std)

    def _sparse_update(self, i: int, param: Tensor, grad: Tensor, lr: float) -> None:
        # torch.optim's per-tensor rule, the only one that accepts sparse gradients: the
        # update is non-linear, so repeated indices are summed (coalesced) first.
        state = self.state[i]
        step_t = state["step"]
        state_sum = state["sum"]
        step_t.add_(1.0)
        if self.maximize:
            grad = -grad
        if self.weight_decay != 0.0:
            raise RuntimeError("weight_decay option is not compatible with sparse gradients")
        clr = lr / (1.0 + (float(step_t.item()) - 1.0) * self.lr_decay)
        grad = grad.coalesce()
        indices = grad._indices()
        values = grad._values()
        state_sum.add_(torch.sparse_coo_tensor(indices, values.pow(2), grad.size()))
        std = state_sum.sparse_mask(grad)
        std_values = std._values().sqrt_().add_(self.eps)
        param.add_(torch.sparse_coo_tensor(indices, values / std_values, grad.size()), alpha=-clr)
