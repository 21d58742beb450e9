"""Checkpoint folders the examples share: ``DIR/step-N`` folders and ``DIR/latest``.

A checkpoint is written into its own folder ``DIR/step-N``; only once every part of it is on
disk does ``publish`` replace ``DIR/latest`` (atomically) with the folder's name, then remove
the older folders. Whatever stops a save midway (a killed trainer or owner), ``latest``
names the previous complete checkpoint, which is what a restart resumes from.
"""
import os
import pickle
import re
import shutil
from typing import Any, Dict, Optional, Sequence

import torch

from distopt.checkpoint import write_atomic

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
    where = os.path.join(directory, LATEST_FILE)
    if not re.fullmatch(r"step-\d+", name):
        raise ValueError(
            f"Invalid checkpoint: {where!r} holds {name!r} (expected the name of a step-N "
            f"folder beside it)"
        )
    folder = os.path.join(directory, name)
    if not os.path.isdir(folder):
        raise ValueError(f"Invalid checkpoint: {where!r} names {name!r}, which is missing")
    return folder


def step_of(folder: str) -> int:
    """The step a ``step-N`` folder was saved after."""
    return int(os.path.basename(folder)[len("step-"):])


def resumable(options: Any, file: str, keys: Sequence[str]) -> Optional[str]:
    """The checkpoint folder a run with these ``options`` continues, or None for a fresh run.

    ``options`` has ``checkpoint`` (DIR), ``resume`` (a checkpoint must be there; optional)
    and ``auto_resume`` (continue one if there). The options named in ``keys`` must equal
    those the checkpoint's ``file`` recorded (``options_of``): a resumed run continues the
    run that saved it.

    Raises:
        ValueError: DIR holds a checkpoint but the run does not resume (its first save would
            remove it), ``--resume`` without a checkpoint, a broken ``latest`` or ``file``, or
            an option that differs from the checkpoint's; the message names what and where.
    """
    directory = options.checkpoint
    if not directory:
        return None
    folder = latest_checkpoint(directory)
    if folder is None:
        if getattr(options, "resume", False):
            raise ValueError(f"Invalid --checkpoint: {directory!r} holds no checkpoint to "
                             f"resume (no {LATEST_FILE!r} file)")
        return None
    if not (getattr(options, "resume", False) or options.auto_resume):
        raise ValueError(
            f"Invalid --checkpoint: {directory!r} already holds a checkpoint (after step "
            f"{step_of(folder)}); pass --auto-resume to continue it, or give another directory"
        )
    path = os.path.join(folder, file)
    try:
        saved = torch.load(path, weights_only=True)["options"]
    except (OSError, KeyError, RuntimeError, pickle.UnpicklingError) as exc:
        raise ValueError(f"Invalid checkpoint: {path!r} cannot be read ({exc!r})") from None
    for key in keys:
        if saved.get(key) != getattr(options, key):
            raise ValueError(
                f"Invalid --{key.replace('_', '-')}: {getattr(options, key)!r} (the checkpoint "
                f"in {folder!r} was saved by a run with {saved.get(key)!r}; a resumed run takes "
                f"the options of the run it continues)"
            )
    return folder


def options_of(options: Any, keys: Sequence[str]) -> Dict[str, Any]:
    """The options a checkpoint records, for ``resumable`` to compare."""
    return {key: getattr(options, key) for key in keys}


def remove_unpublished(directory: str) -> None:
    """Remove the ``step-N`` folders that ``latest`` does not name: older checkpoints, and
    saves a crash cut short."""
    latest = latest_checkpoint(directory)
    keep = None if latest is None else os.path.basename(latest)
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.startswith("step-") and name != keep:
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def publish(folder: str) -> None:
    """Name the complete checkpoint ``folder`` in ``latest`` (written atomically: temporary
    file, fsync, rename), then remove the other folders."""
    directory, name = os.path.split(os.path.abspath(folder))
    write_atomic(os.path.join(directory, LATEST_FILE), lambda tmp: _write_text(tmp, name))
    remove_unpublished(directory)


def save_tensors(path: str, obj: Any) -> None:
    """``torch.save(obj)`` into ``path``, atomically (``distopt.checkpoint.write_atomic``)."""
    write_atomic(path, lambda tmp: torch.save(obj, tmp))


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
