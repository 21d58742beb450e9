"""The 8-bit and 4-bit optimizers (``distopt.optim``) under DataParallelOptimizer: equal to
DDP + the class itself, bit for bit, unsharded and with ``shard="param"`` and ``"flat"`` on
2 ranks, and sharded equal to unsharded on 2 and 3 (parameters and the gathered state, codes
and scales included); a state saved on 2 ranks loads on 3 in every mode; ``shard="flat"``
cuts quantised weights at block boundaries (with ``shard_gradients=True`` too: "zero2"), and
refuses groups of different block sizes.
The DDP hooks (``optimizer_hook``) step them during backward, equal to DDP + the class."""
import pytest

from tests.parallel import blockwise_scenarios as scenarios


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("blockwise"))
    return path, {w: worlds.run(scenarios.parity, w, path) for w in (2, 3)}


CASES = [(w, name) for w in (2, 3) for name in scenarios.CLASSES
         if w == 2 or name in scenarios.THREE_RANKS]


@pytest.mark.parametrize("world_size,name", CASES)
@pytest.mark.parametrize("shard", [None, "param", "flat", "zero2"])
def test_equal_to_ddp_and_the_class_itself(saved, world_size, name, shard):
    for rank, res in enumerate(saved[1][world_size]):
        got = res[f"{name}/{shard}"]
        if world_size == 2:  # DDP's buckets and ours sum a+b alike
            assert got["exact"], f"rank {rank}: parameters differ from DDP + {name}"
            assert got["state_exact"], f"rank {rank}: state differs from DDP + {name}"
        assert got["exact_unsharded"], f"rank {rank}: parameters differ from shard=None"
        assert got["state_exact_unsharded"], f"rank {rank}: state differs from shard=None"
        assert "torch.uint8" in got["dtypes"] and "torch.float32" in got["dtypes"]
        assert got["cut_inside"] == (shard in ("flat", "zero2"))


@pytest.mark.parametrize("name", list(scenarios.CLASSES))
def test_ddp_hook_steps_equal_to_ddp_and_the_class_itself(saved, name):
    """``optimizer_hook(ddp, cls, ...)``: each bucket stepped during backward by the twin."""
    for rank, res in enumerate(saved[1][2]):
        assert res[f"{name}/hook"]["exact"], f"rank {rank}: parameters differ"
        assert res[f"{name}/hook"]["state_exact"], f"rank {rank}: state differs"


def test_state_saved_on_two_ranks_loads_on_three(worlds, saved):
    path = saved[0]
    for res in worlds.run(scenarios.resume, 3, path, 2):
        assert res["loaded_exact"] == [True, True, True]


def test_flat_refuses_groups_of_different_block_sizes(worlds):
    for message in worlds.run(scenarios.mixed_blocks, 2):
        assert "Invalid block_size: [128, 256]" in message


def test_bfloat16_models_keep_float32_scales_and_moments(worlds):
    """torch.optim's format casts floating state to the parameter's dtype; the buckets cut
    again at the first step and load_state_dict carry the state in it, and must not."""
    for rank, res in enumerate(worlds.run(scenarios.bfloat16, 2)):
        assert res == {"None": [True, True, True], "flat": [True, True, True]}, (rank, res)
