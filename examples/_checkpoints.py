"""Checkpoint folders the examples share: ``DIR/step-N`` folders and ``DIR/latest``.

A checkpoint is written into its own folder ``DIR/step-N``; only once every part of it is on
disk does ``publish`` replace ``DIR/latest`` (atomically) with the folder's name, then remove
the older folders. Whatever stops a save midway (a killed trainer or owner), ``latest``
names the previous complete checkpoint, which is what a restart resumes from.
"""
import os
import shutil
from typing import Any, Callable, Optional

LATEST_FILE = "latest"


def folder_for(directory: str, step: int) -> str:
    """The folder of the checkpoint taken after ``step``."""
    return os.path.join(directory, f"step-{step:08d}")


def latest_checkpoint(directory: str) -> Optional[str]:
    """The last complete checkpoint folder in ``directory``, or None if there is none.

    Raises:
        ValueError: ``latest`` names something that is not a ``step-N`` folder beside it.
    """
    try:
        with open(os.path.join(directory, LATEST_FILE), encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    if not name.startswith("step-") or os.sep in name or name in (".", ".."):
        raise ValueError(
            f"Invalid checkpoint: {os.path.join(directory, LATEST_FILE)!r} holds {name!r} "
            f"(expected the name of a step-N folder beside it)"
        )
    return os.path.join(directory, name)


def write_durably(path: str, write: Callable[[Any], Any]) -> None:
    """``write(f)`` into a temporary file beside ``path``, fsync, then rename it to ``path``."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def start(directory: str, step: int) -> str:
    """An empty folder for the checkpoint after ``step`` (what a crashed save of that step
    left is removed); returns it.

    Raises:
        ValueError: ``latest`` already names that folder.
    """
    folder = folder_for(directory, step)
    latest = latest_checkpoint(directory)
    if latest is not None and os.path.abspath(latest) == os.path.abspath(folder):
        raise ValueError(f"Invalid step: {step!r} (the latest checkpoint is already after it)")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    return folder


def publish(folder: str) -> None:
    """Name the complete checkpoint ``folder`` in ``latest``, then remove the other folders."""
    directory, name = os.path.split(os.path.abspath(folder))
    write_durably(os.path.join(directory, LATEST_FILE), lambda f: f.write(name.encode()))
    for other in os.listdir(directory):
        if other.startswith("step-") and other != name:
            shutil.rmtree(os.path.join(directory, other), ignore_errors=True)
