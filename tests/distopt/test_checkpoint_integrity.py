"""Checkpoints that cannot lie: every way a checkpoint directory can disagree with its
manifest is refused by ``load`` before any owner changes, with an error naming the file and
what is wrong; and a save that cannot write names the path and the cause."""
import json
import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed.rpc as rpc

from distopt import DistributedOptimizerError, checkpoint
from tests.distopt import harness, remote
from tests.distopt.test_checkpoint import build


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path, manifest):
    (path / "manifest.json").write_text(json.dumps(manifest))


def _truthful(path, name):
    """Make the manifest's size and crc32 of shard ``name`` match the file again."""
    manifest = _manifest(path)
    for shard in manifest["shards"]:
        if shard["file"] == name:
            shard["bytes"] = os.path.getsize(path / name)
            shard["crc32"] = checkpoint.crc32_of(str(path / name))
    _write_manifest(path, manifest)


def _omit_shard(path, m):
    m["shards"] = m["shards"][:1]


def _empty_shards(path, m):
    m["shards"] = []


def _swap_names(path, m):
    a, b = m["shards"][0]["file"], m["shards"][1]["file"]
    os.rename(path / a, path / "tmp")
    os.rename(path / b, path / a)
    os.rename(path / "tmp", path / b)


def _swap_names_and_digests(path, m):
    _swap_names(path, m)
    s0, s1 = m["shards"]
    for key in ("bytes", "crc32"):
        s0[key], s1[key] = s1[key], s0[key]


def _edit_params(path, m):
    m["shards"][0]["params"] = m["shards"][0]["params"][1:]


def _duplicate_param(path, m):
    m["shards"][0]["params"] = m["shards"][0]["params"] + m["shards"][1]["params"][:1]


def _flip_byte(path, m):
    name = path / m["shards"][1]["file"]
    data = bytearray(name.read_bytes())
    data[len(data) // 3] ^= 0x01
    name.write_bytes(bytes(data))


def _zero_64(path, m):
    name = path / m["shards"][0]["file"]
    data = bytearray(name.read_bytes())
    start = len(data) // 2
    data[start:start + 64] = bytes(64)
    name.write_bytes(bytes(data))


def _truncate(path, m):
    name = path / m["shards"][0]["file"]
    name.write_bytes(name.read_bytes()[:-100])


def _dot_dot(path, m):
    shutil.copy(path / m["shards"][0]["file"], path.parent / "x")
    m["shards"][0]["file"] = "../x"


def _absolute(path, m):
    shutil.copy(path / m["shards"][0]["file"], path.parent / "y.pt")
    m["shards"][0]["file"] = str(path.parent / "y.pt")


def _symlink_out(path, m):
    name = m["shards"][0]["file"]
    shutil.move(str(path / name), str(path.parent / name))
    os.symlink(path.parent / name, path / name)


def _extra_shard(path, m):
    name = m["shards"][0]["file"]
    shutil.copy(path / name, path / name.replace("-000-", "-009-"))


def _rename(path, m):
    name = m["shards"][1]["file"]
    os.rename(path / name, path / name.replace("-001-", "-007-"))


def _pickled_object(path, m):
    """A shard holding a Python object beyond tensors, with a truthful manifest."""
    name = m["shards"][0]["file"]
    data = torch.load(path / name, weights_only=True)
    data["extra"] = _Evil()
    torch.save(data, path / name)
    m["shards"][0]["bytes"] = os.path.getsize(path / name)
    m["shards"][0]["crc32"] = checkpoint.crc32_of(str(path / name))


class _Evil:
    pass


def _bad_json(path, m):
    return "{ not json"


CORRUPTIONS = {
    # name: (corrupt, exception, message pattern)
    "manifest omits a shard": (_omit_shard, ValueError, r"in no shard"),
    "shards: []": (_empty_shards, ValueError, r"in no shard"),
    "swapped names": (_swap_names, DistributedOptimizerError, r"crc32 .* \(expected"),
    "swapped names and digests": (_swap_names_and_digests, DistributedOptimizerError,
                                  r"renamed or swapped"),
    "edited params": (_edit_params, ValueError, r"parameters \[0\] are in no shard"),
    "a parameter twice": (_duplicate_param, ValueError, r"covered by shards .* \(expected exactly one\)"),
    "a flipped byte": (_flip_byte, DistributedOptimizerError, r"crc32"),
    "64 zeroed bytes": (_zero_64, DistributedOptimizerError, r"crc32"),
    "truncated": (_truncate, ValueError, r"holds \d+ bytes \(expected \d+"),
    "../x": (_dot_dot, ValueError, r"shard name '\.\./x'"),
    "absolute path": (_absolute, ValueError, r"shard name '/"),
    "symlink out": (_symlink_out, ValueError, r"outside .*symlink"),
    "extra shard": (_extra_shard, ValueError, r"-009-.* does not name them"),
    "renamed shard": (_rename, ValueError, r"is missing"),
    "not tensors-only": (_pickled_object, DistributedOptimizerError, r"not a tensors-only"),
    "manifest not JSON": (_bad_json, ValueError, r"manifest\.json' does not parse as JSON"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_load_refuses_each_corruption_before_any_owner_changes(world, tmp_path, case):
    corrupt, error, pattern = CORRUPTIONS[case]
    rrefs, local = harness.make_params()
    dist_opt, ref = build(rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 2)
    path = tmp_path / "ckpt"
    dist_opt.save(str(path))
    harness.train(dist_opt, ref, rrefs, local, 1, first_step=2)
    before = dist_opt.state_dict()
    manifest = _manifest(path)
    text = corrupt(path, manifest)
    if text is not None:
        (path / "manifest.json").write_text(text)
    else:
        _write_manifest(path, manifest)
    with pytest.raises(error, match=pattern) as info:
        dist_opt.load(str(path))
    assert str(path) in str(info.value) or "../x" in str(info.value), str(info.value)
    if isinstance(info.value, DistributedOptimizerError):  # refused by the owner reading it
        # every owner read its part (those not named staged it) and none committed
        assert info.value.failures and len(info.value.failures) + len(info.value.succeeded) == 2
    harness.assert_state_dicts_equal(dist_opt.state_dict(), before)
    # the optimizer goes on exactly as torch.optim does: nothing was half-loaded
    harness.train(dist_opt, ref, rrefs, local, 1, first_step=3)
    harness.assert_params_equal(rrefs, local, case)


def test_the_manifest_records_size_crc32_and_params(world, tmp_path):
    rrefs, local = harness.make_params()
    dist_opt, ref = build(rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 1)
    manifest = dist_opt.save(str(tmp_path))
    covered = sorted(i for s in manifest["shards"] for i in s["params"])
    assert covered == list(range(len(manifest["params"])))
    for shard in manifest["shards"]:
        name = str(tmp_path / shard["file"])
        assert shard["bytes"] == os.path.getsize(name)
        assert shard["crc32"] == checkpoint.crc32_of(name)
        data = torch.load(name, weights_only=True)
        assert data["file"] == shard["file"] and data["params"] == shard["params"]


#: Mounting a tmpfs and setting the immutable attribute need root (CI runs as root).
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: mounts a tmpfs / sets the immutable attribute"
)


def _run(*command):
    done = subprocess.run(list(command), capture_output=True, text=True)
    assert done.returncode == 0, f"{command}: {done.stderr.strip()}"


@needs_root
def test_save_to_a_full_disk_names_the_path_and_the_cause(world, tmp_path):
    rrefs, local = harness.make_params()
    dist_opt, ref = build(rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 1)
    full = tmp_path / "full"
    full.mkdir()
    _run("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full))
    try:
        with open(full / "filler", "wb", buffering=0) as f:  # at most 64 KiB, then ENOSPC
            with pytest.raises(OSError):
                for _ in range(64):
                    f.write(bytes(4096))
        with pytest.raises((DistributedOptimizerError, OSError)) as info:
            dist_opt.save(str(full))
        message = str(info.value)
        assert str(full) in message and "no space left on device" in message.lower(), message
        assert [n for n in os.listdir(full) if not n.startswith(".")] == ["filler"]
    finally:
        subprocess.run(["umount", str(full)], check=False)


@needs_root
def test_save_into_an_immutable_directory_names_the_path_and_the_cause(world, tmp_path):
    rrefs, local = harness.make_params()
    dist_opt, ref = build(rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 1)
    locked = tmp_path / "locked"
    locked.mkdir()
    _run("chattr", "+i", str(locked))
    try:
        with pytest.raises((DistributedOptimizerError, OSError)) as info:
            dist_opt.save(str(locked))
        message = str(info.value)
        assert str(locked) in message and (
            "Operation not permitted" in message or "permission denied" in message
        ), message
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=False)


def test_save_past_the_file_size_limit_names_the_owner_path_and_cause(world, tmp_path):
    rrefs, local = harness.make_params()
    dist_opt, ref = build(rrefs, local)
    harness.train(dist_opt, ref, rrefs, local, 1)
    good = dist_opt.save(str(tmp_path))
    rpc.rpc_sync("worker2", remote.limit_file_size, args=(512,))
    try:
        with pytest.raises(DistributedOptimizerError) as info:
            dist_opt.save(str(tmp_path))
    finally:
        rpc.rpc_sync("worker2", remote.limit_file_size, args=(-1,))
    message = str(info.value)
    assert list(info.value.failures) == ["worker2"], message
    assert str(tmp_path) in message and "file too large" in message, message
    assert _manifest(tmp_path) == good  # the previous checkpoint is intact
    dist_opt.load(str(tmp_path))
