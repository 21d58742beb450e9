"""Functional optimizers: torch.optim's algorithms as TorchScript-compilable classes.

Each class takes its parameters once and the gradients at every ``step(gradients)``, never
reading ``.grad``; it keeps torch.optim's arguments, defaults and state keys, and compiles
with TorchScript so that its step runs without the GIL.
"""
from functional._registry import functional_optim_map, register_functional_optimizer
from functional._scripted import ScriptedOptimizer, script_optimizer
from functional._state import load_torch_state_dict, to_torch_state_dict
from functional.sgd import FunctionalSGD

__all__ = [
    "FunctionalSGD",
    "ScriptedOptimizer",
    "functional_optim_map",
    "load_torch_state_dict",
    "register_functional_optimizer",
    "script_optimizer",
    "to_torch_state_dict",
]
