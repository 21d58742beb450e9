"""Bad input fails on the trainer before any RPC; owners' failures name the owner."""
import os
import signal
import warnings
from typing import Any, List

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer, DistributedOptimizerError, exclusive, owner
from functional import functional_optim_map
from tests import worlds
from tests.distopt import remote


def ones_on(*owners: str) -> List[rpc.RRef]:
    return [rpc.remote(o, remote.make_ones, args=((4,),)) for o in owners]


# ---------------------------------------------------------------- bad input


def test_empty_params_rref(world, rpc_calls):
    with pytest.raises(ValueError, match=r"Invalid params_rref: \[\]"):
        DistributedOptimizer(torch.optim.SGD, [], lr=0.1)
    assert rpc_calls == []


def test_item_that_is_not_an_rref(world, rpc_calls):
    [rref] = ones_on("worker1")
    with pytest.raises(TypeError, match=r"Invalid params_rref\[1\]: Tensor"):
        DistributedOptimizer(torch.optim.SGD, [rref, torch.ones(2)], lr=0.1)
    assert rpc_calls == []


@pytest.mark.parametrize(
    "bad, named",
    [
        ("SGD", "'SGD'"),
        # one line naming the fix, not the instance's repr (14 lines, one per option)
        (torch.optim.SGD([torch.ones(1, requires_grad=True)]),
         "an instance of SGD (expected the class: pass torch.optim.SGD, not an instance, and "
         "its options as keyword arguments)"),
        (torch.nn.Linear(2, 2), "a Linear module (expected an optimizer class, e.g. "
                                "torch.optim.AdamW, first, then the parameters)"),
        (dict, "dict"),
        # the arguments swapped: DistributedOptimizer(rrefs, torch.optim.SGD)
        ([torch.ones(1)], "these look like the parameters: the class comes first, then them"),
        ((p for p in [torch.ones(1)]), "these look like the parameters: the class comes first"),
    ],
    ids=["string", "instance", "model", "not-an-optimizer", "swapped-list", "swapped-generator"],
)
def test_optimizer_class_that_is_not_an_optimizer(world, rpc_calls, bad, named):
    [rref] = ones_on("worker1")
    with pytest.raises(TypeError, match="Invalid optimizer_class") as info:
        DistributedOptimizer(bad, [rref])
    assert named in str(info.value)
    assert "\n" not in str(info.value)
    assert rpc_calls == []


def test_a_model_for_params_rref_names_the_fix(world, rpc_calls):
    with pytest.raises(TypeError) as info:
        DistributedOptimizer(torch.optim.SGD, torch.nn.Linear(2, 2), lr=0.1)
    assert str(info.value) == (
        "Invalid params_rref: a Linear module (expected an iterable of RRefs: pass "
        "[rpc.RRef(p) for p in model.parameters()] on the parameters' owner)"
    )
    assert rpc_calls == []


@pytest.mark.parametrize("functional", [True, False], ids=["compiled", "eager"])
def test_rejected_arguments_name_every_owner(world, monkeypatch, functional):
    if not functional:
        monkeypatch.delitem(functional_optim_map, torch.optim.SGD)
    rrefs = ones_on("worker1", "worker2")
    with pytest.raises(DistributedOptimizerError) as info:
        DistributedOptimizer(torch.optim.SGD, rrefs, lr=-1.0)
    err = info.value
    assert sorted(err.failures) == ["worker1", "worker2"]
    for name, message in err.failures.items():
        assert message.startswith("ValueError: Invalid")
        assert "-1.0" in message
        assert f"  {name}: {message}" in str(err).splitlines()
    assert isinstance(err.__cause__, ValueError)
    assert isinstance(err, RuntimeError)


# ---------------------------------------------------------------- owner failures


@pytest.mark.parametrize("functional", [True, False], ids=["compiled", "eager"])
def test_constructor_failure_releases_other_owners(world, functional):
    [good] = ones_on("worker1")
    if functional:
        # A functional optimizer rejects worker2's "parameter", a list.
        bad = rpc.remote("worker2", remote.make_list)
        optimizer_class, expected = torch.optim.SGD, "TypeError: Invalid params[0]: list"
    else:
        [bad] = ones_on("worker2")
        optimizer_class, expected = remote.FailOnWorker2, "ValueError: Invalid worker: worker2"
    with pytest.raises(DistributedOptimizerError) as info:
        DistributedOptimizer(optimizer_class, [good, bad], lr=0.1)
    assert list(info.value.failures) == ["worker2"]
    assert info.value.failures["worker2"].startswith(expected)
    assert "worker2: " + expected in str(info.value)
    # worker1 built its local optimizer, then was told to free it.
    assert rpc.rpc_sync("worker1", remote.live_count_for, args=(good,)) == 0

    kept = DistributedOptimizer(remote.PlainSGD, [good], lr=0.1)
    assert rpc.rpc_sync("worker1", remote.live_count_for, args=(good,)) == 1
    del kept


def test_step_failure_names_the_owner_and_others_still_step(world):
    rrefs = ones_on("worker1", "worker2")
    optimizer = DistributedOptimizer(remote.StepFailsOnWorker2, rrefs, lr=1.0)
    with pytest.raises(DistributedOptimizerError) as info:
        remote.sum_step(optimizer, rrefs)
    # an eager class raised inside its step(): no version counter moved, which does not
    # rule out writes through .data, and the message says so ("maybe")
    said = ("RuntimeError: step refused on worker2 (part-way through the step on worker2: the "
            "optimizer raised inside its step(); no parameter's autograd version counter "
            "moved, but changes made through .data move none)")
    assert info.value.failures == {"worker2": said}
    assert info.value.applied == {"worker2": "maybe"}
    lines = str(info.value).splitlines()
    assert lines[1] == f"  worker2: {said}"
    assert "perhaps partly applied on ['worker2'] (see its line)" in lines[2]
    # which owners applied it: the state is mixed, and the message says how to recover
    assert info.value.succeeded == ["worker1"]
    assert lines[2].startswith("  applied on ['worker1']") and "load() the last checkpoint" in lines[2]
    assert isinstance(info.value.__cause__, RuntimeError)
    assert torch.equal(rpc.rpc_sync("worker1", remote.value, args=(rrefs[0],)), torch.zeros(4))
    assert torch.equal(rpc.rpc_sync("worker2", remote.value, args=(rrefs[1],)), torch.ones(4))


@pytest.mark.parametrize(
    "optimizer_class", [torch.optim.SGD, remote.PlainSGD], ids=["compiled", "eager"]
)
def test_finished_context_fails_before_any_owner(world, rpc_calls, optimizer_class):
    rrefs = ones_on("worker1", "worker2")
    optimizer = DistributedOptimizer(optimizer_class, rrefs, lr=1.0)
    with dist_autograd.context() as ctx:
        losses = [rpc.rpc_sync(r.owner(), remote.param_sum, args=(r,)) for r in rrefs]
        dist_autograd.backward(ctx, [torch.stack(losses).sum()])
    del rpc_calls[:]
    with pytest.raises(ValueError, match=rf"Invalid context_id: {ctx} "):
        optimizer.step(ctx)
    with pytest.raises(ValueError, match="Invalid context_id: 123456789 "):
        optimizer.step(123456789)
    with pytest.raises(TypeError, match="Invalid context_id: 'x' "):
        optimizer.step("x")
    assert rpc_calls == []
    for r in rrefs:
        assert torch.equal(rpc.rpc_sync(r.owner(), remote.value, args=(r,)), torch.ones(4))


def test_error_survives_pickling():
    import pickle

    err = DistributedOptimizerError("boom", {"worker1": "ValueError: x"}, ["worker2"])
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == "boom" and back.failures == {"worker1": "ValueError: x"}
    assert back.succeeded == ["worker2"]


# ---------------------------------------------------------------- a step without gradients

NO_GRADIENT = "holds no gradient of any of this optimizer's parameters"
#: How each path is reached: a compiled optimizer nobody shares steps through
#: ``exclusive.script_step``; one whose lr changed since its last step through the owner's
#: Python ``step_local_optimizer`` (the change travels with the step); an eager one too.
STEP_PATHS = {"exclusive": torch.optim.SGD, "locked": torch.optim.SGD, "eager": remote.PlainSGD}


def _step_on(path: str, opt: DistributedOptimizer, ctx: int) -> None:
    if path == "locked":
        opt.param_groups[0]["lr"] *= 0.5
    opt.step(ctx)


def _no_gradient_warnings(caught: List[warnings.WarningMessage]) -> List[Any]:
    return [w for w in caught if NO_GRADIENT in str(w.message)]


@pytest.mark.parametrize("path", list(STEP_PATHS))
def test_step_on_a_context_without_gradients_warns_once(world, rpc_calls, path):
    rrefs = ones_on("worker1", "worker2")
    opt = DistributedOptimizer(STEP_PATHS[path], rrefs, lr=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # once per optimizer even so
        # step before backward: the forward reached both owners, which hold the context
        with dist_autograd.context() as ctx:
            [rpc.rpc_sync(r.owner(), remote.param_sum, args=(r,)) for r in rrefs]
            del rpc_calls[:]
            _step_on(path, opt, ctx)
        targets = {func for _, func, _ in rpc_calls}
        # a context no owner ever heard of (the locked path on every owner)
        with dist_autograd.context() as later:
            _step_on(path, opt, later)
    said = _no_gradient_warnings(caught)
    assert len(said) == 1, [str(w.message) for w in caught]
    assert said[0].category is UserWarning
    assert said[0].filename == __file__  # it points at the caller's step()
    message = str(said[0].message)
    assert message.startswith(f"DistributedOptimizer.step({ctx}): the distributed autograd "
                              f"context {ctx} {NO_GRADIENT}, so none changed. Likely cause: ")
    assert "loss.backward() instead of dist_autograd.backward(context_id, [loss])" in message
    assert "step() ran before the backward pass" in message
    for r in rrefs:
        assert torch.equal(rpc.rpc_sync(r.owner(), remote.value, args=(r,)), torch.ones(4))
    assert targets == ({exclusive.script_step} if path == "exclusive"
                       else {owner.step_local_optimizer})


def test_loss_backward_instead_of_dist_autograd_backward_warns(world):
    # The trainer's own parameter: loss.backward() fills its .grad, not the context.
    param = torch.ones(4, requires_grad=True)
    opt = DistributedOptimizer(torch.optim.SGD, [rpc.RRef(param)], lr=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dist_autograd.context() as ctx:
            param.sum().backward()
            opt.step(ctx)
    [said] = _no_gradient_warnings(caught)
    assert f"context {ctx} {NO_GRADIENT}" in str(said.message)
    assert torch.equal(param.detach(), torch.ones(4))
    assert torch.equal(param.grad, torch.ones(4))


@pytest.mark.parametrize("path", list(STEP_PATHS))
def test_steps_with_some_gradients_do_not_warn(world, path):
    rrefs = ones_on("worker1", "worker2")
    opt = DistributedOptimizer(STEP_PATHS[path], rrefs, lr=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dist_autograd.context() as ctx:  # a normal step
            losses = [rpc.rpc_sync(r.owner(), remote.param_sum, args=(r,)) for r in rrefs]
            dist_autograd.backward(ctx, [torch.stack(losses).sum()])
            _step_on(path, opt, ctx)
        after_normal = [rpc.rpc_sync(r.owner(), remote.value, args=(r,)) for r in rrefs]
        with dist_autograd.context() as ctx:  # worker2's parameter unused: no gradient there
            first = rpc.rpc_sync("worker1", remote.param_sum, args=(rrefs[0],))
            dist_autograd.backward(ctx, [first])
            _step_on(path, opt, ctx)
        assert _no_gradient_warnings(caught) == []
        with dist_autograd.context() as ctx:  # the check still watches
            _step_on(path, opt, ctx)
    assert len(_no_gradient_warnings(caught)) == 1
    for r in rrefs:
        assert not torch.equal(after_normal[rrefs.index(r)], torch.ones(4))
    values = [rpc.rpc_sync(r.owner(), remote.value, args=(r,)) for r in rrefs]
    assert not torch.equal(values[0], after_normal[0])
    assert torch.equal(values[1], after_normal[1])


# ---------------------------------------------------------------- a dead owner


@pytest.mark.parametrize(
    "how, timeout_s",
    # stopped: the step and the construction each wait the whole timeout (the test is about
    # the error then naming the owner, not the timeout's length); the setup before the stop
    # is a few eager RPCs of milliseconds on an idle machine, but took over 2 s once with
    # both cores busy (the suite's other worker and its ranks)
    [("killed", 10.0), ("stopped", 6.0)],
    ids=["killed", "stopped"],
)
def test_dead_owner_is_named_within_the_rpc_timeout(how, timeout_s):
    """Its own two-process world, so that losing an owner leaves the shared one intact.

    A killed owner closes its connections; a stopped one (SIGSTOP) keeps them open and
    answers nothing, so only the RPC timeout can end the wait.
    """
    port = worlds.free_port()
    results, go = worlds.CONTEXT.Queue(), worlds.CONTEXT.Event()
    with worlds.spawned((remote.run_worker, (1, 2, port, timeout_s)),
                        (remote.dead_owner_trainer, (port, timeout_s, results, go))
                        ) as (owner, trainer):
        try:
            assert results.get(timeout=120) == "ready"
            if how == "killed":
                owner.kill()
                owner.join()
            else:
                os.kill(owner.pid, signal.SIGSTOP)
            go.set()
            report = results.get(timeout=4 * timeout_s + 30)
        finally:
            if how == "stopped":
                owner.kill()
    for action in ("step", "construction"):
        outcome = report[action]
        assert outcome.get("failures", {}).keys() == {"worker1"}, outcome
        assert "worker1: " in outcome["error"]
        assert outcome["seconds"] < timeout_s + 5, outcome
    # ...and the trainer can leave at once: rpc.shutdown(graceful=False) does not wait for
    # the lost owner, and the trainer process then exits (joined above, within 30 s)
    assert report["shutdown_seconds"] < 5.0, report
    assert trainer.exitcode == 0, trainer.exitcode


def test_one_argument_names_what_goes_where(world, rpc_calls):
    """``DistributedOptimizer(model)``: Python would say only that 'params_rref' is missing."""
    with pytest.raises(TypeError) as info:
        DistributedOptimizer(torch.nn.Linear(2, 2))
    assert str(info.value) == (
        "DistributedOptimizer(a Linear module): expected an optimizer class, then the "
        "parameters (params_rref), then the class's options, e.g. DistributedOptimizer("
        "torch.optim.SGD, [rpc.RRef(p) for p in model.parameters()], lr=0.05)")
    assert rpc_calls == []
