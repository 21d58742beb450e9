"""Functional optimizers: torch.optim's algorithms as TorchScript-compilable classes.

Each class takes its parameters once and the gradients at every ``step(gradients)``, never
reading ``.grad``; it keeps torch.optim's arguments, defaults and state keys, and compiles
with TorchScript so that its step runs without the GIL.
"""
from functional._flat import FLAT_CLASSES, flatten_parameters
from functional._registry import functional_optim_map, register_functional_optimizer
from functional._scripted import ScriptedOptimizer, script_optimizer
from functional._state import load_torch_state_dict, to_torch_state_dict
from functional.adadelta import FunctionalAdadelta
from functional.adafactor import FunctionalAdafactor
from functional.adagrad import FunctionalAdagrad
from functional.adam import FunctionalAdam, FunctionalAdamW
from functional.adamax import FunctionalAdamax
from functional.asgd import FunctionalASGD
from functional.muon import FunctionalMuon
from functional.nadam import FunctionalNAdam
from functional.radam import FunctionalRAdam
from functional.rmsprop import FunctionalRMSprop
from functional.rprop import FunctionalRprop
from functional.sgd import FunctionalSGD
from functional.sparse_adam import FunctionalSparseAdam

__all__ = [
    "FLAT_CLASSES",
    "FunctionalASGD",
    "FunctionalAdadelta",
    "FunctionalAdafactor",
    "FunctionalAdagrad",
    "FunctionalAdam",
    "FunctionalAdamW",
    "FunctionalAdamax",
    "FunctionalMuon",
    "FunctionalNAdam",
    "FunctionalRAdam",
    "FunctionalRMSprop",
    "FunctionalRprop",
    "FunctionalSGD",
    "FunctionalSparseAdam",
    "ScriptedOptimizer",
    "flatten_parameters",
    "functional_optim_map",
    "load_torch_state_dict",
    "register_functional_optimizer",
    "script_optimizer",
    "to_torch_state_dict",
]
