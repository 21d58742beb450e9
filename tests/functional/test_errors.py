"""Bad input: clear errors that name the argument and the value, as torch.optim rejects it."""
import re

import numpy as np
import pytest
import torch

from functional import FLAT_CLASSES, flatten_parameters, functional_optim_map, script_optimizer
from functional.blockwise_adam import Adam8bit, AdamW4bit, AdamW8bit
from functional._validation import TORCH_DUPLICATE_WARNING
from tests.helpers import assert_identical

O = torch.optim
# (torch.optim class, arguments torch.optim rejects with ValueError, the name ours must give)
INVALID_ARGS = [
    (O.SGD, {"lr": -0.1}, "lr"),
    (O.SGD, {"lr": torch.tensor([0.1, 0.2])}, "lr"),
    (O.SGD, {"momentum": -0.5}, "momentum"),
    (O.SGD, {"weight_decay": -1.0}, "weight_decay"),
    (O.SGD, {"nesterov": True}, "nesterov"),
    (O.SGD, {"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "nesterov"),
    (O.Adam, {"lr": -1.0}, "lr"),
    (O.Adam, {"eps": -1e-8}, "eps"),
    (O.Adam, {"betas": (1.0, 0.999)}, "betas[0]"),
    (O.Adam, {"betas": (0.9, -0.1)}, "betas[1]"),
    (O.Adam, {"weight_decay": -0.1}, "weight_decay"),
    (O.AdamW, {"lr": -1.0}, "lr"),
    (O.AdamW, {"betas": (0.9, 1.5)}, "betas[1]"),
    (O.AdamW, {"weight_decay": -0.1}, "weight_decay"),
    (O.Adagrad, {"lr": -1.0}, "lr"),
    (O.Adagrad, {"lr_decay": -1.0}, "lr_decay"),
    (O.Adagrad, {"weight_decay": -1.0}, "weight_decay"),
    (O.Adagrad, {"initial_accumulator_value": -1.0}, "initial_accumulator_value"),
    (O.Adagrad, {"eps": -1.0}, "eps"),
    (O.Adadelta, {"lr": -1.0}, "lr"),
    (O.Adadelta, {"rho": 1.5}, "rho"),
    (O.Adadelta, {"eps": -1.0}, "eps"),
    (O.Adadelta, {"weight_decay": -1.0}, "weight_decay"),
    (O.Adamax, {"lr": -1.0}, "lr"),
    (O.Adamax, {"eps": -1.0}, "eps"),
    (O.Adamax, {"betas": (-0.1, 0.9)}, "betas[0]"),
    (O.Adamax, {"weight_decay": -1.0}, "weight_decay"),
    (O.RMSprop, {"lr": -1.0}, "lr"),
    (O.RMSprop, {"eps": -1.0}, "eps"),
    (O.RMSprop, {"momentum": -1.0}, "momentum"),
    (O.RMSprop, {"weight_decay": -1.0}, "weight_decay"),
    (O.RMSprop, {"alpha": -1.0}, "alpha"),
    (O.Rprop, {"lr": -1.0}, "lr"),
    (O.Rprop, {"etas": (1.5, 1.2)}, "etas"),
    (O.Rprop, {"etas": (0.5, 0.9)}, "etas"),
    (O.NAdam, {"lr": -1.0}, "lr"),
    (O.NAdam, {"betas": (0.9, 1.0)}, "betas[1]"),
    (O.NAdam, {"momentum_decay": -1.0}, "momentum_decay"),
    (O.RAdam, {"lr": -1.0}, "lr"),
    (O.RAdam, {"eps": -1.0}, "eps"),
    (O.RAdam, {"weight_decay": -1.0}, "weight_decay"),
    (O.ASGD, {"lr": -1.0}, "lr"),
    (O.ASGD, {"weight_decay": -1.0}, "weight_decay"),
    (O.Adafactor, {"lr": -1.0}, "lr"),
    (O.Adafactor, {"beta2_decay": 0.5}, "beta2_decay"),
    (O.Adafactor, {"eps": (-1.0, 1e-3)}, "eps"),
    (O.Adafactor, {"eps": (None, -1.0)}, "eps"),
    (O.Adafactor, {"d": 0.5}, "d"),
    (O.Adafactor, {"weight_decay": -1.0}, "weight_decay"),
    (O.SparseAdam, {"lr": -1.0}, "lr"),
    (O.SparseAdam, {"eps": -1.0}, "eps"),
    (O.SparseAdam, {"betas": (1.0, 0.9)}, "betas[0]"),
    (O.Muon, {"lr": -1.0}, "lr"),
    (O.Muon, {"momentum": -1.0}, "momentum"),
    (O.Muon, {"weight_decay": -1.0}, "weight_decay"),
    (Adam8bit, {"lr": -1.0}, "lr"),
    (Adam8bit, {"block_size": 255}, "block_size"),
    (AdamW8bit, {"betas": (1.0, 0.9)}, "betas[0]"),
    (AdamW8bit, {"min_8bit_size": -1}, "min_8bit_size"),
    (AdamW4bit, {"eps": -1.0}, "eps"),
    (AdamW4bit, {"amsgrad": True}, "amsgrad"),
]


# (torch.optim class, arguments of the wrong kind, the argument ours must name, its value):
# torch.optim refuses each, at construction or at the first step, without naming it.
WRONG_TYPES = [
    (O.SGD, {"lr": "fast"}, "lr", "fast"),
    (O.SGD, {"momentum": None}, "momentum", None),
    (O.Adam, {"lr": "fast"}, "lr", "fast"),
    (O.Adam, {"betas": "x"}, "betas", "x"),
    (O.Adam, {"betas": (0.9, "x")}, "betas[1]", "x"),
    (O.Adam, {"eps": None}, "eps", None),
    (O.AdamW, {"lr": "fast"}, "lr", "fast"),
    (O.AdamW, {"weight_decay": None}, "weight_decay", None),
    (O.Adagrad, {"lr": "fast"}, "lr", "fast"),
    (O.Adagrad, {"lr_decay": "x"}, "lr_decay", "x"),
    (O.Adagrad, {"initial_accumulator_value": None}, "initial_accumulator_value", None),
    (O.Adadelta, {"lr": "fast"}, "lr", "fast"),
    (O.Adadelta, {"rho": "x"}, "rho", "x"),
    (O.Adamax, {"lr": "fast"}, "lr", "fast"),
    (O.Adamax, {"betas": (0.9,)}, "betas", (0.9,)),
    (O.RMSprop, {"lr": "fast"}, "lr", "fast"),
    (O.RMSprop, {"alpha": None}, "alpha", None),
    (O.RMSprop, {"momentum": "x"}, "momentum", "x"),
    (O.Rprop, {"lr": "fast"}, "lr", "fast"),
    (O.Rprop, {"etas": "x"}, "etas", "x"),
    (O.Rprop, {"step_sizes": (1e-6,)}, "step_sizes", (1e-6,)),
    (O.NAdam, {"lr": "fast"}, "lr", "fast"),
    (O.NAdam, {"momentum_decay": "x"}, "momentum_decay", "x"),
    (O.RAdam, {"lr": "fast"}, "lr", "fast"),
    (O.RAdam, {"eps": None}, "eps", None),
    (O.ASGD, {"lr": "fast"}, "lr", "fast"),
    (O.ASGD, {"t0": "x"}, "t0", "x"),
    (O.ASGD, {"lambd": None}, "lambd", None),
    (O.Adafactor, {"lr": "fast"}, "lr", "fast"),
    (O.Adafactor, {"eps": ("x", 1e-3)}, "eps[0]", "x"),
    (O.Adafactor, {"d": None}, "d", None),
    (O.SparseAdam, {"lr": "fast"}, "lr", "fast"),
    (O.SparseAdam, {"betas": "x"}, "betas", "x"),
    (O.SparseAdam, {"eps": None}, "eps", None),
    (O.Muon, {"lr": "fast"}, "lr", "fast"),
    (O.Muon, {"momentum": None}, "momentum", None),
    (O.Muon, {"ns_steps": 5.0}, "ns_steps", 5.0),
    (Adam8bit, {"lr": "fast"}, "lr", "fast"),
    (AdamW8bit, {"block_size": 256.0}, "block_size", 256.0),
    (AdamW4bit, {"eps": None}, "eps", None),
]

# Values of another kind than the annotation's that torch.optim takes: ours must take them
# too, and step as torch.optim does.
ACCEPTED = [
    (O.SGD, {"lr": 1, "momentum": 1, "nesterov": 1, "maximize": None}),
    (O.SGD, {"lr": np.float32(0.5), "weight_decay": torch.tensor(0.1)}),
    (O.Adam, {"lr": torch.tensor(0.01), "betas": [0.8, 0.9], "amsgrad": 1, "weight_decay": 0}),
    (O.Adam, {"betas": (torch.tensor(0.8), torch.tensor(0.9)), "foreach": False}),
    (O.AdamW, {"lr": np.float64(0.01), "eps": 0}),
    (O.Adagrad, {"lr": 1, "initial_accumulator_value": 1}),
    (O.Adadelta, {"rho": 0, "foreach": 0}),
    (O.Adamax, {"betas": [0.5, 0.9]}),
    (O.RMSprop, {"momentum": 1, "centered": 1}),
    (O.Rprop, {"etas": [0.5, 2], "step_sizes": (0, 50)}),
    (O.NAdam, {"momentum_decay": 0, "decoupled_weight_decay": 1}),
    (O.RAdam, {"lr": torch.tensor(0.01), "weight_decay": 1}),
    (O.ASGD, {"t0": 1, "lambd": 0}),
    (O.Adafactor, {"eps": [None, 1e-3], "d": 2}),
    (O.SparseAdam, {"betas": [0.8, 0.9]}),
    (O.Muon, {"lr": 1, "ns_steps": True, "ns_coefficients": [3, -4, 2]}),
    # numpy scalars and arrays, and 1-element tensors for flags, as read from a config
    (O.Adam, {"lr": np.float64(0.01), "betas": np.array([0.8, 0.9]), "amsgrad": np.bool_(True),
              "maximize": np.bool_(False), "foreach": np.bool_(False)}),
    (O.Adam, {"lr": np.float64(0.01), "fused": np.bool_(True)}),
    (O.Adam, {"amsgrad": torch.tensor(True)}),
    (O.SGD, {"lr": np.float32(0.1), "momentum": np.float64(0.9), "nesterov": np.bool_(True)}),
    (O.Adagrad, {"lr": np.float64(0.1), "fused": np.bool_(True)}),
    (O.RMSprop, {"centered": np.bool_(True), "momentum": np.float32(0.5)}),
]


def _params(torch_cls: type):
    return [torch.zeros(3, 2, requires_grad=True)]


def _case_id(row) -> str:
    cls, kwargs, _ = row
    return f"{cls.__name__}-" + ",".join(f"{k}={v!r}" for k, v in kwargs.items())


@pytest.mark.parametrize("row", INVALID_ARGS, ids=[_case_id(r) for r in INVALID_ARGS])
def test_invalid_hyperparameter_raises_like_torch(row) -> None:
    torch_cls, kwargs, name = row
    with pytest.raises(ValueError):
        torch_cls(_params(torch_cls), **kwargs)
    with pytest.raises(ValueError, match=rf"Invalid {name.replace('[', '.').replace(']', '.')}:") as info:
        functional_optim_map[torch_cls](_params(torch_cls), **kwargs)
    assert "expected" in str(info.value)


def test_every_torch_optimizer_but_lbfgs_is_mapped() -> None:
    expected = {
        O.SGD, O.Adam, O.AdamW, O.Adagrad, O.Adadelta, O.Adamax, O.RMSprop, O.Rprop, O.NAdam,
        O.RAdam, O.ASGD, O.Adafactor, O.SparseAdam, O.Muon,
    }
    # and distopt's own 8-bit / 4-bit classes (functional/blockwise_adam.py)
    expected |= {Adam8bit, AdamW8bit, AdamW4bit}
    assert set(functional_optim_map) == expected
    for torch_cls, cls in functional_optim_map.items():
        assert cls.__name__ == "Functional" + torch_cls.__name__


def test_every_class_validates_each_argument_row() -> None:
    """Each mapped class appears in INVALID_ARGS (so a new class cannot skip its checks)."""
    assert {row[0] for row in INVALID_ARGS} == set(functional_optim_map)


def _grad_like(torch_cls: type, p: torch.Tensor) -> torch.Tensor:
    g = torch.ones_like(p)
    return g.to_sparse() if torch_cls is O.SparseAdam else g


def _torch_refuses(torch_cls: type, kwargs) -> bool:
    """Whether torch.optim raises at construction or at the first step."""
    p = torch.zeros(3, 2, requires_grad=True)
    try:
        optim = torch_cls([p], **kwargs)
        p.grad = _grad_like(torch_cls, p.detach())
        optim.step()
    except (TypeError, ValueError, IndexError):
        return True
    return False


def _wrong_type_id(row) -> str:
    cls, kwargs, _, _ = row
    return f"{cls.__name__}-" + ",".join(f"{k}={v!r}" for k, v in kwargs.items())


@pytest.mark.parametrize("row", WRONG_TYPES, ids=[_wrong_type_id(r) for r in WRONG_TYPES])
def test_wrong_type_names_the_argument_and_the_value(row) -> None:
    torch_cls, kwargs, name, value = row
    assert _torch_refuses(torch_cls, kwargs)
    with pytest.raises(TypeError) as info:
        functional_optim_map[torch_cls](_params(torch_cls), **kwargs)
    assert str(info.value).startswith(f"Invalid {name}: {value!r} (expected ")


def test_every_class_checks_argument_types() -> None:
    assert {row[0] for row in WRONG_TYPES} == set(functional_optim_map)


@pytest.mark.parametrize("torch_cls", list(functional_optim_map), ids=lambda c: c.__name__)
def test_wrong_type_given_positionally_is_named(torch_cls: type) -> None:
    with pytest.raises(TypeError, match=r"^Invalid lr: 'fast' \(expected a float"):
        functional_optim_map[torch_cls](_params(torch_cls), "fast")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("row", ACCEPTED, ids=[_case_id((*r, None)) for r in ACCEPTED])
def test_values_torch_accepts_are_accepted(row, compiled: bool) -> None:
    torch_cls, kwargs = row

    def copy():  # a Tensor argument each, so that neither optimizer sees the other's
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    start = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    ours, theirs = start.clone(), start.clone().requires_grad_(True)
    reference = torch_cls([theirs], **copy())
    optim = functional_optim_map[torch_cls]([ours], **copy())
    if compiled:
        optim = script_optimizer(optim)
    for step in range(2):
        grad = torch.randn(3, 2, generator=torch.Generator().manual_seed(1 + step))
        if torch_cls is O.SparseAdam:
            grad = grad.to_sparse()
        theirs.grad = grad
        reference.step()
        optim.step([grad])
    torch.testing.assert_close(ours, theirs.detach())
    assert not torch.equal(ours, start)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("torch_cls", list(functional_optim_map), ids=lambda c: c.__name__)
def test_gradient_list_must_match_parameters(torch_cls: type, compiled: bool) -> None:
    params = [torch.zeros(3, 2), torch.zeros(4, 2)]
    before = [p.clone() for p in params]
    optim = functional_optim_map[torch_cls](params)
    if compiled:
        optim = script_optimizer(optim)
    # TorchScript re-raises as torch.jit.Error whose message carries "builtins.ValueError: "
    # and the text; eager code raises the ValueError itself.
    error = torch.jit.Error if compiled else ValueError
    g = _grad_like(torch_cls, params[0])

    with pytest.raises(error, match=r"1 gradients for 2 parameters"):
        optim.step([g])
    with pytest.raises(error, match=r"gradients\[1\]: shape .*3, 2.* \(expected .*4, 2"):
        optim.step([None, _grad_like(torch_cls, params[0])])
    with pytest.raises(error, match=r"gradients\[0\]: dtype torch.float64 \(expected torch.float32"):
        optim.step([g.double(), None])
    for p, b in zip(params, before):
        assert torch.equal(p, b), "a rejected step changed a parameter"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("foreach", [None, False, True], ids=["default", "kernel", "foreach"])
def test_adafactor_refuses_a_parameter_with_no_elements(foreach, compiled: bool) -> None:
    """torch.optim.Adafactor divides by a parameter's element count: ZeroDivisionError for
    an empty one, after its steps have counted. Ours names the parameter before anything
    changes, on every path (the fused kernel would otherwise step it silently)."""
    empty = torch.zeros(0, 5, requires_grad=True)
    empty.grad = torch.zeros(0, 5)
    with pytest.raises(ZeroDivisionError):
        torch.optim.Adafactor([empty], foreach=foreach).step()
    params = [torch.ones(3), torch.zeros(0, 5)]
    optim = functional_optim_map[torch.optim.Adafactor](params, lr=0.1, foreach=foreach)
    if compiled:
        optim = script_optimizer(optim)
    error = torch.jit.Error if compiled else ValueError
    with pytest.raises(error, match=r"Invalid params\[1\]: shape \[0, 5\], no elements"):
        optim.step([torch.ones(3), torch.zeros(0, 5)])
    assert torch.equal(params[0], torch.ones(3))
    assert _snapshot(optim, compiled) == {}


def _snapshot(optim, compiled: bool):
    state = optim.get_state() if compiled else optim.state
    return {i: {k: v.clone() for k, v in entry.items()} for i, entry in state.items()}


def _built(torch_cls: type, params, compiled: bool, flat: bool):
    """The functional twin of ``torch_cls`` over ``params``, flattened where it can be and
    ``flat`` asks, compiled where ``compiled`` does."""
    optim = functional_optim_map[torch_cls](params)
    if flat and type(optim).__name__ in FLAT_CLASSES:
        flatten_parameters(optim)
    return script_optimizer(optim) if compiled else optim


@pytest.mark.parametrize("flat", [False, True], ids=["per-parameter", "flat"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("torch_cls", list(functional_optim_map), ids=lambda c: c.__name__)
def test_a_sparse_compressed_gradient_is_refused_by_its_layout(torch_cls, compiled, flat) -> None:
    """torch.optim cannot even take a CSR ``.grad`` for a dense parameter; ours names the
    gradient and its layout, and nothing changes (no new state either)."""
    params = [torch.randn(3, 3), torch.randn(2, 2)]
    before = [p.clone() for p in params]
    optim = _built(torch_cls, params, compiled, flat)
    state = _snapshot(optim, compiled)
    error = torch.jit.Error if compiled else ValueError
    other = _grad_like(torch_cls, params[1])
    with pytest.raises(error, match=r"gradients\[0\]: layout torch.sparse_csr \(expected torch.strided"):
        optim.step([torch.randn(3, 3).to_sparse_csr(), other])
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert_identical(_snapshot(optim, compiled), state)


@pytest.mark.parametrize("flat", [False, True], ids=["per-parameter", "flat"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("torch_cls", list(functional_optim_map), ids=lambda c: c.__name__)
def test_a_gradient_on_another_device_is_refused(torch_cls, compiled, flat) -> None:
    """torch.optim refuses it when the gradient is assigned; ours names the gradient and its
    device, before anything changes (a gradient on the meta device stands in for a CPU
    gradient of a CUDA parameter on a machine without one)."""
    params = [torch.randn(3, 2), torch.randn(4, 2), torch.randn(2, 2)]
    optim = _built(torch_cls, params, compiled, flat)
    optim.step([_grad_like(torch_cls, p) for p in params])
    before = [p.clone() for p in params]
    state = _snapshot(optim, compiled)
    grads = [_grad_like(torch_cls, p) for p in params]
    grads[1] = grads[1].to("meta")
    error = torch.jit.Error if compiled else ValueError
    with pytest.raises(error, match=r"gradients\[1\]: device meta \(expected cpu"):
        optim.step(grads)
    assert all(torch.equal(p, b) for p, b in zip(params, before)), "a refused step changed a parameter"
    assert_identical(_snapshot(optim, compiled), state, "a refused step changed the state")


def _sgd_mix(kwargs, first_sparse: bool):
    """Gradients for two SGD steps on params [4], [3], [5]: the second gives parameter 1 a
    sparse gradient (or, after a sparse first step, a dense one)."""
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, generator=gen) for n in (4, 3, 5)]
    first = list(dense)
    if first_sparse:
        first[1] = first[1].to_sparse()
    second = [g * 0.5 for g in dense]
    if not first_sparse:
        second[1] = second[1].to_sparse()
    return first, second


SPARSE_MIXES = [
    ({"lr": 0.1, "weight_decay": 0.1}, False, r"a sparse gradient with weight_decay=0.1"),
    ({"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, False, r"a sparse gradient with weight_decay"),
    ({"lr": 0.1, "momentum": 0.9, "nesterov": True}, False, r"a sparse gradient with nesterov=True, and a dense momentum"),
    ({"lr": 0.1, "momentum": 0.9}, True, r"a dense gradient, and a sparse momentum buffer in state\[1\]"),
]


@pytest.mark.parametrize("flat", [False, True], ids=["per-parameter", "flat"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("row", SPARSE_MIXES, ids=["wd", "wd-momentum", "nesterov", "sparse-buffer"])
def test_sgd_sparse_mixes_torch_fails_on_change_nothing(row, compiled: bool, flat: bool) -> None:
    """torch.optim.SGD fails on these part-way through its update (earlier parameters already
    stepped); ours refuses before anything changes, with torch's words and the gradient."""
    kwargs, first_sparse, what = row
    first, second = _sgd_mix(kwargs, first_sparse)
    ref = [torch.zeros(n, requires_grad=True) for n in (4, 3, 5)]
    ref_opt = O.SGD(ref, **kwargs)
    for grads in (first, second):
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        if grads is first:
            ref_opt.step()
    with pytest.raises(RuntimeError, match=r"add\(sparse, dense\) is not supported"):
        ref_opt.step()

    params = [torch.zeros(n) for n in (4, 3, 5)]
    optim = functional_optim_map[O.SGD](params, **kwargs)
    if flat:
        flatten_parameters(optim)
    if compiled:
        optim = script_optimizer(optim)
    optim.step([g.clone() for g in first])
    before = [p.clone() for p in params]
    state = _snapshot(optim, compiled)
    error = torch.jit.Error if compiled else RuntimeError
    with pytest.raises(error, match=r"add\(sparse, dense\) is not supported.*gradients\[1\]: " + what):
        optim.step([g.clone() for g in second])
    assert all(torch.equal(p, b) for p, b in zip(params, before)), "a refused step changed a parameter"
    assert_identical(_snapshot(optim, compiled), state, "a refused step changed the state")


@pytest.mark.parametrize("torch_cls", list(functional_optim_map), ids=lambda c: c.__name__)
def test_unknown_hyperparameter_name_is_rejected(torch_cls: type) -> None:
    optim = functional_optim_map[torch_cls]([torch.zeros(3, 2)])
    with pytest.raises(ValueError, match=r"Invalid hyper-parameter name .*'not_a_name'"):
        optim.set_hyperparameter("not_a_name", [0.1])


def test_params_must_be_tensors() -> None:
    cls = functional_optim_map[O.SGD]
    with pytest.raises(ValueError, match=r"Invalid params: \[\]"):
        cls([])
    with pytest.raises(TypeError, match=r"Invalid params\[1\]: int"):
        cls([torch.zeros(2), 3])


@pytest.mark.parametrize("torch_cls", list(functional_optim_map), ids=lambda c: c.__name__)
def test_params_may_be_any_iterable_of_tensors(torch_cls: type) -> None:
    # As torch.optim takes them: model.parameters() (a generator), a tuple. Two matrices:
    # Muon takes only 2-D parameters.
    model = torch.nn.Sequential(torch.nn.Linear(3, 4, bias=False), torch.nn.Linear(4, 2, bias=False))
    want = [id(p) for p in model.parameters()]
    for given in (model.parameters(), tuple(model.parameters())):
        optim = functional_optim_map[torch_cls](given)
        assert isinstance(optim.params, list) and [id(p) for p in optim.params] == want


def test_a_model_a_tensor_or_a_number_as_params_is_refused_naming_the_fix() -> None:
    cls = functional_optim_map[O.SGD]
    model = torch.nn.Linear(3, 2)
    cases = [
        (model, "Invalid params: a Linear module (expected an iterable of Tensors: pass "
                "model.parameters())"),
        (model.weight, "Invalid params: a Tensor (expected an iterable of Tensors, e.g. "
                       "model.parameters(); put one Tensor in a list)"),
        (3, "Invalid params: int (expected an iterable of Tensors, e.g. model.parameters())"),
    ]
    for given, message in cases:
        with pytest.raises(TypeError) as info:
            cls(given)
        assert str(info.value) == message


@pytest.mark.parametrize("torch_cls", list(functional_optim_map), ids=lambda c: c.__name__)
def test_set_hyperparameter_takes_a_number_alone(torch_cls: type) -> None:
    optim = functional_optim_map[torch_cls](_params(torch_cls))
    optim.set_hyperparameter("lr", 1e-4)  # for [1e-4]
    assert optim.lr == 1e-4
    optim.set_hyperparameter("lr", 2)  # an int, a numpy float: as torch.optim takes them
    assert optim.lr == 2.0 and isinstance(optim.lr, float)
    optim.set_hyperparameter("lr", np.float64(3e-4))
    assert optim.lr == 3e-4


SET_HYPERPARAMETER_FORMS = ("expected a float, or a list of floats: 1e-4 or [1e-4], or "
                            "[0.9, 0.999] for a pair such as betas)")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_set_hyperparameter_names_a_value_it_cannot_take(compiled: bool) -> None:
    optim = functional_optim_map[O.Adam](_params(O.Adam), lr=1e-3)
    if compiled:
        optim = script_optimizer(optim)
    optim.set_hyperparameter("lr", 1e-4)  # compiled, the method takes List[float] only
    optim.set_hyperparameter("betas", (0.8, 0.99))
    held = optim.optim if compiled else optim
    assert held.lr == 1e-4 and held.betas == (0.8, 0.99)
    for value in ("fast", None, True, [0.9, "x"]):
        with pytest.raises(TypeError) as info:
            optim.set_hyperparameter("lr", value)
        assert str(info.value) == (
            f"Invalid set_hyperparameter('lr', value): {value!r} ({SET_HYPERPARAMETER_FORMS}"
        )
    held = optim.optim if compiled else optim
    assert held.lr == 1e-4


@pytest.mark.parametrize("torch_cls", list(functional_optim_map), ids=lambda c: c.__name__)
def test_one_tensor_twice_is_refused_naming_both_indices(torch_cls: type) -> None:
    [p], [q] = _params(torch_cls), _params(torch_cls)
    with pytest.warns(UserWarning, match=re.escape(TORCH_DUPLICATE_WARNING)):
        torch_cls([p, q, p])  # torch.optim only warns, in these words (quoted in ours)
    with pytest.raises(ValueError, match=r"Invalid params: params\[0\] and params\[2\] are the "
                       r"same tensor \(expected each tensor once; torch.optim warns \""
                       + re.escape(TORCH_DUPLICATE_WARNING)):
        functional_optim_map[torch_cls]([p, q, p])


def test_torch_kernels_disagree_on_a_tensor_given_twice() -> None:
    """Why the functional classes refuse it rather than match torch.optim: torch steps such a
    tensor once per occurrence, and its for-loop and foreach SGD then end 0.53 apart after 3
    steps (its fused kernel agrees with the for-loop), so there is no one result to match."""
    ends = []
    for foreach in (False, True):
        p, q = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
        with pytest.warns(UserWarning, match=re.escape(TORCH_DUPLICATE_WARNING)):
            opt = O.SGD([p, q, p], lr=0.1, momentum=0.9, foreach=foreach)
        for step in range(3):
            p.grad, q.grad = torch.full((3,), 1.0 + step), torch.full((3,), 2.0)
            opt.step()
        ends.append(p.detach().clone())
    assert float((ends[0] - ends[1]).abs().max()) > 0.1


def test_step_param_updates_only_that_parameter() -> None:
    cls = functional_optim_map[O.SGD]
    a, b = torch.ones(2), torch.ones(2)
    optim = cls([a, b], lr=0.5)
    optim.step_param(b, torch.ones(2))
    assert torch.equal(a, torch.ones(2))
    assert torch.equal(b, torch.full((2,), 0.5))
    with pytest.raises(ValueError, match=r"Invalid param: tensor of shape"):
        optim.step_param(torch.ones(2), torch.ones(2))
