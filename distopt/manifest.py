"""The files of a checkpoint directory, for both checkpoint formats (``distopt.checkpoint``,
RPC; ``distopt.parallel.checkpoint``, data-parallel): atomic writes, the manifest, the
checks a file must pass before it is read, and pruning.

A checkpoint directory holds ``manifest.json``, written last, and the files of one save,
named ``<prefix>-<generation>-...`` with a new hex generation id per save. Every file is
written to a temporary name in the directory, fsync'ed and renamed over its final name, so
the manifest names either the previous save's files or this one's, never a half-written one.

Before any file is read, its name must be a plain file name (no ``/``, ``\\``, ``..``, no
absolute path) whose file lies in the directory itself (no symlink out of it), and its size
and CRC-32 must be those the manifest records: each refusal is a ``ValueError`` that names
the checkpoint, the file and what is wrong.
"""
import contextlib
import json
import os
import re
import resource
import uuid
import zlib
from typing import Any, Callable, Dict, Optional

MANIFEST = "manifest.json"

__all__ = [
    "MANIFEST",
    "check_crc32",
    "check_file",
    "check_name",
    "crc32_of",
    "generation_of",
    "new_generation",
    "prune",
    "read",
    "write",
    "write_atomic",
]


def new_generation() -> str:
    """A new generation id: 16 hex digits, in the names of every file of one save."""
    return uuid.uuid4().hex[:16]


def generation_of(name: str, prefix: str) -> Optional[str]:
    """The generation in ``<prefix>-<generation>-...`` (or its temporary file's name);
    None for other files."""
    match = re.match(rf"^\.?{re.escape(prefix)}-([0-9a-f]+)-", name)
    return match.group(1) if match else None


def read(path: str, fmt: str, version: int, writer: str) -> Dict[str, Any]:
    """The manifest in the directory ``path``, once it parses and has ``fmt`` and ``version``.

    Args:
        path: the checkpoint directory (absolute).
        fmt: the format the manifest must name.
        version: the format version it must name.
        writer: what writes such manifests, for the messages.

    Raises:
        FileNotFoundError: ``path`` holds no manifest.
        ValueError: the manifest does not parse, or has another format or version.
    """
    where = os.path.join(path, MANIFEST)
    try:
        with open(where, "rb") as f:
            manifest = json.loads(f.read().decode())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"Invalid checkpoint path: {path!r} (expected a directory holding {MANIFEST})"
        ) from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(
            f"Invalid checkpoint: {where!r} does not parse as JSON ({exc}); expected the "
            f"manifest that {writer} writes"
        ) from None
    got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    if got != fmt:
        raise ValueError(
            f"Invalid checkpoint {path!r}: {where!r} has format {got!r} (expected {fmt!r}, "
            f"written by {writer})"
        )
    if manifest.get("version") != version:
        raise ValueError(
            f"Invalid checkpoint {path!r}: version {manifest.get('version')!r} (expected "
            f"{version}, whose manifest records each file's size and CRC-32)"
        )
    return manifest


def write(path: str, manifest: Dict[str, Any]) -> None:
    """Write ``manifest`` as ``path/manifest.json``, atomically; call it last in a save."""
    data = json.dumps(manifest, indent=1).encode()

    def write_bytes(name: str) -> None:
        with open(name, "wb") as f:
            f.write(data)

    write_atomic(os.path.join(path, MANIFEST), write_bytes)


def check_name(path: str, name: Any, what: str = "file") -> str:
    """``path/name`` once ``name`` is a plain file name whose file lies in ``path`` itself.

    Args:
        path: the checkpoint directory (absolute).
        name: a file name the manifest gives or one built from its fields.
        what: what the file is, for the message ("shard", "file").

    Raises:
        ValueError: ``name`` is not a string, is empty, ``.`` or ``..``, holds a separator or
            is absolute; or its file is a symlink out of ``path``.
    """
    if not isinstance(name, str) or name in ("", ".", "..") or "\\" in name or (
        name != os.path.basename(name) or os.path.isabs(name)
    ):
        raise ValueError(
            f"Invalid checkpoint {path!r}: {what} name {name!r} (expected a file name inside "
            f"{path!r})"
        )
    full = os.path.join(path, name)
    real = os.path.realpath(full)
    if os.path.dirname(real) != os.path.realpath(path):
        raise ValueError(
            f"Invalid checkpoint {path!r}: {what} {name!r} resolves to {real!r}, outside "
            f"{path!r} (a symlink out of the checkpoint)"
        )
    return full


def check_file(path: str, name: Any, record: Any, what: str = "file", crc: bool = True) -> str:
    """``path/name`` once it is checked against ``record``, the manifest's entry for it.

    Args:
        path: the checkpoint directory (absolute).
        name: the file's name (checked by ``check_name``).
        record: ``{"bytes": size, "crc32": digest}`` from the manifest; None where the
            manifest does not name the file.
        what: what the file is, for the messages.
        crc: whether to read the file for its CRC-32 here (else its reader checks it).

    Raises:
        ValueError: naming the file: not named by the manifest, outside ``path``, missing,
            of another size or another CRC-32.
    """
    full = check_name(path, name, what)
    if not isinstance(record, dict):
        raise ValueError(
            f"Invalid checkpoint {path!r}: {what} {full!r} is not among the files "
            f"{os.path.join(path, MANIFEST)!r} names"
        )
    if not os.path.isfile(full):
        raise ValueError(f"Invalid checkpoint {path!r}: {what} {full!r} is missing")
    size = os.path.getsize(full)
    if size != record.get("bytes"):
        raise ValueError(
            f"Invalid checkpoint {path!r}: {what} {full!r} holds {size} bytes (expected "
            f"{record.get('bytes')}, the manifest's)"
        )
    if crc:
        check_crc32(path, full, record.get("crc32"), what)
    return full


def check_crc32(path: str, full: str, expected: Any, what: str = "file") -> None:
    """Refuse ``full`` unless its CRC-32 is ``expected``, the manifest's.

    Raises:
        ValueError: naming the file and both digests.
    """
    digest = crc32_of(full)
    if digest != expected:
        raise ValueError(
            f"Invalid checkpoint {path!r}: {what} {full!r} has crc32 {digest} (expected "
            f"{expected}, the manifest's CRC-32): the file is corrupted or not the one saved "
            f"under this name"
        )


def crc32_of(name: str) -> str:
    """The CRC-32 of a file's bytes, 8 hex digits. A checksum against corruption, not
    tampering (whoever can rewrite a file can rewrite the manifest): measured on 400 MB
    read back from the page cache, 0.12 s, against 0.27 s for SHA-256."""
    crc = 0
    with open(name, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def prune(path: str, doomed: Callable[[str], bool]) -> None:
    """Remove the files of ``path`` whose names ``doomed`` accepts, and any manifest left in
    a temporary file by a save that died; a file that cannot be removed is left."""
    for name in os.listdir(path):
        if doomed(name) or name.startswith(f".{MANIFEST}.tmp-"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, name))


def write_atomic(
    path: str, write: Callable[[str], Any], written: Optional[Callable[[str], None]] = None
) -> int:
    """Write a file so that ``path`` holds either its old content or all the new one.

    The data goes to a temporary file in the same directory, which is fsync'ed and renamed
    over ``path``; then the directory is fsync'ed so that the rename lasts.

    Args:
        path: the final file name.
        write: writes the whole content into the file name it is given (a file name rather
            than a file object, so that ``torch.save`` uses its own C++ writer).
        written: called with the temporary file's name once the content is in it (a test
            hook of ``distopt.checkpoint``).

    Returns:
        The number of bytes written.

    Raises:
        OSError: naming ``path`` and the cause; ``path`` is unchanged.
    """
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        if written is not None:
            written(tmp)
        fd = os.open(tmp, os.O_WRONLY)
        try:
            os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except Exception as exc:
        cause = _cause(directory, tmp, exc)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        errno = getattr(exc, "errno", None) or 0
        raise OSError(errno, f"Invalid save: could not write {path!r}: {cause}") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return size


def _cause(directory: str, tmp: str, exc: BaseException) -> str:
    """Why a write failed, in words: torch.save's C++ writer reports "iostream error" or
    "open file failed" without the path or the reason, so the likely ones are checked."""
    errno = getattr(exc, "errno", None)
    if errno:
        return f"{os.strerror(errno)} ({type(exc).__name__}: {exc})"
    with contextlib.suppress(OSError):
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and os.path.getsize(tmp) >= limit:
            return f"file too large (the process's RLIMIT_FSIZE is {limit} bytes) ({exc})"
    with contextlib.suppress(OSError):
        stats = os.statvfs(directory)
        if stats.f_bavail * stats.f_frsize < (1 << 20):
            return f"no space left on device ({exc})"
    if not os.access(directory, os.W_OK) or _immutable(directory):
        return f"permission denied: the directory cannot be written ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _immutable(directory: str) -> bool:
    """Whether creating a file in ``directory`` fails with EPERM/EACCES (root passes
    ``os.access`` checks, but not an immutable or read-only directory)."""
    probe = os.path.join(directory, f".probe-{uuid.uuid4().hex[:8]}")
    try:
        with open(probe, "wb"):
            pass
    except PermissionError:
        return True
    except OSError:
        return False
    with contextlib.suppress(OSError):
        os.remove(probe)
    return False
