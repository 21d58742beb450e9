"""Construction refuses, on the trainer and before any RPC, what torch.optim's constructor
would refuse (in its words, naming the user's class or the argument) and what cannot step."""
import inspect
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer
from functional import FunctionalSGD, functional_optim_map
from tests.distopt import harness, remote
from tests.functional.test_errors import WRONG_TYPES

O = torch.optim
#: Every class compiled on the owners, and one that runs eagerly there (a user's class).
CLASSES = list(functional_optim_map) + [remote.PlainSGD]


@pytest.fixture(scope="module")
def rrefs(world) -> List[rpc.RRef]:
    """Parameters on two owners, never stepped: every test here fails before any RPC."""
    return [rpc.remote(o, remote.make_ones, args=((3, 2),)) for o in ("worker1", "worker2")]


def _positional_defaults(cls: type) -> tuple:
    """The default of each argument after ``params`` that may be given positionally."""
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]
    return tuple(p.default for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)


def _call_cases(cls: type) -> List[Tuple[type, str, tuple, Dict[str, Any]]]:
    defaults = _positional_defaults(cls)
    return [
        (cls, "unknown-keyword", (), {"bogus": 1}),
        (cls, "too-many-positional", defaults + (0.5,), {}),
        (cls, "keyword-twice", defaults[:1], {"lr": defaults[0]}),
    ]


CALL_CASES = [case for cls in CLASSES for case in _call_cases(cls)]


def _python_says(cls: type, args: tuple, kwargs: Dict[str, Any]) -> str:
    """Python's TypeError for the same call of ``cls`` over a local tensor."""
    with pytest.raises(TypeError) as info:
        cls([torch.zeros(3, 2, requires_grad=True)], *args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize(
    "cls, what, args, kwargs", CALL_CASES, ids=[f"{c[0].__name__}-{c[1]}" for c in CALL_CASES]
)
def test_call_that_does_not_fit_the_class_fails_as_python_says(
    rrefs, rpc_calls, cls, what, args, kwargs
):
    expected = _python_says(cls, args, kwargs)
    assert expected.startswith(f"{cls.__name__}.__init__() "), expected
    with pytest.raises(TypeError) as info:
        DistributedOptimizer(cls, rrefs, *args, **kwargs)
    assert str(info.value) == expected
    assert rpc_calls == []


def test_keyword_only_argument_given_positionally_is_refused(rrefs, rpc_calls):
    # maximize is keyword-only in torch.optim.SGD (the functional class would take it).
    args = (0.1, 0.0, 0.0, 0.0, False, True)
    expected = _python_says(O.SGD, args, {})
    with pytest.raises(TypeError) as info:
        DistributedOptimizer(O.SGD, rrefs, *args)
    assert str(info.value) == expected == (
        "SGD.__init__() takes from 2 to 7 positional arguments but 8 were given"
    )
    assert rpc_calls == []


WRONG_TYPES_HERE = WRONG_TYPES + [(remote.PlainSGD, {"lr": "fast"}, "lr", "fast")]


@pytest.mark.parametrize(
    "cls, kwargs, name, value", WRONG_TYPES_HERE,
    ids=[f"{r[0].__name__}-{','.join(f'{k}={v!r}' for k, v in r[1].items())}"
         for r in WRONG_TYPES_HERE],
)
def test_wrong_type_names_the_argument_and_the_value(rrefs, rpc_calls, cls, kwargs, name, value):
    with pytest.raises(TypeError) as info:
        DistributedOptimizer(cls, rrefs, **kwargs)
    assert str(info.value).startswith(f"Invalid {name}: {value!r} (expected ")
    assert rpc_calls == []


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_wrong_type_given_positionally_is_named(rrefs, rpc_calls, cls):
    with pytest.raises(TypeError, match=r"^Invalid lr: 'fast' \(expected a float"):
        DistributedOptimizer(cls, rrefs, "fast")
    assert rpc_calls == []


@pytest.mark.parametrize("cls", [O.Adam, remote.PlainSGD], ids=["compiled", "eager"])
def test_wrong_type_in_a_param_group_names_the_group(rrefs, rpc_calls, cls):
    groups = [{"params": rrefs[:1]}, {"params": rrefs[1:], "lr": "fast"}]
    with pytest.raises(TypeError, match=r"^Invalid params_rref\[1\]\['lr'\]: 'fast' \(expected"):
        DistributedOptimizer(cls, groups, lr=0.1)
    assert rpc_calls == []


# ---------------------------------------------------------------- closures


@pytest.mark.parametrize("cls", [O.LBFGS, remote.ClosureSGD], ids=lambda c: c.__name__)
def test_step_that_needs_a_closure_is_refused_before_any_rpc(rrefs, rpc_calls, cls):
    with pytest.raises(TypeError) as info:
        DistributedOptimizer(cls, rrefs, lr=0.1)
    message = str(info.value)
    assert message.startswith(
        f"Invalid optimizer_class: {cls.__name__} cannot step without 'closure' "
        f"({cls.__name__}.step(self, closure"
    ), message
    assert "DistributedOptimizer.step(context_id) calls step() with no closure" in message
    assert rpc_calls == []


def test_optional_closure_is_accepted(world):
    rrefs = [rpc.remote(o, remote.make_ones, args=((4,),)) for o in ("worker1", "worker2")]
    assert inspect.signature(remote.PlainSGD.step).parameters["closure"].default is None
    optimizer = DistributedOptimizer(remote.PlainSGD, rrefs, lr=0.25)
    assert not optimizer.is_functional_optim
    remote.sum_step(optimizer, rrefs)
    for values in harness.values(rrefs):
        assert torch.equal(values, torch.full((4,), 0.75))


def test_closure_class_with_a_functional_stand_in_is_accepted(world, monkeypatch):
    # Compiled, its own step (which needs a closure) never runs.
    monkeypatch.setitem(functional_optim_map, remote.ClosureSGD, FunctionalSGD)
    rrefs = [rpc.remote(o, remote.make_ones, args=((4,),)) for o in ("worker1", "worker2")]
    optimizer = DistributedOptimizer(remote.ClosureSGD, rrefs, lr=0.25)
    assert optimizer.is_functional_optim
    remote.sum_step(optimizer, rrefs)
    for values in harness.values(rrefs):
        assert torch.equal(values, torch.full((4,), 0.75))


# ---------------------------------------------------------------- what torch.optim takes

# Values of another kind than the annotation's, that torch.optim takes: taken here too, and
# stepped as a local torch.optim optimizer steps.
ACCEPTED = [
    (O.SGD, (0.5,), {"momentum": 1, "nesterov": 1, "maximize": None}),
    (O.Adam, (), {"lr": torch.tensor(0.01), "betas": [0.8, 0.9], "amsgrad": 1}),
    (O.Rprop, (0.01, [0.5, 2], (0, 50)), {}),
    (remote.PlainSGD, (1,), {}),
]


@pytest.mark.parametrize(
    "cls, args, kwargs", ACCEPTED, ids=[f"{r[0].__name__}-{i}" for i, r in enumerate(ACCEPTED)]
)
def test_values_torch_accepts_are_accepted(world, cls, args, kwargs):
    def copy() -> Dict[str, Any]:
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    rrefs, local = harness.make_params(seed=7)
    optimizer = DistributedOptimizer(cls, rrefs, *args, **copy())
    assert optimizer.is_functional_optim == (cls in functional_optim_map)
    reference = cls(local, *args, **copy())
    harness.train(optimizer, reference, rrefs, local, steps=3)
    harness.assert_params_equal(rrefs, local, f"{cls.__name__}{args}{kwargs}")
