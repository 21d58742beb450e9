"""A user's own optimizer, Lion, as a torch.optim class and as its functional stand-in.

Lives in its own module because TorchScript compiles a class from its source file, and RPC
workers unpickle the functional class by its qualified name: both need a real, importable
module (``examples/custom_optimizer.py`` puts this folder on every worker's path).

Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"):

.. math::
    c_t &= \\beta_1 m_{t-1} + (1 - \\beta_1) g_t \\\\
    \\theta_t &= \\theta_{t-1} (1 - \\gamma \\lambda) - \\gamma \\operatorname{sign}(c_t) \\\\
    m_t &= \\beta_2 m_{t-1} + (1 - \\beta_2) g_t
"""
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor


def _check(lr: float, beta1: float, beta2: float, weight_decay: float) -> None:
    # Called in eager mode only (FunctionalLion skips it when scripted), so !r is fine here.
    if not lr >= 0.0:
        raise ValueError(f"Invalid lr: {lr!r} (expected >= 0)")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid {name}: {beta!r} (expected 0 <= {name} < 1)")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay: {weight_decay!r} (expected >= 0)")


class Lion(torch.optim.Optimizer):
    """Lion as a torch.optim class, reading ``.grad``; its state key is ``exp_avg``.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: interpolation factor of the update, and decay of the moving average.
        weight_decay: decoupled weight decay.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: Tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        _check(lr, betas[0], betas[1], weight_decay)
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                _lion_update(p, p.grad, state["exp_avg"], group["lr"], beta1, beta2,
                             group["weight_decay"])
        return loss


def _lion_update(
    p: Tensor, g: Tensor, m: Tensor, lr: float, beta1: float, beta2: float, weight_decay: float
) -> None:
    """One Lion update of ``p`` and its moving average ``m``, in place (shared by both classes)."""
    if weight_decay != 0.0:
        p.mul_(1.0 - lr * weight_decay)
    update = m.mul(beta1).add_(g, alpha=1.0 - beta1)
    p.add_(torch.sign(update), alpha=-lr)
    m.mul_(beta2).add_(g, alpha=1.0 - beta2)


class FunctionalLion:
    """Lion for distopt: gradients as a list, TorchScript-compilable, torch.optim's state keys.

    Args:
        params: the parameters, in the order their gradients will be given.
        lr: learning rate.
        betas: interpolation factor of the update, and decay of the moving average.
        weight_decay: decoupled weight decay.

    Raises:
        ValueError: for a negative lr or weight_decay, or a beta outside [0, 1).
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-4,
        betas: Tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if not torch.jit.is_scripting():
            _check(lr, betas[0], betas[1], weight_decay)
        self.params = params
        # torch.optim's group keys as attributes: distopt reads them back for param_groups.
        self.lr = lr
        self.betas = betas
        self.weight_decay = weight_decay
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})

    def _exp_avg(self, i: int) -> Tensor:
        # The one place state is created, for step and step_param alike.
        if i not in self.state:
            self.state[i] = {"exp_avg": torch.zeros_like(self.params[i])}
        return self.state[i]["exp_avg"]

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None."""
        if len(gradients) != len(self.params):
            raise ValueError(
                f"Invalid gradients: {len(gradients)} given (expected {len(self.params)})"
            )
        with torch.no_grad():
            for i in range(len(self.params)):
                g = gradients[i]
                if g is not None:
                    _lion_update(self.params[i], g, self._exp_avg(i), self.lr, self.betas[0],
                                 self.betas[1], self.weight_decay)

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Update one parameter (found by identity) with ``grad``; None leaves it as it is."""
        if grad is None:
            return
        for i in range(len(self.params)):
            if self.params[i] is param:
                with torch.no_grad():
                    _lion_update(param, grad, self._exp_avg(i), self.lr, self.betas[0],
                                 self.betas[1], self.weight_decay)
                return
        raise ValueError("Invalid param: not one of this optimizer's parameters")

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change ``lr``, ``betas`` (two values) or ``weight_decay`` between steps."""
        if name == "lr":
            self.lr = value[0]
        elif name == "betas":
            self.betas = (value[0], value[1])
        elif name == "weight_decay":
            self.weight_decay = value[0]
        else:
            raise ValueError(
                f"Invalid hyper-parameter name for Lion: '{name}' "
                f"(expected lr, betas or weight_decay)"
            )

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Replace the state (``{index: {"exp_avg": Tensor}}``), e.g. from a checkpoint."""
        self.state = state
