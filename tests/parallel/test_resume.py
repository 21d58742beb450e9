"""Resumes that must not lose state (issue 36, item 3), at 2 gloo ranks in one world.

The scenarios (tests/parallel/resume_scenarios.py) save a run after its buckets were
rebuilt in arrival order, and resume it in a new optimizer whose buckets are still the
construction's: every parameter's state must come back, and the resumed run must equal
the uninterrupted one bit for bit.
"""
import re

import pytest

from tests.parallel import resume_scenarios as scenarios


@pytest.fixture(scope="module")
def world(worlds, tmp_path_factory):
    return worlds.run(scenarios.everything, 2, str(tmp_path_factory.mktemp("resume")))


@pytest.mark.parametrize("how", scenarios.HOWS)
@pytest.mark.parametrize("name", sorted(scenarios.RUNS))
def test_a_resume_after_the_rebuild_keeps_every_parameter_s_state(world, name, how):
    for rank in (0, 1):
        got = world[rank]["resumes"][f"{name}/{how}"]
        assert got["rebuilt"]
        assert got["state_dict"] == "no error"
        assert got["entries"][0] == got["entries"][1] > 0, got["entries"]
        assert got["same_state"]
        assert got["equal"]
        assert got["warnings"] == []


#: The one checker of every optimizer (distopt.saved_state), in the RPC optimizer's words.
SHAPE_REFUSED = ("Invalid state_dict: state[0]['exp_avg'] has shape (4, 16) (expected (16, 4), "
                 "the shape of parameter 0)")


@pytest.mark.parametrize("source", ["None", "flat", "param"])
def test_flat_refuses_a_state_of_another_shape_on_every_rank_alike(world, source):
    """A (4, 16) parameter's state into a (16, 4) one with shard="flat": refused as the
    unsharded optimizer refuses it, naming the parameter's shape (not its flat piece's),
    the same message on every rank; nothing changes and the ranks go on."""
    got = [world[rank]["refusals"] for rank in (0, 1)]
    assert got[0][f"{source}/load"] == got[1][f"{source}/load"]
    assert got[0][f"{source}/load_state_dict"] == got[1][f"{source}/load_state_dict"]
    load = got[0][f"{source}/load"]
    if source == "None":  # the unsharded file holds the (4, 16) tensors themselves
        assert load == f"ValueError: Invalid checkpoint on ranks 0, 1: {SHAPE_REFUSED} " \
                       f"(nothing changed on any rank)"
    else:  # the shard files hold flat pieces, and the shape each was saved for
        assert re.fullmatch(
            r"ValueError: Invalid checkpoint on ranks 0, 1: Invalid checkpoint '.*refused-"
            + source + r"': state\[0\] was saved for a parameter of shape \[4, 16\] \(expected "
            r"\[16, 4\] for params\[0\] of shape \[16, 4\]; 'dp-\w+-shard-rank\d\.pt'\) "
            r"\(nothing changed on any rank\)", load), load
    assert got[0][f"{source}/load_state_dict"] == (
        f"ValueError: Invalid state_dict on ranks 0, 1: {SHAPE_REFUSED} (nothing changed on "
        f"any rank)")
    assert got[0][f"{source}/unchanged"] and got[1][f"{source}/unchanged"]


def test_a_part_one_rank_refuses_is_reported_alike_on_every_rank(world):
    got = [world[rank]["refusals"] for rank in (0, 1)]
    name = got[0]["residuals_file"]
    assert got[0]["one-rank/load"] == got[1]["one-rank/load"]
    assert re.fullmatch(r"ValueError: Invalid checkpoint on rank 1: Invalid checkpoint '(.*)"
                        r"one-rank': file '\1one-rank/" + re.escape(name) + r"' is missing "
                        r"\(nothing changed on any rank\)", got[0]["one-rank/load"]), (
        got[0]["one-rank/load"])
    holder = got[0]["holder"]
    assert got[1]["holder"] == holder
    assert got[0]["one-rank/load_state_dict"] == got[1]["one-rank/load_state_dict"]
    assert got[0]["one-rank/load_state_dict"].startswith(
        f"ValueError: Invalid state_dict on rank {holder}: "), got[0]["one-rank/load_state_dict"]
    assert "exp_avg_sq" in got[0]["one-rank/load_state_dict"]


def _habit_warning(what):
    return (f"DataParallelOptimizer on rank 1 of 2: loaded the per-rank residuals of rank 0 of "
            f"2 ({what}): each rank keeps the error feedback of what it did not send, so this "
            f"rank now holds another rank's, and the run drifts from one that kept its own "
            f"(expected opt.save(path) / opt.load(path) on every rank, which keep each rank's "
            f"own residuals, or each rank's own state_dict())")


@pytest.mark.parametrize("name,what", [("topk", "state_dict['residuals']"),
                                       ("powersgd", "state_dict['compression']"),
                                       ("topk-flat", "state_dict['residuals']")])
def test_rank_0_s_residuals_loaded_on_another_rank_warn_once(world, name, what):
    """The DDP habit: rank 0's state_dict loaded (twice) on every rank. It records whose
    residuals it holds; rank 1 is warned once, rank 0 not at all, and both go on."""
    for rank in (0, 1):
        got = world[rank]["habit"][name]
        assert got["record"] == {"rank": 0, "world_size": 2}
    assert world[0]["habit"][name]["warnings"] == []
    assert world[1]["habit"][name]["warnings"] == [_habit_warning(what)]


def test_a_flat_topk_state_loads_into_another_bucket_cap(world):
    """The load takes the saved layout; the state was checked against the compiled steps'
    pieces of the new layout before (every rank refused: "shape [64] (expected [128] ...)")."""
    for r in world:
        assert r["other_cap"]["load"] == "no error"
        assert r["other_cap"]["equal"]


def test_ranks_in_different_collectives_say_so(world):
    """Rank 0 in a sharded load_state_dict while rank 1 consolidates: each rank names both
    calls (before: TypeError and AttributeError from the other's payload)."""
    assert world[0]["other_cap"]["mismatch"] == (
        "RuntimeError: DataParallelOptimizer on rank 0 of 2: the ranks called different "
        "collectives: this rank is in load_state_dict(), rank 1 in consolidate_state_dict() "
        "(or a bucket rebuild) (expected every rank to call load_state_dict() together)")
    assert world[1]["other_cap"]["mismatch"].startswith(
        "RuntimeError: DataParallelOptimizer on rank 1 of 2: the ranks called different "
        "collectives: this rank is in consolidate_state_dict() (or a bucket rebuild), rank 0 "
        "in load_state_dict()")

