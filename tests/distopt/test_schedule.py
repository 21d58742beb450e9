"""HyperparameterScheduler against a torch.optim run whose values are set by hand each epoch.

Each case builds the same optimizer (two param groups) twice over copies of the same
parameters, with the same torch LR scheduler on both; one has its key scheduled, the other
gets ``initial * fn(epoch)`` written by hand. Values must agree at every epoch and the
parameters bit for bit at the end.
"""
import copy
import inspect
import math
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch.optim import lr_scheduler

from distopt import DistributedOptimizer
from distopt.schedule import HyperparameterScheduler
from tests.distopt import harness

STEPS = 6
SHAPES = ((3, 4), (5,), (2, 2), (6,))
T = torch.tensor
FNS = [lambda e: 0.95 ** e, lambda e: 1.0 / (1 + e)]

# name -> (class, defaults, options of group 1, key, index, fn: one or one per group)
CASES: Dict[str, Any] = {
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, {"momentum": 0.5},
                     "momentum", None, FNS),
    "SGD-momentum-one-fn": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, {}, "momentum",
                            None, FNS[1]),
    "SGD-weight_decay": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5, "weight_decay": 0.01},
                         {"weight_decay": 0.1}, "weight_decay", None, FNS),
    "AdamW-weight_decay": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, {},
                           "weight_decay", None, FNS),
    "Adam-beta1": (torch.optim.Adam, {"lr": 0.01}, {"betas": (0.8, 0.99)}, "betas", 0, FNS),
    "Adam-beta2": (torch.optim.Adam, {"lr": 0.01}, {"betas": (0.8, 0.99)}, "betas", 1, FNS),
    "Adam-eps": (torch.optim.Adam, {"lr": 0.01, "eps": 1e-3}, {}, "eps", None, FNS),
    "RMSprop-momentum": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9}, {"momentum": 0.7},
                         "momentum", None, FNS),
    # Tensor values: torch.optim's defaults give both groups the same tensor object.
    "SGD-momentum-tensor": (torch.optim.SGD, {"lr": 0.1, "momentum": T(0.9)}, {}, "momentum",
                            None, FNS),
    "SGD-momentum-float64-tensor": (
        torch.optim.SGD, {"lr": 0.1, "momentum": T(0.9, dtype=torch.float64)}, {}, "momentum",
        None, FNS),
    "AdamW-weight_decay-tensor": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": T(0.1)}, {},
                                  "weight_decay", None, FNS),
    "Adam-beta1-tensor": (torch.optim.Adam, {"lr": 0.01, "betas": (T(0.9), T(0.999))}, {},
                          "betas", 0, FNS),
    "RMSprop-momentum-tensor": (torch.optim.RMSprop, {"lr": 0.01, "momentum": T(0.9)}, {},
                                "momentum", None, FNS),
}


def make_params(seed: int = 0) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_(True) for s in SHAPES]


def groups(params: List[torch.Tensor], opts1: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [{"params": params[:2]}, {"params": params[2:], **opts1}]


def set_grads(params: List[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def element(value: Any, index: Optional[int]) -> Any:
    return value if index is None else value[index]


def set_by_hand(opt, key: str, index: Optional[int], initials: List[Any], fns, epoch: int):
    """What the scheduler should do, written out: a new value (or tensor) per group."""
    for group, initial, fn in zip(opt.param_groups, initials, fns):
        new = element(initial, index) * fn(epoch)
        if index is None:
            group[key] = new
        else:
            items = list(group[key])
            items[index] = new
            group[key] = tuple(items)


def assert_same_value(got: Any, want: Any, what: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, (what, got, want)
        assert torch.equal(got, want), (what, got, want)
    else:
        assert not isinstance(got, torch.Tensor) and got == want, (what, got, want)


def assert_groups_match(opt, ref, key: str, what: str) -> None:
    for g, (a, b) in enumerate(zip(opt.param_groups, ref.param_groups)):
        if isinstance(b[key], tuple):
            assert isinstance(a[key], tuple) and len(a[key]) == len(b[key]), (what, a[key])
            for i, (x, y) in enumerate(zip(a[key], b[key])):
                assert_same_value(x, y, f"{what} group {g} {key}[{i}]")
        else:
            assert_same_value(a[key], b[key], f"{what} group {g} {key}")
        assert a["lr"] == b["lr"], (what, g)


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_matches_values_set_by_hand(name):
    cls, defaults, opts1, key, index, fn = CASES[name]
    params, ref_params = make_params(), make_params()
    opt = cls(groups(params, opts1), **copy.deepcopy(defaults))
    ref = cls(groups(ref_params, opts1), **copy.deepcopy(defaults))
    fns = fn if isinstance(fn, list) else [fn, fn]
    initials = [copy.deepcopy(g[key]) for g in ref.param_groups]
    tensor_before = [element(g[key], index) for g in opt.param_groups]

    lrs, ref_lrs = lr_scheduler.ExponentialLR(opt, 0.8), lr_scheduler.ExponentialLR(ref, 0.8)
    sched = HyperparameterScheduler(opt, key, fn, index=index)
    set_by_hand(ref, key, index, initials, fns, 0)
    assert_groups_match(opt, ref, key, "epoch 0")
    for group, initial in zip(opt.param_groups, initials):
        assert_same_value(group[f"initial_{key}"], initial, "initial")

    seen = set()
    for step in range(STEPS):
        set_grads(params, step)
        set_grads(ref_params, step)
        opt.step()
        ref.step()
        lrs.step()
        ref_lrs.step()
        sched.step()
        set_by_hand(ref, key, index, initials, fns, step + 1)
        assert_groups_match(opt, ref, key, f"epoch {step + 1}")
        last = sched.get_last_value()
        for g, group in enumerate(ref.param_groups):
            assert_same_value(last[g], element(group[key], index), f"get_last_value {g}")
        seen.add(tuple(float(v) for v in last))
    assert len(seen) == STEPS  # the values did move
    assert sched.last_epoch == STEPS
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert torch.equal(p, q), (name, i)

    after = [element(g[key], index) for g in opt.param_groups]
    if isinstance(tensor_before[0], torch.Tensor):
        # Filled in place; the tensor both groups shared was split into one per group.
        assert after[0] is tensor_before[0]
        assert after[1] is not after[0]
        assert [t.dtype for t in after] == [t.dtype for t in tensor_before]
    if index is not None:  # the other element is kept
        other = 1 - index
        for group, initial in zip(opt.param_groups, initials):
            assert_same_value(group[key][other], initial[other], "unscheduled element")


def test_two_schedulers_on_both_betas():
    params, ref_params = make_params(), make_params()
    opt = torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.999))
    ref = torch.optim.Adam(ref_params, lr=0.01, betas=(0.9, 0.999))
    beta1 = HyperparameterScheduler(opt, "betas", lambda e: 1 - 0.1 * e / STEPS, index=0)
    beta2 = HyperparameterScheduler(opt, "betas", lambda e: 0.99 ** e, index=1)
    for step in range(STEPS):
        ref.param_groups[0]["betas"] = (0.9 * (1 - 0.1 * step / STEPS), 0.999 * 0.99 ** step)
        assert opt.param_groups[0]["betas"] == ref.param_groups[0]["betas"], step
        set_grads(params, step)
        set_grads(ref_params, step)
        opt.step()
        ref.step()
        beta1.step()
        beta2.step()
    assert opt.param_groups[0]["initial_betas"] == (0.9, 0.999)
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


class Decay:
    """A callable object: its ``__dict__`` goes into the scheduler's state_dict."""

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def __call__(self, epoch: int) -> float:
        return self.rate ** epoch


def test_state_dict_round_trip_resumes_exactly():
    def build(params):
        opt = torch.optim.SGD(groups(params, {"momentum": 0.5}), lr=0.1, momentum=0.9)
        return opt, lr_scheduler.StepLR(opt, 2, 0.5)

    fns = [Decay(0.9), lambda e: 1.0 / (1 + e)]
    # Uninterrupted: 2 * STEPS steps.
    params = make_params()
    opt, lrs = build(params)
    sched = HyperparameterScheduler(opt, "momentum", fns)
    history = []
    for step in range(2 * STEPS):
        set_grads(params, step)
        opt.step()
        lrs.step()
        sched.step()
        history.append(sched.get_last_value())

    # Interrupted after STEPS, saved, rebuilt (schedulers first, as torch advises), resumed.
    params_a = make_params()
    opt_a, lrs_a = build(params_a)
    sched_a = HyperparameterScheduler(opt_a, "momentum", [Decay(0.9), fns[1]])
    for step in range(STEPS):
        set_grads(params_a, step)
        opt_a.step()
        lrs_a.step()
        sched_a.step()
    saved = copy.deepcopy(
        (opt_a.state_dict(), lrs_a.state_dict(), sched_a.state_dict(),
         [p.detach() for p in params_a])
    )
    assert saved[2]["fns"] == [{"rate": 0.9}, None]
    assert saved[2]["last_epoch"] == STEPS

    params_b = [p.clone().requires_grad_(True) for p in saved[3]]
    opt_b, lrs_b = build(params_b)
    decay_b = Decay(0.1)  # its rate comes back from the state_dict
    sched_b = HyperparameterScheduler(opt_b, "momentum", [decay_b, fns[1]])
    opt_b.load_state_dict(saved[0])
    lrs_b.load_state_dict(saved[1])
    sched_b.load_state_dict(saved[2])
    assert decay_b.rate == 0.9
    assert sched_b.get_last_value() == history[STEPS - 1]
    assert [g["momentum"] for g in opt_b.param_groups] == history[STEPS - 1]
    for step in range(STEPS, 2 * STEPS):
        set_grads(params_b, step)
        opt_b.step()
        lrs_b.step()
        sched_b.step()
        assert sched_b.get_last_value() == history[step], step
    for p, q in zip(params_b, params):
        assert torch.equal(p, q)


def test_resume_with_last_epoch_applies_the_next_epoch():
    opt = torch.optim.SGD(make_params(), lr=0.1, momentum=0.9)
    HyperparameterScheduler(opt, "momentum", lambda e: 0.5 ** e)
    opt.param_groups[0]["momentum"] = 0.123  # whatever it is now, the initial value counts
    sched = HyperparameterScheduler(opt, "momentum", lambda e: 0.5 ** e, last_epoch=2)
    assert sched.last_epoch == 3
    assert opt.param_groups[0]["momentum"] == 0.9 * 0.5 ** 3


def test_numpy_factor_writes_a_python_float():
    opt = torch.optim.SGD(make_params(), lr=0.1, momentum=0.5)
    HyperparameterScheduler(opt, "momentum", lambda e: np.float32(0.5))
    assert type(opt.param_groups[0]["momentum"]) is float
    assert opt.param_groups[0]["momentum"] == 0.25


def test_load_state_dict_of_another_key_raises():
    opt = torch.optim.SGD(make_params(), lr=0.1, momentum=0.9, weight_decay=0.1)
    momentum = HyperparameterScheduler(opt, "momentum", lambda e: 0.5 ** e)
    decay = HyperparameterScheduler(opt, "weight_decay", lambda e: 0.5 ** e)
    before = decay.state_dict()
    with pytest.raises(ValueError, match=r"Invalid state_dict\['key'\]: 'momentum' \(expected "
                                         r"'weight_decay'"):
        decay.load_state_dict(momentum.state_dict())
    assert decay.state_dict() == before


# ---------------------------------------------------------------- bad input


def sgd(**kwargs: Any) -> torch.optim.Optimizer:
    params = make_params()
    return torch.optim.SGD(groups(params, {"momentum": 0.5}), lr=0.1, momentum=0.9, **kwargs)


def adam() -> torch.optim.Optimizer:
    return torch.optim.Adam(groups(make_params(), {}), lr=0.01)


def with_custom_key() -> torch.optim.Optimizer:
    opt = sgd()
    opt.param_groups[0]["custom"] = 1.0
    return opt


def with_scalar_initial_betas() -> torch.optim.Optimizer:
    opt = adam()
    opt.param_groups[1]["initial_betas"] = 0.9
    return opt


def ok(e: int) -> float:
    return 0.5


# name -> (optimizer factory, scheduler arguments, error, message pattern)
BAD: Dict[str, Any] = {
    "not an optimizer": (lambda: sgd().param_groups, ("momentum", ok), TypeError,
                         r"Invalid optimizer: list \(expected a torch.optim.Optimizer\)"),
    "key not a str": (sgd, (3, ok), TypeError, r"Invalid key: 3 \(expected a str"),
    "key lr": (sgd, ("lr", ok), ValueError,
               r"Invalid key: 'lr' \(expected .*torch.optim.lr_scheduler"),
    "key params": (sgd, ("params", ok), ValueError, r"Invalid key: 'params' \(expected"),
    "key missing": (sgd, ("bogus", ok), ValueError,
                    r"Invalid key: 'bogus' \(expected a key of every param group; "
                    r"param_groups\[0\] has \[.*'momentum'"),
    "key missing in group 1": (with_custom_key, ("custom", ok), ValueError,
                               r"Invalid key: 'custom' .*param_groups\[1\]"),
    "key not numeric": (sgd, ("nesterov", ok), ValueError,
                        r"Invalid key: 'nesterov' \(expected a numeric .* holds False\)"),
    "fn not callable": (sgd, ("momentum", 0.5), TypeError, r"Invalid fn: 0.5 \(expected"),
    "fn list too short": (sgd, ("momentum", [ok]), ValueError,
                          r"Invalid fn: a list of 1 \(expected 2, one per param group\)"),
    "fn list too long": (sgd, ("momentum", [ok, ok, ok]), ValueError,
                         r"Invalid fn: a list of 3 \(expected 2"),
    "fn list holds a number": (sgd, ("momentum", [ok, 2.0]), TypeError,
                               r"Invalid fn\[1\]: 2.0 \(expected a callable"),
    "index for a scalar": (sgd, ("momentum", ok, 0), ValueError,
                           r"Invalid index: 0 \(expected None: param_groups\[0\]\['momentum'\]"),
    "index missing for a tuple": (adam, ("betas", ok), ValueError,
                                  r"Invalid index: None \(expected .*'betas'.* 0 to 1\)"),
    "index out of range": (adam, ("betas", ok, 2), ValueError,
                           r"Invalid index: 2 \(expected 0 to 1"),
    "index negative": (adam, ("betas", ok, -1), ValueError, r"Invalid index: -1 \(expected 0 to 1"),
    "index not an int": (adam, ("betas", ok, "0"), TypeError,
                         r"Invalid index: '0' \(expected an int or None\)"),
    "initial value of another kind": (
        with_scalar_initial_betas, ("betas", ok, 0), ValueError,
        r"Invalid param_groups\[1\]\['initial_betas'\]: 0.9 \(expected the initial value of "
        r"\(0.9, 0.999\)"),
    "last_epoch below -1": (sgd, ("momentum", ok, None, -2), ValueError,
                            r"Invalid last_epoch: -2 \(expected >= -1\)"),
    "last_epoch not an int": (sgd, ("momentum", ok, None, 1.0), TypeError,
                              r"Invalid last_epoch: 1.0 \(expected an int"),
    "last_epoch without initial values": (
        sgd, ("momentum", ok, None, 3), ValueError,
        r"Invalid last_epoch: 3 \(expected -1: param_groups\[0\] holds no 'initial_momentum'"),
    "factor nan": (sgd, ("momentum", lambda e: math.nan), ValueError,
                   r"Invalid fn\[0\]\(0\): nan \(expected a finite real number"),
    "factor inf in group 1 only": (sgd, ("momentum", [ok, lambda e: math.inf]), ValueError,
                                   r"Invalid fn\[1\]\(0\): inf \(expected a finite real number"),
    "factor a str": (sgd, ("momentum", lambda e: "0.5"), TypeError,
                     r"Invalid fn\[0\]\(0\): '0.5' \(expected a finite real number"),
    "factor None": (sgd, ("momentum", [ok, lambda e: None]), TypeError,
                    r"Invalid fn\[1\]\(0\): None \(expected a finite real number"),
    "factor a tensor": (sgd, ("momentum", lambda e: torch.tensor(0.5)), TypeError,
                        r"Invalid fn\[0\]\(0\): tensor\(0.5000\) \(expected a finite real"),
}


def snapshot(opt: Any) -> List[Dict[str, Any]]:
    groups = opt.param_groups if isinstance(opt, torch.optim.Optimizer) else opt
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_raises_and_changes_nothing(name):
    make, args, error, pattern = BAD[name]
    opt = make()
    before = copy.deepcopy(snapshot(opt))
    with pytest.raises(error, match=pattern):
        HyperparameterScheduler(opt, *args)
    assert snapshot(opt) == before


@pytest.mark.parametrize("bad", [math.nan, -math.inf, "x"], ids=["nan", "-inf", "str"])
def test_bad_factor_at_step_writes_no_group(bad):
    opt = sgd(weight_decay=0.1)
    factors: Dict[int, Callable[[int], Any]] = {}
    fns = [lambda e: 0.5 ** e, lambda e: factors.get(e, lambda e: 0.9 ** e)(e)]
    sched = HyperparameterScheduler(opt, "momentum", fns)
    sched.step()
    factors[2] = lambda e: bad
    before, last = copy.deepcopy(snapshot(opt)), sched.get_last_value()
    error = TypeError if isinstance(bad, str) else ValueError
    with pytest.raises(error, match=rf"Invalid fn\[1\]\(2\): {bad!r}"):
        sched.step()
    assert snapshot(opt) == before  # group 0's value was computed but not written
    assert sched.last_epoch == 1 and sched.get_last_value() == last


def test_new_param_group_after_construction_raises_at_step():
    opt = sgd()
    sched = HyperparameterScheduler(opt, "momentum", FNS)
    opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    before = copy.deepcopy(snapshot(opt))
    with pytest.raises(ValueError, match=r"Invalid optimizer.param_groups: 3 groups "
                                         r"\(expected 2"):
        sched.step()
    assert snapshot(opt) == before


# ---------------------------------------------------------------- values the class refuses

O = torch.optim
BETA1 = r"Invalid betas\[0\] for param_groups\[1\]: 1.08\d* from HyperparameterScheduler "
# name -> (class, defaults, key, index, group 1's factor at epoch 1, message pattern)
OUT_OF_RANGE: Dict[str, Any] = {
    "Adam-beta1": (O.Adam, {"lr": 0.01}, "betas", 0, 1.2,
                   BETA1 + r"\(expected in \[0, 1\), as torch.optim.Adam requires\)$"),
    "Adam-beta1-tensor": (O.Adam, {"lr": 0.01, "betas": (T(0.9), T(0.999))}, "betas", 0, 1.2,
                          BETA1 + r"\(expected in \[0, 1\), as torch.optim.Adam requires\)$"),
    "AdamW-beta2": (O.AdamW, {"lr": 0.01}, "betas", 1, 1.01,
                    r"Invalid betas\[1\] for param_groups\[1\]: 1.00\d* .*expected in \[0, 1\), "
                    r"as torch.optim.AdamW requires"),
    "Adam-eps": (O.Adam, {"lr": 0.01}, "eps", None, -1.0,
                 r"Invalid eps for param_groups\[1\]: -1e-08 .*expected >= 0.0, as "
                 r"torch.optim.Adam requires"),
    "SGD-weight_decay": (O.SGD, {"lr": 0.1, "weight_decay": 0.01}, "weight_decay", None, -1.0,
                         r"Invalid weight_decay for param_groups\[1\]: -0.01 .*expected >= 0.0"),
    "SGD-nesterov-momentum": (O.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "momentum",
                              None, 0.0, r"Invalid momentum for param_groups\[1\]: 0.0 .*expected "
                              r"momentum > 0 and dampening == 0, as torch.optim.SGD requires"),
    "RMSprop-alpha": (O.RMSprop, {"lr": 0.01}, "alpha", None, -1.0,
                      r"Invalid alpha for param_groups\[1\]: -0.99 .*expected >= 0.0"),
    "Adadelta-rho": (O.Adadelta, {"lr": 1.0}, "rho", None, 1.2,
                     r"Invalid rho for param_groups\[1\]: 1.08 .*expected in \[0.0, 1.0\], as "
                     r"torch.optim.Adadelta requires"),
    "Rprop-etas": (O.Rprop, {"lr": 0.01}, "etas", 0, 2.5,
                   r"Invalid etas\[0\] for param_groups\[1\]: 1.25 .*expected 0 < etas\[0\] < 1 "
                   r"< etas\[1\], as torch.optim.Rprop requires"),
    "Adagrad-lr_decay": (O.Adagrad, {"lr": 0.1, "lr_decay": 0.1}, "lr_decay", None, -1.0,
                         r"Invalid lr_decay for param_groups\[1\]: -0.1 .*expected >= 0.0"),
    "NAdam-momentum_decay": (O.NAdam, {"lr": 0.01}, "momentum_decay", None, -1.0,
                             r"Invalid momentum_decay for param_groups\[1\]: -0.004 "
                             r".*expected >= 0"),
    "Adafactor-beta2_decay": (O.Adafactor, {"lr": 0.01}, "beta2_decay", None, -1.0,
                              r"Invalid beta2_decay for param_groups\[1\]: 0.8 .*expected <= 0.0, "
                              r"as torch.optim.Adafactor requires"),
}


def _fns(factor: float) -> List[Callable[[int], float]]:
    """Group 0 moves too (so a half-written step would show), group 1 leaves the range."""
    return [lambda e: 0.5 ** e, lambda e: factor if e >= 1 else 1.0]


def _constructor_values(cls: type, group: Dict[str, Any]) -> Dict[str, Any]:
    names = inspect.signature(cls).parameters
    return {k: v for k, v in group.items() if k in names and k != "params"}


@pytest.mark.parametrize("name", list(OUT_OF_RANGE))
def test_values_the_class_refuses_are_refused_before_any_group_is_written(name):
    cls, defaults, key, index, factor, pattern = OUT_OF_RANGE[name]
    opt = cls(groups(make_params(), {}), **defaults)
    sched = HyperparameterScheduler(opt, key, _fns(factor), index)
    before = copy.deepcopy(snapshot(opt))
    with pytest.raises(ValueError, match=pattern):
        sched.step()
    assert snapshot(opt) == before and sched.last_epoch == 0
    # torch.optim's own constructor refuses the value the scheduler would have written.
    wanted = _constructor_values(cls, opt.param_groups[1])
    base = element(opt.param_groups[1][key], index)
    new = base * factor
    wanted[key] = new if index is None else tuple(
        new if i == index else v for i, v in enumerate(wanted[key]))
    with pytest.raises(ValueError):
        cls([torch.zeros(2, 2, requires_grad=True)], **wanted)


# name -> (class, defaults, key, index, factor): torch.optim's constructors set no bound here.
ACCEPTED_BY_TORCH: Dict[str, Any] = {
    "SGD-momentum-1.8": (O.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum", None, 2.0),
    "RMSprop-alpha-1.49": (O.RMSprop, {"lr": 0.01}, "alpha", None, 1.5),
    "Rprop-step_sizes": (O.Rprop, {"lr": 0.01}, "step_sizes", 1, 1e-9),
    "ASGD-lambd": (O.ASGD, {"lr": 0.01}, "lambd", None, -1.0),
}


@pytest.mark.parametrize("name", list(ACCEPTED_BY_TORCH))
def test_values_torch_accepts_are_written(name):
    cls, defaults, key, index, factor = ACCEPTED_BY_TORCH[name]
    opt = cls(groups(make_params(), {}), **defaults)
    sched = HyperparameterScheduler(opt, key, _fns(factor), index)
    sched.step()
    written = opt.param_groups[1][key]
    assert element(written, index) == element(opt.param_groups[1][f"initial_{key}"], index) * factor
    cls([torch.zeros(2, 2, requires_grad=True)], **_constructor_values(cls, opt.param_groups[1]))


class CappedSGD(torch.optim.SGD):
    """A user's class with a range of its own: momentum at most 0.95."""

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.5) -> None:
        if momentum > 0.95:
            raise ValueError(f"momentum {momentum} is above 0.95")
        super().__init__(params, lr=lr, momentum=momentum)


def test_a_users_class_refuses_with_its_own_words():
    opt = CappedSGD(groups(make_params(), {}), momentum=0.9)
    sched = HyperparameterScheduler(opt, "momentum", _fns(1.1))
    before = copy.deepcopy(snapshot(opt))
    pattern = (r"Invalid momentum for param_groups\[1\]: 0.99\d* from HyperparameterScheduler "
               r"\(expected a value CappedSGD accepts; it raises ValueError: momentum 0.99\d* "
               r"is above 0.95")
    with pytest.raises(ValueError, match=pattern):
        sched.step()
    assert snapshot(opt) == before


# ---------------------------------------------------------------- DistributedOptimizer


def test_distributed_optimizer_momentum_and_weight_decay(world):
    options = [{}, {"momentum": 0.5, "weight_decay": 0.1}]
    kwargs = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
    rrefs, local = harness.make_params()
    dist_opt = DistributedOptimizer(torch.optim.SGD, harness.grouped(rrefs, options), **kwargs)
    # The owners step SGD on torch's fused CPU kernel by default: bit for bit with fused=True.
    ref = torch.optim.SGD(harness.grouped(local, options), fused=True, **kwargs)
    momentum = HyperparameterScheduler(dist_opt, "momentum", FNS)
    decay = HyperparameterScheduler(dist_opt, "weight_decay", lambda e: 2.0 ** -e)
    initial = [(g["momentum"], g["weight_decay"]) for g in ref.param_groups]

    def by_hand(epoch: int) -> None:
        for group, (m, wd), fn in zip(ref.param_groups, initial, FNS):
            group["momentum"] = m * fn(epoch)
            group["weight_decay"] = wd * 2.0 ** -epoch

    by_hand(0)
    for step in range(4):
        for key in ("momentum", "weight_decay"):
            got = [g[key] for g in dist_opt.param_groups]
            assert got == [g[key] for g in ref.param_groups], (step, key)
        with dist_autograd.context() as ctx:
            harness.backward(step, rrefs, local, ctx)
            dist_opt.step(ctx)
        ref.step()
        momentum.step()
        decay.step()
        by_hand(step + 1)
        for i, (got, want) in enumerate(zip(harness.values(rrefs), local)):
            torch.testing.assert_close(
                got, want.detach(), rtol=0, atol=0,
                msg=lambda m, i=i: f"step {step} parameter {i} on {harness.OWNERS[i]}: {m}",
            )


def test_distributed_optimizer_refuses_what_its_class_refuses(world):
    rrefs, _ = harness.make_params()
    dist_opt = DistributedOptimizer(torch.optim.Adam, harness.grouped(rrefs, [{}, {}]), lr=0.01)
    sched = HyperparameterScheduler(dist_opt, "betas", _fns(1.2), index=0)
    before = copy.deepcopy(snapshot(dist_opt))
    with pytest.raises(ValueError, match=BETA1 + r"\(expected in \[0, 1\), as torch.optim.Adam"):
        sched.step()
    assert snapshot(dist_opt) == before
