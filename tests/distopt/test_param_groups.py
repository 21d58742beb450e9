"""Param groups as torch.optim's: per-group options, ``param_groups``, changes at the next step."""

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer, DistributedOptimizerError, owner
from functional import functional_optim_map
from tests.distopt import harness, remote

# (class, defaults, options of group 0, options of group 1, changes made after step 2)
CASES = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, {}, {"lr": 0.05, "weight_decay": 0.01},
     {"lr": 0.02, "momentum": 0.5, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 0.01}, {"betas": (0.8, 0.99)}, {"lr": 0.02, "weight_decay": 0.1},
     {"lr": 0.005, "betas": (0.5, 0.9), "weight_decay": 0.0, "eps": 1e-6}),
    (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True}, {}, {"lr": 0.03},
     {"lr": 0.001, "betas": (0.7, 0.95), "weight_decay": 0.5}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}, {"alpha": 0.9}, {"lr": 0.005},
     {"lr": 0.02, "momentum": 0.1, "weight_decay": 0.01}),
]
IDS = [c[0].__name__ for c in CASES]


def run_case(case, monkeypatch, functional: bool) -> None:
    cls, defaults, opts0, opts1, changes = case
    if not functional:
        monkeypatch.delitem(functional_optim_map, cls)
    rrefs, local = harness.make_params()
    dist_opt = DistributedOptimizer(cls, harness.grouped(rrefs, [opts0, opts1]), **defaults)
    ref = cls(harness.grouped(local, [opts0, opts1]), **defaults)
    assert dist_opt.is_functional_optim is functional

    # The same keys and values as torch.optim's groups.
    for got, want in zip(dist_opt.param_groups, ref.param_groups):
        for key, value in want.items():
            if key == "params":
                continue
            if key == "decoupled_weight_decay" and functional:
                continue  # functional AdamW does not carry torch's internal flag
            assert key in got, key
            assert tuple(got[key]) == tuple(value) if isinstance(value, (tuple, list)) else (
                got[key] == value), (key, got[key], value)
    assert dist_opt.defaults.keys() >= {"lr"}

    def change(step: int, ctx: int) -> None:
        if step == 2:
            for group in (dist_opt.param_groups[1], ref.param_groups[1]):
                group.update(changes)
            dist_opt.param_groups[0]["lr"] *= 0.5
            ref.param_groups[0]["lr"] *= 0.5

    harness.train(dist_opt, ref, rrefs, local, 5, before_step=change)
    harness.assert_params_equal(rrefs, local, cls.__name__)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_groups_match_torch_optim_compiled(world, monkeypatch, case):
    run_case(case, monkeypatch, functional=True)


@pytest.mark.parametrize("case", CASES[:2], ids=IDS[:2])
def test_groups_match_torch_optim_eager(world, monkeypatch, case):
    run_case(case, monkeypatch, functional=False)


def test_change_costs_no_extra_round(world, rpc_calls):
    rrefs = [rpc.remote(o, remote.make_ones, args=((4,),)) for o in ("worker1", "worker2")]
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    remote.sum_step(opt, rrefs)
    del rpc_calls[:]
    opt.param_groups[0]["lr"] = 0.25
    remote.sum_step(opt, rrefs)
    assert [c[1] for c in rpc_calls] == [owner.step_local_optimizer] * 2
    assert all(c[2][2] == [(0, "lr", 0.25)] for c in rpc_calls)
    for r in rrefs:  # 1 - 1.0 - 0.25
        got = rpc.rpc_sync(r.owner(), remote.value, args=(r,))
        assert torch.equal(got, torch.full((4,), -0.25))
    del rpc_calls[:]
    remote.sum_step(opt, rrefs)  # nothing changed: nothing piggybacked
    assert all(len(c[2]) == 2 for c in rpc_calls)


def test_fixed_hyperparameter_change_fails_before_any_owner(world, rpc_calls):
    [rref] = [rpc.remote("worker1", remote.make_ones, args=((4,),))]
    opt = DistributedOptimizer(torch.optim.Adam, [rref], lr=1.0)
    opt.param_groups[0]["amsgrad"] = True
    del rpc_calls[:]
    with dist_autograd.context() as ctx:
        with pytest.raises(ValueError, match=r"Invalid param_groups\[0\]\['amsgrad'\]: True"):
            opt.step(ctx)
    assert rpc_calls == []


@pytest.mark.parametrize(
    "params, error, match",
    [
        ([{"lr": 0.1}], ValueError, r"Invalid params_rref\[0\]: keys \['lr'\]"),
        ([{"params": []}], ValueError, r"Invalid params_rref\[0\]\['params'\]: \[\]"),
        ([{"params": [torch.ones(2)]}], TypeError, r"Invalid params_rref\[0\]\['params'\]\[0\]"),
    ],
    ids=["no-params", "empty", "tensor"],
)
def test_bad_groups_fail_before_any_owner(world, rpc_calls, params, error, match):
    with pytest.raises(error, match=match):
        DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    assert rpc_calls == []


def test_positional_arguments_and_group_options(world):
    # lr given positionally is the default; a group's own lr wins.
    rrefs, local = harness.make_params()
    opt = DistributedOptimizer(
        torch.optim.SGD, harness.grouped(rrefs, [{}, {"lr": 0.5}]), 0.1, 0.9
    )
    ref = torch.optim.SGD(harness.grouped(local, [{}, {"lr": 0.5}]), 0.1, 0.9)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.9]
    harness.train(opt, ref, rrefs, local, 2)
    harness.assert_params_equal(rrefs, local)


def test_is_a_torch_optimizer_and_zero_grad_does_nothing(world):
    [rref] = [rpc.remote("worker1", remote.make_ones, args=((4,),))]
    opt = DistributedOptimizer(torch.optim.SGD, [rref], lr=1.0)
    assert isinstance(opt, torch.optim.Optimizer)
    opt.zero_grad()
    opt.zero_grad(set_to_none=False)
    remote.sum_step(opt, [rref])
    assert torch.equal(rpc.rpc_sync("worker1", remote.value, args=(rref,)), torch.zeros(4))
    with pytest.raises(NotImplementedError):
        opt.add_param_group({"params": [rref]})


# ---------------------------------------------------------------- edits it cannot follow

# name -> (edit of param_groups, given an RRef the optimizer was not built with; what the
# error must say). Groups: 0 holds parameters 0 and 2, group 1 parameters 1 and 3.
PARAMS_ERROR = r"Invalid param_groups\[0\]\['params'\]: changed after construction \("
EDITS = {
    "list-replaced": (lambda g, new: g[0].__setitem__("params", [g[0]["params"][0], new]),
                      PARAMS_ERROR + r"2 parameters, were 2; removed params\[1\]; added "
                      r"params\[1\] \(a parameter it was not built with\)\)"),
    "appended": (lambda g, new: g[0]["params"].append(new),
                 PARAMS_ERROR + r"3 parameters, were 2; added params\[2\]"),
    "popped": (lambda g, new: g[0]["params"].pop(),
               PARAMS_ERROR + r"1 parameter, were 2; removed params\[1\]\)"),
    "item-deleted": (lambda g, new: g[0]["params"].__delitem__(0),
                     PARAMS_ERROR + r"1 parameter, were 2; removed params\[0\]\)"),
    "item-replaced": (lambda g, new: g[0]["params"].__setitem__(1, new),
                      PARAMS_ERROR + r"2 parameters, were 2; removed params\[1\]; added "
                      r"params\[1\]"),
    "moved-from-group-1": (lambda g, new: g[0]["params"].append(g[1]["params"].pop()),
                           PARAMS_ERROR + r"3 parameters, were 2; added params\[2\] "
                           r"\(params\[1\] of param_groups\[1\]\)"),
    "reordered": (lambda g, new: g[0]["params"].reverse(), PARAMS_ERROR + r".*reordered"),
    "group-appended": (lambda g, new: g.append({**g[1], "params": [new]}),
                       r"Invalid param_groups: 3 groups, were 2 \(expected the groups the "
                       r"DistributedOptimizer was built with"),
    "group-deleted": (lambda g, new: g.__delitem__(1), r"Invalid param_groups: 1 groups, were 2"),
    "key-deleted": (lambda g, new: g[1].pop("momentum"),
                    r"Invalid param_groups\[1\]: lacks 'momentum'"),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_param_group_edits_are_refused_before_any_owner(world, rpc_calls, tmp_path, name):
    """torch.optim would step the new parameters; the owners' optimizers cannot: every round
    refuses, naming the group and the change, and once restored training goes on as
    torch.optim's (nothing moved meanwhile)."""
    edit, match = EDITS[name]
    rrefs, local = harness.make_params()
    options = [{}, {"lr": 0.05}]
    opt = DistributedOptimizer(torch.optim.SGD, harness.grouped(rrefs, options), lr=0.1,
                               momentum=0.9)
    ref = torch.optim.SGD(harness.grouped(local, options), lr=0.1, momentum=0.9)
    new = rpc.remote("worker1", remote.make_ones, args=((2,),))

    def edit_then_restore(step: int, ctx: int) -> None:
        if step != 1:
            return
        kept = [dict(g, params=list(g["params"])) for g in opt.param_groups]
        edit(opt.param_groups, new)
        del rpc_calls[:]
        for call in (lambda: opt.step(ctx), opt.state_dict, lambda: opt.save(str(tmp_path)),
                     lambda: opt.clip_grad_norm_(ctx, 1.0), lambda: opt.clip_grad_value_(ctx, 1.0)):
            with pytest.raises(ValueError, match=match):
                call()
        assert rpc_calls == []
        opt.param_groups[:] = kept

    harness.train(opt, ref, rrefs, local, 3, before_step=edit_then_restore)
    harness.assert_params_equal(rrefs, local, name)


def test_keys_the_class_does_not_take_may_come_and_go(world):
    """As torch.optim keeps them: lr schedulers write ``initial_lr``, users tag groups."""
    rrefs, local = harness.make_params()
    opt = DistributedOptimizer(torch.optim.SGD, harness.grouped(rrefs, [{}, {}]), lr=0.1)
    ref = torch.optim.SGD(harness.grouped(local, [{}, {}]), lr=0.1)
    for group in (opt.param_groups[0], ref.param_groups[0]):
        group["name"] = "encoder"
    harness.train(opt, ref, rrefs, local, 2)
    assert opt.state_dict()["param_groups"][0]["name"] == "encoder"
    harness.assert_params_equal(rrefs, local)


def test_a_constructor_keyword_the_groups_lack_is_refused(world, rpc_calls):
    """The owners never hear of a key the groups did not hold (torch.optim would let the
    class read it): adding one of the constructor's keywords is refused, naming it."""
    rrefs = [rpc.remote("worker1", remote.make_ones, args=((4,),))]
    opt = DistributedOptimizer(remote.KeywordSGD, rrefs, lr=0.5)
    assert not opt.is_functional_optim and "trace" not in opt.param_groups[0]
    opt.param_groups[0]["trace"] = True
    del rpc_calls[:]
    with dist_autograd.context() as ctx:
        with pytest.raises(ValueError, match=r"Invalid param_groups\[0\]\['trace'\]: True "
                                             r"\(expected no 'trace': the DistributedOptimizer "
                                             r"was built without it"):
            opt.step(ctx)
    assert rpc_calls == []
    del opt.param_groups[0]["trace"]
    remote.sum_step(opt, rrefs)
    got = rpc.rpc_sync("worker1", remote.value, args=(rrefs[0],))
    assert torch.equal(got, torch.full((4,), 0.5))


def test_one_tensor_twice_is_refused(world, rpc_calls):
    [rref] = [rpc.remote("worker1", remote.make_ones, args=((4,),))]
    other = rpc.remote("worker2", remote.make_ones, args=((4,),))
    with pytest.raises(ValueError, match=r"Invalid params_rref: parameters 0 and 2 are the same "
                                         r"RRef \(expected each parameter once"):
        DistributedOptimizer(torch.optim.SGD, [{"params": [rref, other]}, {"params": [rref]}])
    assert rpc_calls == []
    # Two RRefs to one tensor: only its owner can tell.
    again = rpc.remote("worker1", remote.same_tensor, args=(rref,))
    with pytest.raises(DistributedOptimizerError, match=r"parameters 0 and 1 are the same tensor"):
        DistributedOptimizer(torch.optim.SGD, [rref, again], lr=0.1)


@pytest.mark.parametrize("cls, key", [
    (torch.optim.Adam, "lr"), (torch.optim.Adam, "betas"), (torch.optim.SGD, "momentum"),
], ids=["Adam-lr", "Adam-betas", "SGD-momentum"])
def test_tensors_given_are_kept_and_read_at_every_step(world, cls, key):
    """A Tensor hyper-parameter given to the constructor (lr, betas, momentum) is the very
    object in ``param_groups``, as torch.optim keeps it: changed in place, it reaches the
    owners at the next step, and the steps stay equal to torch.optim's."""
    rrefs, local = harness.make_params()

    def given():
        if key == "betas":
            return {"lr": 0.01, "betas": (torch.tensor(0.9), torch.tensor(0.999))}
        return {"lr": torch.tensor(0.01)} if key == "lr" else {"lr": 0.1, "momentum": torch.tensor(0.9)}

    mine, theirs = given(), given()
    dist_opt = DistributedOptimizer(cls, rrefs, **mine)
    ref = cls(local, **theirs)
    held = dist_opt.param_groups[0][key]
    if key == "betas":
        assert held[0] is mine["betas"][0] and held[1] is mine["betas"][1]
    else:
        assert held is mine[key]
    harness.train(dist_opt, ref, rrefs, local, 2)
    for values in (mine, theirs):
        (values["betas"][0] if key == "betas" else values[key]).fill_(0.5)
    harness.train(dist_opt, ref, rrefs, local, 3, first_step=2)
    harness.assert_params_equal(rrefs, local, f"after the Tensor {key} changed in place")
