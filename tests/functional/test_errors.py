"""Bad input: clear errors that name the argument and the value, as torch.optim rejects it."""
import pytest
import torch

from functional import functional_optim_map, script_optimizer

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
    assert set(functional_optim_map) == expected
    for torch_cls, cls in functional_optim_map.items():
        assert cls.__name__ == "Functional" + torch_cls.__name__


def test_every_class_validates_each_argument_row() -> None:
    """Each mapped class appears in INVALID_ARGS (so a new class cannot skip its checks)."""
    assert {row[0] for row in INVALID_ARGS} == set(functional_optim_map)


def _grad_like(torch_cls: type, p: torch.Tensor) -> torch.Tensor:
    g = torch.ones_like(p)
    return g.to_sparse() if torch_cls is O.SparseAdam else g


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


def test_step_param_updates_only_that_parameter() -> None:
    cls = functional_optim_map[O.SGD]
    a, b = torch.ones(2), torch.ones(2)
    optim = cls([a, b], lr=0.5)
    optim.step_param(b, torch.ones(2))
    assert torch.equal(a, torch.ones(2))
    assert torch.equal(b, torch.full((2,), 0.5))
    with pytest.raises(ValueError, match=r"Invalid param: tensor of shape"):
        optim.step_param(torch.ones(2), torch.ones(2))
