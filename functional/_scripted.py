"""A TorchScript module around one functional optimizer, for callers outside TorchScript.

TorchScript hands a class-typed attribute back to Python as a copy, so a scripted optimizer's
hyper-parameters and state are changed through the methods exported here, which run inside
the compiled code.
"""
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from functional._compile import script
from functional._validation import hyperparameter_argument


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
        """Change a hyper-parameter (lr, betas, ...) for the following steps: ``value`` is a
        list (``[1e-4]``, ``[0.9, 0.999]``); from ``script_optimizer``, a float alone too."""
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

    Its ``set_hyperparameter`` takes a float alone as well as a list, as the eager
    optimizer's does (``set_hyperparameter("lr", 1e-4)``).

    Args:
        optim: an instance of a functional optimizer class.

    Returns:
        The scripted module; call ``.step(gradients)`` on it.
    """
    module = script(ScriptedOptimizer(optim))
    # The compiled method takes List[float] only, and TorchScript's Union[float, List[float]]
    # would refuse an int and a list of ints: called from Python, the module converts first.
    # The compiled method stays what TorchScript callers and torch.jit.save see.
    compiled = module.set_hyperparameter

    def set_hyperparameter(name: str, value: Any) -> None:
        compiled(name, hyperparameter_argument(name, value))

    set_hyperparameter.__doc__ = ScriptedOptimizer.set_hyperparameter.__doc__
    module.__dict__["set_hyperparameter"] = set_hyperparameter
    return module
