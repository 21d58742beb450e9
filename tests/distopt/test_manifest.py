"""distopt.manifest, in one process: the checks both checkpoint formats run before reading a
file (its name, size and CRC-32), the manifest's parsing, pruning and atomic writes. The
formats' own refusals, end to end: tests/distopt/test_checkpoint_integrity.py (RPC) and
tests/parallel/test_features.py::test_save_and_load_resume_exactly (data-parallel)."""
import json
import os

import pytest

from distopt import manifest

FORMAT, VERSION, WRITER = "test.format", 2, "the test"


@pytest.fixture
def ckpt(tmp_path):
    """A checkpoint directory holding one file, ``dp-0123abcd-state-rank0.pt``, and a
    manifest that records it truthfully; returns (directory, file name, record)."""
    path = tmp_path / "ckpt"
    path.mkdir()
    name = "dp-0123abcd-state-rank0.pt"
    (path / name).write_bytes(bytes(range(256)) * 4)
    record = {"bytes": 1024, "crc32": manifest.crc32_of(str(path / name))}
    manifest.write(str(path), {"format": FORMAT, "version": VERSION, "files": {name: record}})
    return str(path), name, record


def test_a_truthful_file_passes(ckpt):
    path, name, record = ckpt
    assert manifest.check_file(path, name, record) == os.path.join(path, name)
    assert manifest.read(path, FORMAT, VERSION, WRITER)["files"] == {name: record}


def test_a_symlink_inside_the_directory_passes(ckpt):
    path, name, record = ckpt
    os.symlink(name, os.path.join(path, "alias.pt"))
    assert manifest.check_file(path, "alias.pt", record) == os.path.join(path, "alias.pt")


NAMES = {
    # name given by a manifest: the message's words
    "../x": "file name '../x' (expected a file name inside",
    "..": "file name '..' (expected a file name inside",
    "sub/../../x": "file name 'sub/../../x' (expected a file name inside",
    "dp-/../../x-state-rank0.pt": "file name 'dp-/../../x-state-rank0.pt' (expected a file",
    "/etc/passwd": "file name '/etc/passwd' (expected a file name inside",
    "a\\b": "file name 'a\\\\b' (expected a file name inside",
    "": "file name '' (expected a file name inside",
    None: "file name None (expected a file name inside",
}


@pytest.mark.parametrize("name", list(NAMES), ids=[repr(n) for n in NAMES])
def test_a_name_that_leaves_the_directory_is_refused(ckpt, name):
    path, _, record = ckpt
    with pytest.raises(ValueError) as info:
        manifest.check_file(path, name, record)
    assert str(info.value).startswith(f"Invalid checkpoint {path!r}: "), str(info.value)
    assert NAMES[name] in str(info.value), str(info.value)


def test_a_symlink_out_of_the_directory_is_refused(ckpt, tmp_path):
    path, name, record = ckpt
    os.rename(os.path.join(path, name), tmp_path / name)
    os.symlink(tmp_path / name, os.path.join(path, name))
    with pytest.raises(ValueError) as info:
        manifest.check_file(path, name, record, "shard")
    assert str(info.value) == (
        f"Invalid checkpoint {path!r}: shard {name!r} resolves to {str(tmp_path / name)!r}, "
        f"outside {path!r} (a symlink out of the checkpoint)"
    )


def test_a_file_the_manifest_does_not_name_is_refused(ckpt):
    path, name, _ = ckpt
    with pytest.raises(ValueError, match=r"-state-rank0\.pt' is not among the files "
                                         r"'.*manifest\.json' names"):
        manifest.check_file(path, name, None)


def test_a_missing_file_is_refused(ckpt):
    path, name, record = ckpt
    os.remove(os.path.join(path, name))
    with pytest.raises(ValueError, match=r"file '.*-state-rank0\.pt' is missing$"):
        manifest.check_file(path, name, record)


def test_a_resized_file_is_refused(ckpt):
    path, name, record = ckpt
    with open(os.path.join(path, name), "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match=r"holds 1025 bytes \(expected 1024, the manifest's\)"):
        manifest.check_file(path, name, record)


def test_a_flipped_byte_is_refused_unless_the_reader_checks_it(ckpt):
    path, name, record = ckpt
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    manifest.check_file(path, name, record, crc=False)  # size only: the owner reads the CRC
    with pytest.raises(ValueError, match=rf"has crc32 [0-9a-f]{{8}} \(expected {record['crc32']}, "
                                         r"the manifest's CRC-32\): the file is corrupted"):
        manifest.check_file(path, name, record)


def test_a_manifest_that_is_missing_or_does_not_parse_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected a directory holding manifest.json"):
        manifest.read(str(tmp_path), FORMAT, VERSION, WRITER)
    (tmp_path / "manifest.json").write_bytes(b"\xff{ not json")
    with pytest.raises(ValueError, match=r"manifest\.json' does not parse as JSON .*expected the "
                                         r"manifest that the test writes"):
        manifest.read(str(tmp_path), FORMAT, VERSION, WRITER)


@pytest.mark.parametrize("content, words", [
    ([1, 2], "has format 'list' (expected 'test.format', written by the test)"),
    ({"format": "other"}, "has format 'other' (expected 'test.format'"),
    ({"format": FORMAT, "version": 1}, "version 1 (expected 2,"),
])
def test_a_manifest_of_another_format_or_version_is_refused(tmp_path, content, words):
    (tmp_path / "manifest.json").write_text(json.dumps(content))
    with pytest.raises(ValueError) as info:
        manifest.read(str(tmp_path), FORMAT, VERSION, WRITER)
    assert words in str(info.value), str(info.value)


def test_prune_removes_the_doomed_and_dead_manifest_temporaries_only(ckpt):
    path, name, _ = ckpt
    for other in ("dp-99aa-state-rank0.pt", "dp-99aa-state-rank1.pt", ".manifest.json.tmp-1a2b",
                  "notes.txt"):
        with open(os.path.join(path, other), "w"):
            pass
    manifest.prune(path, lambda n: manifest.generation_of(n, "dp") == "99aa"
                   and n.endswith("-rank0.pt"))
    assert sorted(os.listdir(path)) == sorted(
        ["manifest.json", name, "dp-99aa-state-rank1.pt", "notes.txt"])


def test_generation_of_reads_prefix_and_hex_only():
    assert manifest.generation_of("dp-0123abcd-state-rank0.pt", "dp") == "0123abcd"
    assert manifest.generation_of(".shard-0a1b-000-w.pt.tmp-1234", "shard") == "0a1b"
    assert manifest.generation_of("dp-0123abcd-state-rank0.pt", "shard") is None
    assert manifest.generation_of("dp-/../x-state-rank0.pt", "dp") is None
    assert len(manifest.new_generation()) == 16


def test_a_failed_atomic_write_leaves_the_old_content_and_no_temporary(ckpt):
    path, _, _ = ckpt
    where = os.path.join(path, "manifest.json")
    before = open(where, "rb").read()

    def half_then_fail(name):
        with open(name, "wb") as f:
            f.write(b"{")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match=r"could not write '.*manifest\.json': No space left"):
        manifest.write_atomic(where, half_then_fail)
    assert open(where, "rb").read() == before
    assert not [n for n in os.listdir(path) if ".tmp-" in n]
