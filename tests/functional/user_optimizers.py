"""Users' own optimizers for the registry tests (TorchScript needs them in a real file)."""
from typing import Dict, List, Optional

import torch
from torch import Tensor


class SignSGD(torch.optim.Optimizer):
    """A user's torch.optim-style optimizer: p -= lr * sign(g)."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])


class FunctionalSignSGD:
    """Its functional twin: compiles with TorchScript."""

    def __init__(self, params: List[Tensor], lr: float = 0.01) -> None:
        self.params = params
        self.lr = lr
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        with torch.no_grad():
            for i in range(len(self.params)):
                g = gradients[i]
                if g is not None:
                    self.params[i].add_(torch.sign(g), alpha=-self.lr)

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        for i in range(len(self.params)):
            if self.params[i] is param and grad is not None:
                with torch.no_grad():
                    param.add_(torch.sign(grad), alpha=-self.lr)

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        if name != "lr":
            raise ValueError(f"Invalid hyper-parameter name for SignSGD: '{name}'")
        self.lr = value[0]

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        self.state = state


class NotScriptable:
    """Has every method, but uses Python TorchScript cannot compile."""

    def __init__(self, params: List[Tensor], lr: float = 0.01) -> None:
        self.params = params
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        print(*[g for g in gradients], sep=", ")  # star-args: not TorchScript

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        pass

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        pass

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        self.state = state
