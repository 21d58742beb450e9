"""state_dict / load_state_dict in torch.optim's format, both ways; refusals change nothing."""
import copy
import re
from typing import Any, List

import pytest
import torch
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer, InvalidStateError, state
from functional import functional_optim_map
from tests.distopt import harness
from tests.helpers import assert_identical
from tests.refused_state_dicts import OPTIMIZERS, REFUSED, bad_state_dict
from tests.state_hooks import hooks_seen

# (class, defaults, options of group 0, options of group 1)
CASES = [
    OPTIMIZERS["Adam"],
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, {"nesterov": True}, {"lr": 0.05}),
    (torch.optim.Adagrad, {"lr": 0.1}, {}, {"lr_decay": 0.01}),
    (torch.optim.ASGD, {"lr": 0.05, "t0": 2.0}, {}, {"lambd": 1e-3}),
    OPTIMIZERS["Adafactor"],
]
IDS = [c[0].__name__ for c in CASES]
PATHS = [(c, True) for c in CASES] + [(CASES[0], False), (CASES[1], False)]
PATH_IDS = [f"{i}-compiled" for i in IDS] + [f"{IDS[0]}-eager", f"{IDS[1]}-eager"]


def build(case, rrefs, local):
    cls, defaults, opts0, opts1 = case
    dist_opt = DistributedOptimizer(cls, harness.grouped(rrefs, [opts0, opts1]), **defaults)
    ref = cls(harness.grouped(local, [opts0, opts1]), **defaults)
    return dist_opt, ref


@pytest.mark.parametrize("case, functional", PATHS, ids=PATH_IDS)
def test_round_trips_continue_exactly(world, monkeypatch, case, functional):
    """Three ways in and out, each continuing as the uninterrupted local run does."""
    cls = case[0]
    if not functional:
        monkeypatch.delitem(functional_optim_map, cls)
    rrefs, local = harness.make_params()
    dist_opt, ref = build(case, rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 3)

    # 1. The state_dict equals torch.optim's (global numbering = the order given).
    saved = dist_opt.state_dict()
    harness.assert_state_dicts_equal(saved, ref.state_dict())

    # 2. It loads into a new DistributedOptimizer, which continues as the local one does.
    fresh, _ = build(case, rrefs, [p.detach().clone() for p in local])
    fresh.load_state_dict(saved)
    harness.train(fresh, ref, rrefs, local, 2, first_step=3)
    harness.assert_params_equal(rrefs, local, "after DistributedOptimizer -> DistributedOptimizer")

    # 3. A local torch.optim state_dict loads into a DistributedOptimizer.
    third, _ = build(case, rrefs, [p.detach().clone() for p in local])
    third.load_state_dict(copy.deepcopy(ref.state_dict()))
    harness.train(third, ref, rrefs, local, 2, first_step=5)
    harness.assert_params_equal(rrefs, local, "after torch.optim -> DistributedOptimizer")

    # 4. A DistributedOptimizer's state_dict loads into a local torch.optim optimizer.
    copies = [p.detach().clone().requires_grad_(True) for p in local]
    _, other_ref = build(case, rrefs, copies)
    other_ref.load_state_dict(third.state_dict())
    harness.train(third, other_ref, rrefs, copies, 2, first_step=7)
    harness.assert_params_equal(rrefs, copies, "after DistributedOptimizer -> torch.optim")


def test_hyperparameters_come_back_from_the_state_dict(world):
    rrefs, local = harness.make_params()
    case = CASES[0]
    dist_opt, ref = build(case, rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 1)
    ref.param_groups[1]["lr"] = 0.003
    ref.param_groups[0]["betas"] = (0.5, 0.9)
    dist_opt.load_state_dict(ref.state_dict())
    assert dist_opt.param_groups[1]["lr"] == 0.003
    assert dist_opt.param_groups[0]["betas"] == (0.5, 0.9)
    harness.train(dist_opt, ref, rrefs, local, 2, first_step=1)
    harness.assert_params_equal(rrefs, local)


#: The rows only an owner's optimizer can check (keys, dtypes, 0-dim and factored shapes):
#: parameter 3 lives on worker2, the second owner; worker1 checks fine and must not have
#: changed either.
OWNER_ROWS = ("missing-state-key", "int-buffer", "vector-step", "factored-shape")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_state_dict_changes_nothing(world, monkeypatch, name):
    """Each state_dict of the shared table (tests/refused_state_dicts.py) is refused with a
    ValueError naming what is wrong: on the trainer before any RPC, or (``OWNER_ROWS``) on
    every owner before any owner changes, as one InvalidStateError naming the worker and the
    parameter by the trainer's index. State, hyper-parameters and later steps are as if
    nothing had been offered."""
    row = REFUSED[name]
    rrefs, local = harness.make_params()
    dist_opt, ref = build(OPTIMIZERS[row.optimizer], rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 2)
    before = dist_opt.state_dict()
    bad = bad_state_dict(before, name)
    calls: List[Any] = []
    real = rpc.rpc_async
    monkeypatch.setattr(rpc, "rpc_async", lambda *a, **k: calls.append(a) or real(*a, **k))
    with pytest.raises(ValueError) as info:
        dist_opt.load_state_dict(bad)
    monkeypatch.undo()
    if name in OWNER_ROWS:
        assert isinstance(info.value, InvalidStateError)
        assert list(info.value.failures) == ["worker2"]
        assert re.search(r"worker2: ValueError: " + row.pattern, str(info.value)), info.value
    else:
        assert re.search(row.pattern, str(info.value)), info.value
        assert calls == []
    assert_identical(dist_opt.state_dict(), before)
    harness.train(dist_opt, ref, rrefs, local, 2, first_step=2)
    harness.assert_params_equal(rrefs, local, "after a refused load_state_dict")


@pytest.mark.parametrize("saved", [{"foreach": True}, {"foreach": False}], ids=["foreach", "loop"])
def test_a_state_dict_saved_with_other_kernels_loads(world, saved):
    """foreach / fused choose kernels, not numbers: torch.optim's state_dict saved with either
    loads, the owners keep their compiled kernels, and the steps continue equal to torch's."""
    rrefs, local = harness.make_params()
    cls, defaults, opts0, opts1 = CASES[0]
    dist_opt = DistributedOptimizer(cls, harness.grouped(rrefs, [opts0, opts1]), **defaults)
    ref = cls(harness.grouped(local, [opts0, opts1]), **defaults, **saved)
    harness.train(dist_opt, ref, rrefs, local, 2)
    dist_opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert all(g["foreach"] is None for g in dist_opt.param_groups)
    harness.train(dist_opt, ref, rrefs, local, 2, first_step=2)
    harness.assert_params_equal(rrefs, local, "after loading a foreach state_dict")


@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=["Adam", "SGD"])
def test_a_state_dict_of_an_older_torch_loads(world, case):
    """A state_dict whose groups lack the options added to torch since (``maximize``,
    ``foreach``, ``capturable``, ``differentiable``, ``fused``, ...) loads with their defaults,
    as torch.optim's load_state_dict fills them, and the steps continue equal to torch's."""
    rrefs, local = harness.make_params()
    dist_opt, ref = build(case, rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 2)
    old = copy.deepcopy(ref.state_dict())
    for group in old["param_groups"]:
        for key in ("maximize", "foreach", "capturable", "differentiable", "fused",
                    "decoupled_weight_decay"):
            group.pop(key, None)
    dist_opt.load_state_dict(old)
    harness.train(dist_opt, ref, rrefs, local, 2, first_step=2)
    harness.assert_params_equal(rrefs, local, "after loading an older torch's state_dict")


def test_state_dict_takes_one_rpc_per_owner(world, monkeypatch):
    """One RPC per owner, made before any reply is awaited (fan_out)."""
    rrefs, local = harness.make_params()
    dist_opt, ref = build(CASES[1], rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 1)
    calls: List[Any] = []
    real = rpc.rpc_async
    monkeypatch.setattr(
        rpc, "rpc_async", lambda to, f, **k: calls.append((to, f)) or real(to, f, **k)
    )
    dist_opt.state_dict()
    assert [f for _, f in calls] == [state.local_state] * 2
    assert sorted(to.name for to, _ in calls) == ["worker1", "worker2"]


def test_eager_owner_refuses_a_state_lacking_a_key(world, monkeypatch):
    """The eager path has no template; its own state is the model: a state_dict lacking a key
    it keeps is refused on the owner before any owner changes."""
    case = CASES[0]
    monkeypatch.delitem(functional_optim_map, case[0])
    rrefs, local = harness.make_params()
    dist_opt, ref = build(case, rrefs, local)
    assert not dist_opt.is_functional_optim
    harness.train(dist_opt, ref, rrefs, local, 2)
    before = dist_opt.state_dict()
    bad = copy.deepcopy(before)
    del bad["state"][3]["exp_avg_sq"]
    with pytest.raises(InvalidStateError, match=r"worker2: ValueError: Invalid state\[3\]: no "
                                                r"'exp_avg_sq'"):
        dist_opt.load_state_dict(bad)
    harness.assert_state_dicts_equal(dist_opt.state_dict(), before)
    harness.train(dist_opt, ref, rrefs, local, 1, first_step=2)
    harness.assert_params_equal(rrefs, local)


def test_torch_state_dict_hooks_run_as_torch_optim_runs_them(world):
    """torch.optim's four state-dict hooks, registered on a DistributedOptimizer, run in
    torch's order around its own state_dict / load_state_dict, and what they return is
    used: the same calls and the same result as on the local torch.optim optimizer."""
    rrefs, local = harness.make_params()
    dist_opt, ref = build(CASES[1], rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 2)
    got, expected = hooks_seen(dist_opt), hooks_seen(ref)
    assert got[:3] == expected[:3] == (
        ["pre", "post", "load_pre", "load_post"], "post", ["note", "param_groups", "state"]
    )
    assert got[3].startswith("Invalid add_param_group: a DistributedOptimizer's owners' "
                             "optimizers are fixed at construction")
