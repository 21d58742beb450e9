"""Issue 36: training loops as users write them, unmodified, against DDP + torch.optim in the
same gloo world (``real_loop_scenarios``)."""
import pytest
import torch

from tests.helpers import assert_identical
from tests.parallel import real_loop_scenarios as scenarios


@pytest.fixture(scope="module")
def nanogpt(worlds, tmp_path_factory):
    return worlds.run(scenarios.nanogpt, 2, str(tmp_path_factory.mktemp("nanogpt")))


@pytest.mark.parametrize("scaled", [False, True], ids=["no-scaler", "grad-scaler"])
@pytest.mark.parametrize("options", ["defaults", "flat", "param"])
def test_nanogpt_loop_equals_ddp_with_default_options(nanogpt, scaled, options):
    """Clipping with the default overlap=True, accumulation with no_sync, a GradScaler:
    every iteration bit for bit with DDP + torch.optim, on every rank.

    The loop is nanoGPT's: decay / no-decay groups, no_sync accumulation, GradScaler on and
    off, clipping; unsharded, "flat" and "param".
    """
    for rank in range(2):
        ddp, ours = nanogpt[rank][f"{scaled}/ddp"], nanogpt[rank][f"{scaled}/{options}"]
        assert len(ours) == scenarios.ITERS
        assert not torch.equal(ours[0], ours[-1])  # it trained
        for it, (got, want) in enumerate(zip(ours, ddp)):
            assert torch.equal(got, want), (rank, it)


@pytest.mark.parametrize("scaled", [False, True], ids=["no-scaler", "grad-scaler"])
@pytest.mark.parametrize("options", ["defaults", "flat", "param"])
def test_rank0_saves_the_state_dict_and_every_rank_resumes_it(nanogpt, scaled, options):
    for rank in range(2):
        resumed = nanogpt[rank][f"{scaled}/{options}/resumed"]
        uninterrupted = nanogpt[rank][f"{scaled}/{options}"][scenarios.SAVE_AT + 1:]
        assert len(resumed) == len(uninterrupted) > 0
        for got, want in zip(resumed, uninterrupted):
            assert torch.equal(got, want), rank


@pytest.mark.parametrize("scaled", [False, True], ids=["no-scaler", "grad-scaler"])
@pytest.mark.parametrize("options", ["flat", "param"])
def test_a_sharded_state_dict_on_one_rank_raises_at_once(nanogpt, scaled, options):
    """nanoGPT's 'if master_process: torch.save(opt.state_dict())' with shard=: rank 0 raises
    at once, asking for consolidate_state_dict on every rank first (before, it waited in the
    gather until the group's timeout)."""
    key = f"{scaled}/{options}"
    lone = nanogpt[0][f"{key}/lone"]
    assert lone.startswith(f"Invalid state_dict on rank 0: with shard='{options}' each rank "
                           f"holds 1/2 of the optimizer state")
    assert "nothing waits for the other ranks" in lone
    assert "opt.consolidate_state_dict(to=0) on every rank first" in lone
    assert "consolidated state is on this rank" in nanogpt[1][f"{key}/not-to"]
    assert "out of date: a step or a load came since" in nanogpt[0][f"{key}/stale"]


def test_clipping_that_starts_late_raises_at_each_step_it_missed(worlds):
    """Clipping from the third step on, after two steps that did not clip: those steps were
    stepped during backward with the averages, so each raises (the plan changes only at a
    step that waited, where every rank agrees); the parameters stay equal on every rank."""
    results = worlds.run(scenarios.late_clipping, 2)
    for result in results:
        assert [step for step, _ in result["errors"]] == [2, 3, 4]
        message = result["errors"][0][1]
        assert "the first step changed none" in message
        assert "expected the same changes from the first step on" in message
        for got, want in zip(result["ours"][:2], result["ddp"][:2]):
            assert torch.equal(got, want)
    assert torch.equal(results[0]["ours"][-1], results[1]["ours"][-1])


@pytest.mark.parametrize("shard", [None, "flat"])
def test_grads_changed_on_one_rank_only_change_the_plan_on_every_rank(worlds, shard):
    """Rank 0 alone logs the gradient norm with clip_grad_norm_(..., inf) (an in-place
    scaling by 1): every rank decides to wait for step() from then on, so the sharded
    gathers stay in one order (before, rank 1 aborted in gloo: "collective mismatch"), and
    the parameters equal DDP's."""
    for result in worlds.run(scenarios.norm_logged_on_rank0, 2, shard):
        assert result["edited"] == [True] * 3
        for got, want in zip(result["ours"], result["ddp"]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("nested", [False, True], ids=["one-join", "nested-joins"])
def test_two_optimizers_under_join_with_save_inside(worlds, tmp_path, nested):
    """Uneven inputs (5 and 3 batches) with two DataParallelOptimizers: the parameters and
    BatchNorm buffers of DDP's last joiner on every rank; save() and
    consolidate_state_dict() inside the block after rank 1 joined complete, and what they
    wrote is the state of that iteration."""
    results = worlds.run(scenarios.two_optimizers_join, 2, str(tmp_path), nested)
    last = results[0]
    for r in results:
        assert torch.equal(r["ours"], last["ddp"])
        for got, want in zip(r["buffers"], last["ddp_buffers"]):
            assert torch.equal(got, want)
    assert_identical(last["state_at_3"], last["ref_state_at_3"])
    for r in results:
        assert_identical(r["loaded_body"], last["state_at_3"])
        assert_identical(r["loaded_head"], last["head_state_at_3"])
        assert "out of date: a step or a load came since" in r["stale"], r["stale"]


def test_a_dataparallel_optimizer_and_ddp_in_one_join_are_refused(worlds):
    for r in worlds.run(scenarios.join_with_ddp, 2):
        assert r == {"opt-first": "Using join context manager with multiple process groups",
                     "ddp-first": "Using join context manager with multiple process groups"}


def test_load_inside_join_is_refused_at_once(worlds, tmp_path):
    for rank, r in enumerate(worlds.run(scenarios.load_inside_join, 2, str(tmp_path))):
        for shard in (None, "flat"):
            assert r[f"{shard}/load"].startswith(
                f"Invalid load on rank {rank}: inside a Join block"), r
            assert r[f"{shard}/load_dcp"] == (
                f"Invalid load_dcp on rank {rank}: inside a Join block, where a rank that has "
                f"run out of batches cannot load with the others; nothing was read or written "
                f"(expected opt.load_dcp(...) before the Join block)")
            assert r[f"{shard}/dcp_state_dict"] == (
                f"Invalid dcp_state_dict on rank {rank}: inside a Join block, where a rank "
                f"that has run out of batches cannot save through DCP with the others; nothing "
                f"was read or written (expected opt.dcp_state_dict() and dcp.save before the "
                f"Join block)")
        assert r["None/load_state_dict"] == "no error"  # unsharded: local, no collective
        assert r["flat/load_state_dict"].startswith(
            f"Invalid load_state_dict on rank {rank}: with shard='flat' it is a collective"), r


@pytest.fixture(scope="module")
def changed(worlds):
    return worlds.run(scenarios.changed_after_construction, 2)


@pytest.mark.parametrize("cast,dtype", [("double", "torch.float64"), ("half", "torch.float16"),
                                        ("bfloat16", "torch.bfloat16")])
def test_a_model_cast_after_construction_is_refused_naming_it(changed, cast, dtype):
    for r in changed:
        assert r[cast].startswith(f"Invalid parameter 0: it is now {dtype} on cpu"), r[cast]
        assert "but it was torch.float32 on cpu" in r[cast]
        assert "the model was cast, moved or replaced" in r[cast]
        assert r[f"{cast}/unchanged"]


def test_channels_last_after_construction(changed):
    """Unsharded, stepped as DDP + torch.optim step a model laid out before they were built
    (bit for bit); sharded, refused naming the parameter (before: 0.286 off with "flat")."""
    for r in changed:
        assert r["channels_last/None"] is True
        for shard in ("flat", "param"):
            message = r[f"channels_last/{shard}"]
            assert message.startswith("Invalid parameter 0: it is now strides (18, 1, 6, 2), "
                                      "but it was strides (18, 9, 3, 1)"), message
            assert "torch.channels_last" in message and f"shard='{shard}'" in message
            assert "nothing was sent or stepped" in message


@pytest.mark.parametrize("module", ["module=model", "module=compiled"])
def test_compile_fullgraph_with_module(compiled, module):
    """nanoGPT's torch.compile(model) with module= either the model or the compiled module:
    parameters and BatchNorm buffers equal DDP's after every step, on every rank."""
    for r in compiled:
        assert len(r[module]) == 3
        for got, want in zip(r[module], r["ddp"]):
            assert torch.equal(got, want)


def test_compile_fullgraph_of_a_torch_container_names_the_fix(compiled):
    for r in compiled:
        assert r["container"].startswith("Unsupported"), r["container"]
        assert "module=compiled" in r["container"] and "fullgraph=True" in r["container"]


@pytest.fixture(scope="module")
def compiled(worlds):
    return worlds.run(scenarios.compiled_module, 2)


def test_a_loop_that_leaves_grads_alone_keeps_stepping_during_backward(worlds):
    """The check behind item 1 sees no change where the loop makes none (no scheme writes
    into a bucket after its reduction): every step after the first overlaps."""
    for result in worlds.run(scenarios.untouched_grads_keep_overlapping, 2):
        for name, seen in result.items():
            assert seen == {"in_backward": [False, True, True], "edited": False}, name
