"""Reading what the examples save, to compare two runs' checkpoints exactly
(``assert_identical``)."""
import json
import os
from typing import Any, Dict, List

import torch

from tests.helpers import assert_identical

__all__ = ["assert_identical", "contents", "latest_folder", "loss_log", "server_contents",
           "shards"]

# Keys of a shard that name the save rather than hold state.
_NAMING = ("file", "generation")


def loss_log(path: str) -> Dict[int, List[str]]:
    """``--loss-log`` lines: step -> every loss logged for it (a redone step has several),
    as exact hex floats."""
    logged: Dict[int, List[str]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            step, value = line.split()
            logged.setdefault(int(step), []).append(value)
    return logged


def latest_folder(directory: str) -> str:
    with open(os.path.join(directory, "latest"), encoding="utf-8") as f:
        return os.path.join(directory, f.read().strip())


def shards(folder: str) -> Dict[str, Any]:
    """What ``DistributedOptimizer.save`` wrote into ``folder``: owner -> its shard, without
    the names of the save (its generation id)."""
    with open(os.path.join(folder, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    out = {}
    for shard in manifest["shards"]:
        payload = torch.load(os.path.join(folder, shard["file"]), weights_only=True)
        out[shard["owner"]] = {k: v for k, v in payload.items() if k not in _NAMING}
    return out


def contents(folder: str) -> Dict[str, Any]:
    """A model_parallel_rnn checkpoint folder: the trainer's file and each owner's shard."""
    return {"trainer": torch.load(os.path.join(folder, "trainer.pt"), weights_only=True),
            **shards(folder)}


def server_contents(folder: str, trainers: int) -> Dict[str, Any]:
    """A parameter_server checkpoint folder: the server's file, and each trainer's file and
    optimizer shards."""
    out: Dict[str, Any] = {
        "server": torch.load(os.path.join(folder, "server.pt"), weights_only=True)
    }
    for k in range(1, trainers + 1):
        sub = os.path.join(folder, f"trainer{k}")
        out[f"trainer{k}"] = {
            "file": torch.load(os.path.join(sub, "trainer.pt"), weights_only=True),
            "optimizer": shards(sub),
        }
    return out
