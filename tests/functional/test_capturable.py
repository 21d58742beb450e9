"""capturable=True: the graph-safe updates equal torch.optim's capturable branch, and read no
tensor on the host.

torch.optim runs a capturable step only on an accelerator: each of its modules asserts that
the parameters' device type is in ``_get_capturable_supported_devices()``, a function it
imports by name. The ``cpu_capturable`` fixture adds "cpu" to that list in every such module,
so that torch.optim's own capturable branch is the reference on this CPU-only machine.
"""
import importlib
from typing import Any, Callable, List

import pytest
import torch
# Private, for tests only: a dispatch mode sees every op, those run by TorchScript and by
# torch's C++ included, so it finds host reads that no Python-level patch can.
from torch.utils._python_dispatch import TorchDispatchMode

from functional import script_optimizer, to_torch_state_dict
from functional.adadelta import FunctionalAdadelta
from functional.adam import FunctionalAdam, FunctionalAdamW
from functional.adamax import FunctionalAdamax
from functional.asgd import FunctionalASGD
from functional.nadam import FunctionalNAdam
from functional.radam import FunctionalRAdam
from functional.rmsprop import FunctionalRMSprop
from functional.rprop import FunctionalRprop

from .case import Case
from .test_flat import check_flat_matches
from .test_parity import check_matches_torch_optim, check_state_dict_round_trip

# torch.optim warns once per optimizer that a capturable step run outside a graph is slow.
pytestmark = pytest.mark.filterwarnings("ignore:This instance was constructed with capturable=True")

#: The torch.optim modules that check capturable devices (each imports the check by name).
TORCH_MODULES = ("adam", "adamax", "nadam", "radam", "rmsprop", "rprop", "adadelta", "asgd")


# foreach=True sends torch.optim down its _multi_tensor_* capturable branch, the form of
# ours; the rows without it have torch.optim's single-tensor capturable branch as reference.
_A = (torch.optim.Adam, FunctionalAdam)
_W = (torch.optim.AdamW, FunctionalAdamW)
_X = (torch.optim.Adamax, FunctionalAdamax)
_N = (torch.optim.NAdam, FunctionalNAdam)
_R = (torch.optim.RAdam, FunctionalRAdam)
_S = (torch.optim.RMSprop, FunctionalRMSprop)
_P = (torch.optim.Rprop, FunctionalRprop)
_D = (torch.optim.Adadelta, FunctionalAdadelta)
_G = (torch.optim.ASGD, FunctionalASGD)
_ROWS = [
    # Adam: its foreach path (the fused kernel is graph-safe by itself).
    (_A, {"lr": 0.01, "foreach": True}),
    (_A, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "amsgrad": True, "foreach": True}),
    (_A, {"lr": 0.01, "weight_decay": 0.1, "maximize": True, "foreach": True}),
    (_A, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True, "amsgrad": True,
          "maximize": True, "foreach": True}),
    (_A, {"lr": torch.tensor(0.01), "weight_decay": 0.1, "decoupled_weight_decay": True,
          "foreach": True}),
    (_A, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True, "fused": False}),
    (_W, {"lr": 0.01, "foreach": True}),
    (_W, {"lr": 0.01, "amsgrad": True, "maximize": True, "foreach": True}),
    (_W, {"lr": torch.tensor(0.01), "amsgrad": True, "foreach": True}),
    (_X, {"lr": 0.01, "foreach": True}),
    (_X, {"lr": 0.01, "weight_decay": 0.1, "maximize": True, "foreach": True}),
    (_X, {"lr": torch.tensor(0.01), "weight_decay": 0.1, "foreach": True}),
    (_X, {"lr": 0.01, "weight_decay": 0.1}),
    (_N, {"lr": 0.01, "foreach": True}),
    (_N, {"lr": 0.01, "momentum_decay": 0.05, "weight_decay": 0.1, "maximize": True,
          "foreach": True}),
    (_N, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True, "foreach": True}),
    (_N, {"lr": torch.tensor(0.01), "weight_decay": 0.1, "decoupled_weight_decay": True,
          "foreach": True}),
    (_N, {"lr": 0.01, "momentum_decay": 0.05, "weight_decay": 0.1}),
    # With the default betas rho_t passes 5 at step 6: both RAdam updates are taken.
    (_R, {"lr": 0.01, "foreach": True}),
    (_R, {"lr": 0.01, "betas": (0.9, 0.5), "foreach": True}),
    (_R, {"lr": 0.01, "weight_decay": 0.1, "maximize": True, "foreach": True}),
    (_R, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True, "foreach": True}),
    (_R, {"lr": torch.tensor(0.01), "weight_decay": 0.1, "decoupled_weight_decay": True,
          "foreach": True}),
    (_R, {"lr": 0.01, "weight_decay": 0.1}),
    (_S, {"lr": 0.01, "foreach": True}),
    (_S, {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.1, "foreach": True}),
    (_S, {"lr": 0.01, "centered": True, "maximize": True, "foreach": True}),
    (_S, {"lr": torch.tensor(0.01), "momentum": 0.9, "foreach": True}),
    (_S, {"lr": torch.tensor(0.01), "centered": True, "foreach": True}),
    (_P, {"lr": 0.05, "foreach": True}),
    (_P, {"lr": 0.05, "etas": (0.4, 1.3), "step_sizes": (1e-3, 0.1), "maximize": True,
          "foreach": True}),
    (_P, {"lr": torch.tensor(0.05), "foreach": True}),
    (_D, {"lr": 0.5, "foreach": True}),
    (_D, {"lr": 0.5, "rho": 0.8, "weight_decay": 0.1, "maximize": True, "foreach": True}),
    (_D, {"lr": torch.tensor(0.5), "foreach": True}),
    # t0 below the step count starts the averaging (mu < 1); None gradients leave the
    # parameters at different steps, hence different eta and mu.
    (_G, {"lr": 0.1, "foreach": True}),
    (_G, {"lr": 0.1, "t0": 3.0, "lambd": 0.1, "foreach": True}),
    (_G, {"lr": 0.1, "t0": 2.0, "lambd": 0.1, "alpha": 1.5, "weight_decay": 0.1,
          "maximize": True, "foreach": True}),
    (_G, {"lr": torch.tensor(0.1), "t0": 3.0, "lambd": 0.1, "foreach": True}),
]
CASES = [Case(classes[0], classes[1], dict(kwargs, capturable=True)) for classes, kwargs in _ROWS]
CASES += [
    Case(torch.optim.Adam, FunctionalAdam, {"lr": 0.01, "amsgrad": True, "foreach": True,
                                            "capturable": True}, dtype=torch.float64),
    Case(torch.optim.NAdam, FunctionalNAdam, {"lr": 0.01, "foreach": True, "capturable": True},
         dtype=torch.float64),
    Case(torch.optim.ASGD, FunctionalASGD, {"lr": 0.1, "t0": 3.0, "foreach": True,
                                            "capturable": True}, dtype=torch.float64),
]
IDS = [c.id for c in CASES]


def _with_cpu(devices: Callable[..., List[str]]) -> Callable[..., List[str]]:
    def supported(supports_xla: bool = True) -> List[str]:
        return [*devices(supports_xla), "cpu"]
    return supported


@pytest.fixture
def cpu_capturable(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.optim's capturable steps allowed on the CPU (an attribute missing from one of
    ``TORCH_MODULES`` fails here, rather than leaving that module's check in place)."""
    for name in TORCH_MODULES:
        module = importlib.import_module(f"torch.optim.{name}")
        monkeypatch.setattr(
            module, "_get_capturable_supported_devices",
            _with_cpu(module._get_capturable_supported_devices),
        )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_torch_optim_capturable(cpu_capturable: None, case: Case, compiled: bool) -> None:
    """test_parity's check (None gradients, hyper-parameters changed half-way, the final
    state), torch.optim capturable too."""
    opt = check_matches_torch_optim(case, compiled)
    assert to_torch_state_dict(opt, case.torch_cls)["param_groups"][0]["capturable"] is True


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_state_dict_round_trip_with_torch_optim_capturable(
    cpu_capturable: None, case: Case
) -> None:
    """A capturable state_dict continues in torch.optim, and torch.optim's in ours."""
    check_state_dict_round_trip(case)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_flat_buffers_capturable(cpu_capturable: None, case: Case, compiled: bool) -> None:
    """test_flat's check: a flat buffer's capturable step (one 0-dim step operand, the
    first member's) equals torch.optim and the per-parameter capturable step."""
    check_flat_matches(case, compiled)


#: Ops that hand tensor data to the host: ``item()``, ``float(t)``, ``bool(t)`` (all
#: ``_local_scalar_dense``), ``torch.equal``, and ``nonzero`` (boolean-mask indexing), whose
#: result's size the host must read.
HOST_READS = frozenset({"_local_scalar_dense", "equal", "nonzero"})
#: The Tensor methods that read a value on the host, refused outright in eager steps.
READ_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


class HostReads(TorchDispatchMode):
    """Records the host reads (``HOST_READS``) of the ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_READS:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _refuse(name: str) -> Callable[..., Any]:
    def refused(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a step called Tensor.{name}(), a host read")
    return refused


def _host_reads(case: Case, compiled: bool, monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """The host reads of ``case.steps`` steps of a fresh optimizer (compiled or eager, the
    Tensor methods of ``READ_METHODS`` refused in eager code), given one more parameter that
    never gets a gradient (a frozen one)."""
    params = case.make_params() + [torch.zeros(2, dtype=case.dtype)]
    optim = case.functional_cls(params, **case.kwargs_copy())
    opt = script_optimizer(optim) if compiled else optim
    if isinstance(case.kwargs["lr"], torch.Tensor):
        # Rprop's step sizes and ASGD's eta start at lr: a Tensor lr is read on the host by
        # a step that makes state, as the warm-up steps before a CUDA graph capture do.
        opt.step([torch.ones_like(p) for p in params[:-1]] + [None])
    with monkeypatch.context() as patch, HostReads() as reads:
        if not compiled:
            for name in READ_METHODS:
                patch.setattr(torch.Tensor, name, _refuse(name))
        for step in range(case.steps):
            opt.step(case.make_gradients(step) + [None])
    return reads.ops


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_capturable_step_reads_nothing_on_the_host(
    case: Case, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a CUDA graph needs, and what keeps a GPU step free of device synchronisations."""
    assert _host_reads(case, compiled, monkeypatch) == []


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_host_reads_are_seen(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above sees the reads of a step that is not capturable (its foreach path reads
    each parameter's step count; the fused CPU kernel reads it in C++), so an empty list there
    means something."""
    case = Case(torch.optim.Adamax, FunctionalAdamax, {"lr": 0.01, "foreach": True})
    if compiled:
        assert "aten._local_scalar_dense.default" in _host_reads(case, True, monkeypatch)
    else:
        with pytest.raises(AssertionError, match=r"called Tensor\.item\(\), a host read"):
            _host_reads(case, False, monkeypatch)
