"""Buckets rebuilt in the order the gradients arrive (issue 25, item 6), at 2 gloo ranks.

The model (tests/parallel/arrival_scenarios.py) uses its layers in the reverse of their
registration order, so the construction's buckets are exactly the wrong way round: bucket 0,
whose reduction the communication thread issues first, is complete only when 14 of the 14
gradients have arrived. After the first step every rank cuts its buckets again in rank 0's
arrival order (as DDP does), and bucket 0 is complete after 5.
"""
import pytest
import torch

from tests.parallel import arrival_scenarios as scenarios

CONFIGS = ["sgd-overlap", "sgd", "adamw-overlap", "adamw-flat", "adam-param",
           "rprop-eager-param", "adagrad-accumulate"]


@pytest.fixture(scope="module")
def world(worlds, tmp_path_factory):
    return worlds.run(scenarios.everything, 2, str(tmp_path_factory.mktemp("arrival")))


@pytest.mark.parametrize("name", CONFIGS)
def test_buckets_follow_the_arrival_order_after_the_first_step(world, name):
    arrival = world[0]["arrival"]
    for rank in (0, 1):
        layouts = world[rank][name]["layouts"]
        registration = [i for b in layouts[0] for i in b]
        assert registration == sorted(registration, reverse=True)
        assert [i for b in layouts[1] for i in b] == arrival != registration
        assert all(layout == layouts[1] for layout in layouts[1:])  # rebuilt once
        assert layouts[1] == world[0][name]["layouts"][1]  # every rank alike


@pytest.mark.parametrize("name", CONFIGS)
def test_the_first_reduction_starts_as_soon_as_its_bucket_arrived(world, name):
    first_bucket = len(world[0][name]["layouts"][1][0])
    assert first_bucket < 14
    # Step 1: bucket 0 waits for every gradient; later steps for its own 5.
    assert world[0][name]["first_launch"] == [14] + [first_bucket] * (scenarios.STEPS - 1)


@pytest.mark.parametrize("name", CONFIGS)
def test_numbers_equal_ddp_and_every_rank_across_the_rebuild(world, name):
    """Bit for bit with DDP + torch.optim, and every rank with every other, across the rebuild:
    overlap on and off, sharded "flat" and "param", eager, accumulation."""
    first, second = world[0][name], world[1][name]
    assert torch.equal(first["params"], second["params"])
    if name != "adagrad-accumulate":  # two passes a step: no DDP run to compare
        assert first["exact"] == [True] * scenarios.STEPS
    assert first["grads_are_views"] and second["grads_are_views"]


@pytest.mark.parametrize("case", ["adam-flat-loaded", "sgd-topk", "adam-param-loaded"])
def test_state_residuals_and_grads_are_carried_over(world, case):
    for rank in (0, 1):
        got = world[rank]["carried"][case]
        assert got["rebuilt"]
        assert got["entries"] > 0
        assert got["same_state"] and got["same_grads"]


def test_powersgd_state_resumes_with_the_layout_it_was_saved_with(world):
    for rank in (0, 1):
        got = world[rank]["powersgd"]
        assert got["error_entries"] > 0  # error feedback had begun: per-bucket state
        assert got["before"] != got["saved_layout"] == got["after"] == got["final"]
        assert got["equal"]


def test_a_rank_joined_from_the_start_keeps_every_rank_s_buckets(world):
    assert world[0]["joined"] == world[1]["joined"] == {"kept": True, "equal": True}


def test_grad_scaler_across_the_rebuild_steps_as_under_ddp(world):
    for rank in (0, 1):
        got = world[rank]["habits"]["scaler"]
        assert got["rebuilt"]
        assert got["scales"][:2] == [512.0, 1024.0]  # skipped, then grown: steps
        assert got["exact"] == [True] * 4


def test_buffers_across_the_rebuild_equal_ddp_s(world):
    assert world[0]["habits"]["module"] == world[1]["habits"]["module"] == [True] * 4


def test_a_sharded_checkpoint_saved_after_the_rebuild_resumes_exactly(world):
    for rank in (0, 1):
        assert world[rank]["habits"]["checkpoint"] == {"equal": True, "rebuilt_after_load": True}


def test_torch_s_state_dict_hooks_run_around_state_dict_and_load(world):
    for rank in (0, 1):
        assert world[rank]["registered"] == 0  # not an RPC owner's local optimizer
        calls, note, keys, refusal = world[rank]["state_dict_hooks"]
        assert calls == ["pre", "post", "load_pre", "load_post"]
        assert note == "post" and keys == ["note", "param_groups", "state"]
        assert refusal.startswith("Invalid add_param_group: a DataParallelOptimizer's buckets "
                                  "are fixed at construction")
