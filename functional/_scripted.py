"""A TorchScript module around one functional optimizer, for callers outside TorchScript.

TorchScript hands a class-typed attribute back to Python as a copy, so a scripted optimizer's
hyper-parameters and state are changed through the methods exported here, which run inside
the compiled code.
"""
from typing import Dict, List, Optional

import torch
from torch import Tensor


class ScriptedOptimizer(torch.nn.Module):
    """Holds a functional optimizer as ``self.optim`` and exports its methods.

    ``torch.jit.script(ScriptedOptimizer(optim))`` compiles the optimizer's class; the
    exported ``step`` then runs without the GIL.
    """

    def __init__(self, optim: object) -> None:
        super().__init__()
        self.optim = optim

    def forward(self, gradients: List[Optional[Tensor]]) -> None:
        self.optim.step(gradients)

    @torch.jit.export
    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None."""
        self.optim.step(gradients)

    @torch.jit.export
    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Update one parameter."""
        self.optim.step_param(param, grad)

    @torch.jit.export
    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter (lr, betas, ...) for the following steps."""
        self.optim.set_hyperparameter(name, value)

    @torch.jit.export
    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Replace the optimizer's whole state, checked first (a bad one changes nothing)."""
        self.optim.set_state(state)

    @torch.jit.export
    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """Check a state as ``set_state`` would, changing nothing (a registered class without
        ``check_state`` is not checked: the state comes back as given)."""
        if hasattr(self.optim, "check_state"):
            return self.optim.check_state(state)
        return state

    @torch.jit.export
    def get_state(self) -> Dict[int, Dict[str, Tensor]]:
        """The optimizer's state (the tensors themselves, not copies)."""
        return self.optim.state


def script_optimizer(optim: object) -> torch.jit.ScriptModule:
    """Compile a functional optimizer instance; returns a ``ScriptedOptimizer`` module.

    Args:
        optim: an instance of a functional optimizer class.

    Returns:
        The scripted module; call ``.step(gradients)`` on it.
    """
    return torch.jit.script(ScriptedOptimizer(optim))
