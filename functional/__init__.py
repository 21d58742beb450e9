"""Functional optimizers: torch.optim's algorithms as TorchScript-compilable classes.

Each class takes its parameters once and the gradients at every ``step(gradients)``, never
reading ``.grad``; it keeps torch.optim's arguments, defaults and state keys, and compiles
with TorchScript so that its step runs without the GIL.
"""
from functional._flat import FLAT_CLASSES, flatten_parameters
from functional._registry import functional_optim_map, register_functional_optimizer
from functional._scripted import ScriptedOptimizer, script_optimizer
from functional._state import load_torch_state_dict, to_torch_state_dict
from functional._version import __version__
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
from functional.rowwise import FunctionalPartialRowWiseAdam, FunctionalRowWiseAdagrad
from functional.rprop import FunctionalRprop
from functional.sgd import FunctionalSGD
from functional.sparse_adam import FunctionalSparseAdam

# In the order a newcomer reads them (the API page follows it): one class per algorithm,
# as the functional guide lists them, then compiling, the registry, state conversion, flat
# buffers.
__all__ = [
    "FunctionalSGD",
    "FunctionalAdam",
    "FunctionalAdamW",
    "FunctionalAdagrad",
    "FunctionalAdadelta",
    "FunctionalAdamax",
    "FunctionalRMSprop",
    "FunctionalRprop",
    "FunctionalNAdam",
    "FunctionalRAdam",
    "FunctionalASGD",
    "FunctionalAdafactor",
    "FunctionalSparseAdam",
    "FunctionalMuon",
    "FunctionalRowWiseAdagrad",
    "FunctionalPartialRowWiseAdam",
    "script_optimizer",
    "ScriptedOptimizer",
    "functional_optim_map",
    "register_functional_optimizer",
    "to_torch_state_dict",
    "load_torch_state_dict",
    "flatten_parameters",
    "FLAT_CLASSES",
]
