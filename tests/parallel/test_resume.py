"""Resumes that must not lose state (issue 36, item 3), at 2 gloo ranks in one world.

The scenarios (tests/parallel/resume_scenarios.py) save a run after its buckets were
rebuilt in arrival order, and resume it in a new optimizer whose buckets are still the
construction's: every parameter's state must come back, and the resumed run must equal
the uninterrupted one bit for bit.

The DCP checks (tests/parallel/dcp_scenarios.py, issue 39 item 4) save through
``torch.distributed.checkpoint`` on these 2 ranks and load on them, on 3 ranks (a world of
its own) and on 1 (a group of one rank of those 3).
"""
import re
import zlib

import pytest
import torch

from distopt.parallel import dcp
from tests.helpers import error_of
from tests.parallel import dcp_scenarios
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



# ---------------------------------------------------------------- DCP (issue 39, item 4)


@pytest.fixture(scope="module")
def dcp_saved(worlds, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp"))
    return path, worlds.run(dcp_scenarios.save_on_two, 2, path)


@pytest.fixture(scope="module")
def dcp_loaded(worlds, dcp_saved):
    return worlds.run(dcp_scenarios.load_on_three, 3, dcp_saved[0])


@pytest.mark.parametrize("name", sorted(dcp_scenarios.RUNS))
def test_dcp_each_rank_writes_its_own_shard_only(dcp_saved, name):
    """What each rank's DCP save was given to write is at most its own shard's bytes (the
    0-dim step counts its pieces share with the other rank's written once), and the
    ranks together wrote the whole state once."""
    got = [dcp_saved[1][rank][name] for rank in (0, 1)]
    whole = got[0]["whole"]
    for rank in (0, 1):
        assert 0 < got[rank]["written"] <= got[rank]["own"] < whole, got[rank]
    assert got[0]["written"] + got[1]["written"] == whole
    quantised = "bit" in name
    assert ("torch.uint8" in got[0]["dtypes"]) == quantised, got[0]["dtypes"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(got[0]["files"])


def test_torchs_get_state_dict_reads_the_state_without_stepping_and_resumes(dcp_saved):
    """torch's ``get_state_dict`` / ``set_optimizer_state_dict`` around ``dcp.save`` /
    ``dcp.load``, unsharded: the state read as it is (no hidden step of lr 0), loaded back,
    and training on equal to the uninterrupted run."""
    for rank, res in enumerate(dcp_saved[1]):
        got = res["torch_path"]
        assert got == {"untouched": True, "loaded": True, "equal": True}, (rank, got)


def test_the_state_view_refuses_a_key_set_and_takes_in_place_writes(worlds):
    for got in worlds.run(dcp_scenarios.state_view, 2):
        assert got["keys"] == ["exp_avg", "exp_avg_sq", "step"]
        assert got["set"].startswith("Invalid change of opt.state[p]")
        assert got["copies"] and got["in_place"] == 0.0


@pytest.mark.parametrize("name", sorted(dcp_scenarios.RUNS))
def test_dcp_resume_on_the_saving_ranks_equals_the_uninterrupted_run(dcp_saved, name):
    for rank in (0, 1):
        got = dcp_saved[1][rank][name]
        assert got["same_state"] and got["equal"], got
        # (saved sharded) a later state_dict() unchanged by what get_state_dict rewrote
        assert got["kept"] is True, got["kept"]
        # a dcp_state_dict() taken before a step refused at dcp.save
        assert got["stale"] is (True if name == "adamw8bit" else None), got["stale"]


@pytest.mark.parametrize("name", sorted(dcp_scenarios.RUNS))
def test_dcp_saved_on_two_ranks_loads_on_three_and_on_one(dcp_loaded, name):
    """Saved on 2 ranks, loaded on 3 (flat or param, each saved in the other mode too) and on
    1 (shard=None): the state equals the one consolidated at the save, the 8-bit and 4-bit
    codes and scales included, and training on equals a resume from that state through
    load_state_dict, bit for bit."""
    for rank in (0, 1, 2):
        assert dcp_loaded[rank][name]["same_state"] and dcp_loaded[rank][name]["equal"]
    if name in dcp_scenarios.ONE_RANK:
        one = dcp_loaded[0][f"{name}/one"]
        assert one["same_state"] and one["equal"], one
        assert sum(dcp_loaded[r][name]["own"] for r in (0, 1, 2)) >= one["own"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_dcp_a_corrupted_shard_is_refused_on_every_rank_with_nothing_changed(
        dcp_saved, dcp_loaded, ranks):
    """One bit flipped in the file of rank ``holder``: refused on every rank alike, naming
    that rank, its files and the key, with nothing changed, loaded on the 2 ranks that saved
    it and on 3 (where the ranks' CRCs of the parts each read are joined)."""
    got = [(dcp_saved[1] if ranks == 2 else dcp_loaded)[rank]["corrupt"]
           for rank in range(ranks)]
    holder = dcp_saved[1][0]["corrupt"]["file"][2]  # __<rank>_0.distcp
    everyone = ", ".join(map(str, range(ranks)))
    assert re.fullmatch(
        rf"ValueError: Invalid checkpoint on ranks {everyone}: Invalid checkpoint: the shard "
        rf"saved by rank {holder} \(its DCP files, __{holder}_\*\.distcp with FileSystemWriter\) "
        r"holds 'optim\.state\.0\.exp_avg' entries \[\d+, 3840\): CRC-32 0x[0-9a-f]{8} "
        r"\(expected 0x[0-9a-f]{8}, recorded at the save\) \(nothing changed on any rank\)",
        got[0]["error"]), got[0]["error"]
    for theirs in got:
        assert theirs["error"] == got[0]["error"]
        assert theirs["unchanged"]
        assert theirs["class"] == (
            f"ValueError: Invalid checkpoint on ranks {everyone}: Invalid checkpoint: "
            f"optimizer_class 'Adam' (expected 'SGD') (nothing changed on any rank)")


#: (key, value entries, piece, numel, group) -> elements per entry: torch.optim's state, a
#: step count, and the 8-bit / 4-bit layout of issue 39's item 1 (codes of one or two
#: elements a byte, one absmax a block), cut at a block from the parameter's start.
ENTRY_CASES = [
    ("exp_avg", 300, (100, 400), 1000, {}, 1),
    ("step", None, (100, 400), 1000, {}, None),
    ("exp_avg", 512, (256, 768), 5000, {"block_size": 256}, 1),
    ("exp_avg_absmax", 2, (256, 768), 5000, {"block_size": 256}, 256),
    ("exp_avg_absmax", 1, (4864, 5000), 5000, {"block_size": 256}, 256),
    ("exp_avg_sq", 256, (4608, 5120), 5120, {"block_size": 128}, 2),
    ("exp_avg_sq", 196, (4608, 5000), 5000, {"block_size": 128}, 2),
]


@pytest.mark.parametrize("key, entries, piece, numel, group, want", ENTRY_CASES)
def test_dcp_elements_per_entry_fits_the_quantised_layout(key, entries, piece, numel, group,
                                                          want):
    value = torch.zeros(()) if entries is None else torch.zeros(entries, dtype=torch.uint8)
    assert dcp.elements_per_entry(torch.optim.Adam, group, key, value, piece, numel) == want


def test_dcp_elements_per_entry_refuses_a_piece_that_does_not_start_at_an_entry():
    message = error_of(lambda: dcp.elements_per_entry(
        torch.optim.Adam, {"block_size": 256}, "exp_avg_absmax", torch.zeros(2), (100, 612),
        5000))
    assert message == (
        "ValueError: Invalid state['exp_avg_absmax']: 2 entries for elements [100, 612) of a "
        "parameter of 5000 (expected one entry per 256 elements, the piece starting at an "
        "entry)")


def test_dcp_crc32_combine_equals_the_crc_of_the_concatenation():
    for a, b in [(b"", b"x"), (b"distopt", b""), (bytes(range(256)) * 3, b"\x00" * 1000)]:
        assert dcp.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
