"""Sharded save / load: parallel shards plus a manifest, atomic, surviving failed saves."""
import json
import os

import pytest
import torch
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizer, DistributedOptimizerError, checkpoint
from tests.distopt import harness, remote

CASE = (torch.optim.Adam, {"lr": 0.01}, {}, {"lr": 0.02, "betas": (0.8, 0.95)})


def build(rrefs, local):
    cls, defaults, opts0, opts1 = CASE
    dist_opt = DistributedOptimizer(cls, harness.grouped(rrefs, [opts0, opts1]), **defaults)
    ref = cls(harness.grouped(local, [opts0, opts1]), **defaults)
    return dist_opt, ref


def listing(path):
    return sorted(os.listdir(path))


def test_save_load_continues_exactly(world, tmp_path):
    rrefs, local = harness.make_params()
    dist_opt, ref = build(rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 3)
    dist_opt.param_groups[1]["lr"] = 0.004  # not yet sent: the trainer's groups are saved
    ref.param_groups[1]["lr"] = 0.004
    manifest = dist_opt.save(str(tmp_path))

    names = listing(tmp_path)
    assert names[0] == "manifest.json" and len(names) == 3  # two shards, no temp files
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk == manifest
    assert [s["owner"] for s in manifest["shards"]] == ["worker1", "worker2"]
    assert all(s["bytes"] == os.path.getsize(tmp_path / s["file"]) for s in manifest["shards"])

    fresh, _ = build(rrefs, [p.detach().clone() for p in local])
    fresh.load(str(tmp_path))
    assert fresh.param_groups[1]["lr"] == 0.004
    assert fresh.param_groups[1]["betas"] == (0.8, 0.95)
    harness.assert_state_dicts_equal(fresh.state_dict(), ref.state_dict())
    harness.train(fresh, ref, rrefs, local, 2, first_step=3)
    harness.assert_params_equal(rrefs, local)


def test_second_save_replaces_the_first(world, tmp_path):
    rrefs, local = harness.make_params()
    dist_opt, ref = build(rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 1)
    first = dist_opt.save(str(tmp_path))
    harness.train(dist_opt, ref, rrefs, local, 1, first_step=1)
    second = dist_opt.save(str(tmp_path))
    assert first["generation"] != second["generation"]
    assert listing(tmp_path) == sorted([s["file"] for s in second["shards"]] + ["manifest.json"])


def saved_then_failed(tmp_path):
    """A good save, then one more step; returns what the failing save must leave intact."""
    rrefs, local = harness.make_params()
    dist_opt, ref = build(rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 2)
    good = dist_opt.save(str(tmp_path))
    expected = dist_opt.state_dict()
    harness.train(dist_opt, ref, rrefs, local, 1, first_step=2)
    return rrefs, local, dist_opt, good, expected


def assert_previous_checkpoint_loads(rrefs, local, tmp_path, good, expected):
    assert json.loads((tmp_path / "manifest.json").read_text()) == good
    fresh, _ = build(rrefs, [p.detach().clone() for p in local])
    fresh.load(str(tmp_path))
    harness.assert_state_dicts_equal(fresh.state_dict(), expected)


def test_owner_failing_mid_write_leaves_the_previous_checkpoint(world, tmp_path):
    rrefs, local, dist_opt, good, expected = saved_then_failed(tmp_path)
    rpc.rpc_sync("worker2", remote.fail_checkpoint_at, args=("shard-written",))
    try:
        with pytest.raises(DistributedOptimizerError) as info:
            dist_opt.save(str(tmp_path))
    finally:
        rpc.rpc_sync("worker2", remote.clear_checkpoint_fault)
    assert list(info.value.failures) == ["worker2"]
    assert "simulated failure at shard-written" in info.value.failures["worker2"]
    # worker1's finished shard and worker2's half-written temporary file are gone.
    assert listing(tmp_path) == sorted([s["file"] for s in good["shards"]] + ["manifest.json"])
    assert_previous_checkpoint_loads(rrefs, local, tmp_path, good, expected)


def test_trainer_dying_before_the_manifest_leaves_the_previous_checkpoint(
    world, tmp_path, monkeypatch
):
    rrefs, local, dist_opt, good, expected = saved_then_failed(tmp_path)

    def die(stage, path):
        if stage == "before-manifest":
            raise remote.SimulatedCrash(stage)

    monkeypatch.setattr(checkpoint, "fault_hook", die)
    with pytest.raises(remote.SimulatedCrash):
        dist_opt.save(str(tmp_path))
    monkeypatch.setattr(checkpoint, "fault_hook", None)
    # A dead trainer cleans nothing: the new shards are there, named by no manifest.
    orphans = [n for n in listing(tmp_path) if n not in {s["file"] for s in good["shards"]}]
    assert len(orphans) == 3 and "manifest.json" in orphans
    assert_previous_checkpoint_loads(rrefs, local, tmp_path, good, expected)
    # The next save removes them.
    latest = dist_opt.save(str(tmp_path))
    assert listing(tmp_path) == sorted([s["file"] for s in latest["shards"]] + ["manifest.json"])


def test_owner_dying_mid_write_leaves_the_previous_checkpoint(world, tmp_path):
    """An owner's write dying with a non-Exception (as a crash would) is named, and harmless."""
    rrefs, local, dist_opt, good, expected = saved_then_failed(tmp_path)
    rpc.rpc_sync("worker1", remote.fail_checkpoint_at, args=("shard-written", True))
    try:
        with pytest.raises(DistributedOptimizerError) as info:
            dist_opt.save(str(tmp_path))
    finally:
        rpc.rpc_sync("worker1", remote.clear_checkpoint_fault)
    assert list(info.value.failures) == ["worker1"]
    assert_previous_checkpoint_loads(rrefs, local, tmp_path, good, expected)


@pytest.mark.parametrize(
    "other, match",
    [
        ((torch.optim.SGD, {"lr": 0.1}), r"written by a torch.optim.adam.Adam optimizer"),
        ((torch.optim.Adam, {"lr": 0.1, "amsgrad": True}), r"\['amsgrad'\] is False"),
        ("three-params", r"param_groups\[1\] holds 2 parameters \(expected 1\)"),
    ],
    ids=["class", "fixed-hyperparameter", "count"],
)
def test_load_refuses_another_optimizer_before_any_owner_changes(world, tmp_path, other, match):
    rrefs, local = harness.make_params()
    dist_opt, ref = build(rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 1)
    dist_opt.save(str(tmp_path))
    if other == "three-params":
        target = DistributedOptimizer(
            torch.optim.Adam, [{"params": [rrefs[0], rrefs[2]]}, {"params": [rrefs[1]]}], lr=0.01
        )
    else:
        cls, kwargs = other
        target = DistributedOptimizer(cls, harness.grouped(rrefs, [{}, {}]), **kwargs)
    before = target.state_dict()
    with pytest.raises(ValueError, match=match):
        target.load(str(tmp_path))
    harness.assert_state_dicts_equal(target.state_dict(), before)


def test_load_from_a_directory_without_manifest(world, tmp_path):
    rrefs, _ = harness.make_params()
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.1)
    with pytest.raises(FileNotFoundError, match="expected a directory holding manifest.json"):
        opt.load(str(tmp_path))


def test_owner_missing_its_shard_changes_nothing(world, tmp_path):
    rrefs, local = harness.make_params()
    dist_opt, ref = build(rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 1)
    manifest = dist_opt.save(str(tmp_path))
    harness.train(dist_opt, ref, rrefs, local, 1, first_step=1)
    before = dist_opt.state_dict()
    os.remove(tmp_path / manifest["shards"][1]["file"])
    with pytest.raises(ValueError, match=r"shard .*-worker2\.pt' is missing"):
        dist_opt.load(str(tmp_path))
    harness.assert_state_dicts_equal(dist_opt.state_dict(), before)


def test_load_refuses_a_shard_whose_state_lacks_a_key(world, tmp_path):
    """A shard rewritten without 'exp_avg_sq' (its generation intact) is refused by its owner
    before any owner changes: an InvalidStateError naming the worker and the parameter."""
    from distopt import InvalidStateError

    rrefs, local = harness.make_params()
    dist_opt, ref = build(rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 2)
    manifest = dist_opt.save(str(tmp_path))
    shard = next(s for s in manifest["shards"] if s["owner"] == "worker2")
    data = torch.load(tmp_path / shard["file"], weights_only=True)
    del data["state"][3]["exp_avg_sq"]
    torch.save(data, tmp_path / shard["file"])
    # ...and the manifest told the truth about the new file: the state check must catch it
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    for entry in on_disk["shards"]:
        if entry["file"] == shard["file"]:
            entry["bytes"] = os.path.getsize(tmp_path / shard["file"])
            entry["crc32"] = checkpoint.crc32_of(str(tmp_path / shard["file"]))
    (tmp_path / "manifest.json").write_text(json.dumps(on_disk))
    harness.train(dist_opt, ref, rrefs, local, 1, first_step=2)
    before = dist_opt.state_dict()
    with pytest.raises(InvalidStateError, match=r"worker2: ValueError: Invalid state\[3\]: no "
                                                r"'exp_avg_sq'") as info:
        dist_opt.load(str(tmp_path))
    assert isinstance(info.value, ValueError)
    harness.assert_state_dicts_equal(dist_opt.state_dict(), before)
    harness.train(dist_opt, ref, rrefs, local, 1, first_step=3)
    harness.assert_params_equal(rrefs, local, "after a refused load")
