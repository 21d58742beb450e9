"""Rank functions for the DCP checks of tests/parallel/test_resume.py (issue 39, item 4):
``opt.dcp_state_dict()`` saved through ``torch.distributed.checkpoint`` on 2 ranks, each
rank writing its own shard, and ``opt.load_dcp`` on 2 and 3 ranks and on 1 (shard=None).

The reference everywhere is the established path: the state consolidated on the saving
ranks (``whole_state_dict``), loaded with ``load_state_dict``; a resume on the saving world
size must equal the uninterrupted run.
"""
import os
import shutil
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from distopt.optim import AdamW4bit, AdamW8bit
from distopt.parallel import DataParallelOptimizer
from tests.helpers import error_of, identical
from tests.parallel.training import flat_params, mse_steps, whole_state_dict

#: name -> (optimizer class, its options, shard when saved on 2 ranks, shard on 3)
RUNS: Dict[str, Any] = {
    "adam": (torch.optim.Adam, {"lr": 1e-2}, "flat", "flat"),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, "flat", "param"),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, "param", "flat"),
    # Quantised state (issue 39, item 1): the 6,400-element weight keeps uint8 codes (4-bit:
    # two elements a byte) and one absmax a block, the others float32; "flat" cuts at a block.
    "adamw8bit": (AdamW8bit, {"lr": 1e-2}, "flat", "param"),
    "adamw4bit": (AdamW4bit, {"lr": 1e-2}, "param", "flat"),
}
#: The runs also loaded on 1 rank, shard=None: saved "flat", "param", and quantised.
ONE_RANK = ("adam", "sgd", "adamw4bit")
SAVED_AT, AFTER = 2, 2
#: Small buckets: the flat cuts fall inside parameters, several buckets.
CAP_MB = 0.05


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 160), torch.nn.Tanh(),
                               torch.nn.Linear(160, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1))


def _batches(seed: int) -> List[Any]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 24, generator=g), torch.randn(8, 1, generator=g))
            for _ in range(SAVED_AT + AFTER)]


def _make(name: str, model: torch.nn.Module, shard: Any, group: Any = None) -> Any:
    cls, kwargs, _, _ = RUNS[name]
    return DataParallelOptimizer(cls, model.parameters(), shard=shard, bucket_cap_mb=CAP_MB,
                                 process_group=group, **kwargs)


class CountingWriter(dcp.FileSystemWriter):
    """A FileSystemWriter that counts the bytes of the optimizer's tensors DCP hands it on
    this rank (what the planner resolves for each item it writes; the model's, replicated,
    DCP spreads over the ranks)."""

    tensor_bytes = 0

    def write_data(self, plan: Any, planner: Any) -> Any:
        resolve = planner.resolve_data

        def counted(item: Any) -> Any:
            data = resolve(item)
            if isinstance(data, torch.Tensor) and item.index.fqn.startswith("optim."):
                self.tensor_bytes += data.numel() * data.element_size()
            return data

        planner.resolve_data = counted
        return super().write_data(plan, planner)


def save_on_two(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """Per run: train, save through DCP (bytes each rank wrote, its own state's bytes, the
    whole state's), the consolidated state and the model saved for the loads elsewhere;
    then the uninterrupted run against a resume from the DCP checkpoint on these ranks."""
    out: Dict[str, Any] = {}
    for name, (_, _, shard, _) in RUNS.items():
        where = os.path.join(path, name)
        model = _model()
        opt = _make(name, model, shard)
        batches = _batches(rank)
        mse_steps(model, opt, batches[:SAVED_AT])
        writer = CountingWriter(where)
        dcp.save({"model": model.state_dict(), "optim": opt.dcp_state_dict()},
                 storage_writer=writer)
        whole = whole_state_dict(opt)
        if rank == 0:
            torch.save(whole, os.path.join(where, "whole.pt"))
        files = {f: os.path.getsize(os.path.join(where, f)) for f in os.listdir(where)}
        kept = _consolidated_kept(model, opt, whole)
        own = opt.state_bytes()
        mse_steps(model, opt, batches[SAVED_AT:])
        straight = flat_params(model)
        stale = _stale_save(model, opt, batches, where + "-stale") if name == "adamw8bit" else None
        opt.close()
        model = _model()
        resumed = _make(name, model, shard)
        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id=where)
        model.load_state_dict(sd["model"])
        resumed.load_dcp(where)
        same = identical(whole_state_dict(resumed), whole)
        mse_steps(model, resumed, batches[SAVED_AT:])
        resumed.close()
        out[name] = {"written": writer.tensor_bytes, "own": own, "files": files,
                     "whole": sum(v.numel() * v.element_size() for e in whole["state"].values()
                                  for v in e.values()),
                     "same_state": same, "equal": torch.equal(flat_params(model), straight),
                     "kept": kept, "stale": stale,
                     "dtypes": sorted({str(v.dtype) for e in whole["state"].values()
                                       for v in e.values()})}
    out["corrupt"] = {"file": _corrupt_copy(rank, path), **_refused(rank, path)}
    out["torch_path"] = _torch_path(rank, os.path.join(path, "torch_path"))
    return out


def _stale_save(model: torch.nn.Module, opt: Any, batches: List[Any], where: str) -> Any:
    """``dcp.save`` of a ``dcp_state_dict()`` taken before a step (its tensors the live
    state): refused at the save on every rank, naming why, no checkpoint written (else the
    newer state would lie under the older CRC-32s, refused only at the load)."""
    sd = {"optim": opt.dcp_state_dict()}
    mse_steps(model, opt, batches[-1:])
    try:
        dcp.save(sd, checkpoint_id=where)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        return ("Invalid dcp.save of 'optim.state." in str(exc)
                and not os.path.exists(os.path.join(where, ".metadata")))
    return "saved"


def _consolidated_kept(model: torch.nn.Module, opt: Any, whole: Dict[str, Any]) -> Any:
    """Sharded: torch's ``get_state_dict`` after ``consolidate_state_dict`` renames the
    parameter ids to names in the dict ``opt.state_dict()`` handed it; a later
    ``opt.state_dict()`` must still give the ids (None unsharded)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if opt.shard is None:
        return None
    ids = (sorted(whole["state"]), [list(g["params"]) for g in whole["param_groups"]])
    get_state_dict(model, opt)
    again = opt.state_dict()
    return (sorted(again["state"]), [list(g["params"]) for g in again["param_groups"]]) == ids


def _torch_path(rank: int, where: str) -> Dict[str, Any]:
    """torch's own calls on an unsharded optimizer: ``get_state_dict(model, opt)`` reads the
    state as it is (``opt.state`` shows the compiled steps' state, so torch does not
    initialise it with a step of lr 0), ``dcp.save`` / ``dcp.load`` and
    ``set_optimizer_state_dict`` resume exactly."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict

    model = _model()
    opt = _make("adam", model, None)
    batches = _batches(rank)
    mse_steps(model, opt, batches[:SAVED_AT])
    before = opt.state_dict()
    model_sd, optim_sd = get_state_dict(model, opt)
    untouched = identical(opt.state_dict(), before)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=where)
    mse_steps(model, opt, batches[SAVED_AT:])
    straight = flat_params(model)
    opt.close()
    model = _model()
    resumed = _make("adam", model, None)
    model_sd, optim_sd = get_state_dict(model, resumed)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=where)
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, resumed, sd["optim"])
    loaded = identical(resumed.state_dict()["state"], before["state"])
    mse_steps(model, resumed, batches[SAVED_AT:])
    resumed.close()
    return {"untouched": untouched, "loaded": loaded,
            "equal": torch.equal(flat_params(model), straight)}


def _corrupt_copy(rank: int, path: str) -> Any:
    """On rank 0, a copy of Adam's checkpoint with one bit flipped in the file that holds
    the last 16 entries of parameter 0's ``exp_avg``; that file's name, on every rank."""
    where = os.path.join(path, "adam-corrupt")
    box: List[Any] = [None]
    if rank == 0:
        shutil.copytree(os.path.join(path, "adam"), where)
        saved = torch.load(os.path.join(where, "whole.pt"), weights_only=True)
        needle = saved["state"][0]["exp_avg"].reshape(-1)[-16:].numpy().tobytes()
        for name in sorted(os.listdir(where)):
            data = bytearray(open(os.path.join(where, name), "rb").read())
            at = data.find(needle)
            if name.endswith(".distcp") and at >= 0:
                data[at + 5] ^= 0x40
                open(os.path.join(where, name), "wb").write(bytes(data))
                box = [name]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _refused(rank: int, path: str) -> Dict[str, Any]:
    """``load_dcp`` of the corrupted copy into a trained optimizer, and of Adam's checkpoint
    into SGD: what each raised, whether the state stayed as it was; training goes on."""
    model = _model()
    opt = _make("adam", model, "flat")
    batches = _batches(rank)
    mse_steps(model, opt, batches[:1])
    before = whole_state_dict(opt)
    got = {"error": error_of(lambda: opt.load_dcp(os.path.join(path, "adam-corrupt")))}
    other = _make("sgd", _model(), "flat")  # another class: refused before anything is read
    got["class"] = error_of(lambda: other.load_dcp(os.path.join(path, "adam")))
    other.close()
    got["unchanged"] = identical(whole_state_dict(opt), before)
    mse_steps(model, opt, batches[1:2])  # no rank was left waiting in a collective
    opt.close()
    return got


def load_on_three(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """Per run: the 2-rank DCP checkpoint loaded on 3 ranks, against the consolidated
    state loaded with load_state_dict: the state right after, and the parameters after
    training on; then on rank 0 alone (a group of one), shard=None, the same."""
    out: Dict[str, Any] = {}
    alone = dist.new_group([0])
    for name, (_, _, _, shard) in RUNS.items():
        where = os.path.join(path, name)
        whole = torch.load(os.path.join(where, "whole.pt"), weights_only=True)
        out[name] = _resumed_alike(name, where, whole, shard, None, rank)
        if rank == 0 and name in ONE_RANK:
            out[f"{name}/one"] = _resumed_alike(name, where, whole, None, alone, rank)
    out["corrupt"] = _refused(rank, path)  # the corrupted chunk read in parts now
    return out


def _resumed_alike(name: str, where: str, whole: Dict[str, Any], shard: Any, group: Any,
                   rank: int) -> Dict[str, Any]:
    """One model and optimizer resumed through ``load_dcp``, one through
    ``load_state_dict(whole)``; whether their state and trained parameters are equal."""
    runs = []
    for how in ("dcp", "state_dict"):
        model = _model()
        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id=where, process_group=group)
        model.load_state_dict(sd["model"])
        opt = _make(name, model, shard, group)
        if how == "dcp":
            opt.load_dcp(where)
        else:
            opt.load_state_dict(whole)
        state = whole_state_dict(opt)
        mse_steps(model, opt, _batches(10 + rank)[:AFTER])
        runs.append((state, flat_params(model), opt.state_bytes()))
        opt.close()
    return {"same_state": identical(runs[0][0], whole) and identical(runs[1][0], whole),
            "equal": torch.equal(runs[0][1], runs[1][1]), "own": runs[0][2]}


def state_view(rank: int, world_size: int) -> Dict[str, Any]:
    """``opt.state`` of a compiled optimizer: a view whose entries refuse a key set (which
    would change nothing) and copy as plain dicts; an in-place tensor write lands."""
    import copy
    import pickle

    model = _model()
    opt = _make("adam", model, None)
    mse_steps(model, opt, _batches(rank)[:1])
    p = next(model.parameters())
    out: Dict[str, Any] = {"keys": sorted(opt.state[p])}
    try:
        opt.state[p]["step"] = torch.tensor(9.0)
        out["set"] = "accepted"
    except TypeError as exc:
        out["set"] = str(exc)
    copied = copy.deepcopy(opt.state[p])
    out["copies"] = type(copied) is dict and type(pickle.loads(pickle.dumps(opt.state[p]))) is dict
    whole = copy.deepcopy(opt.state)
    out["copies"] = out["copies"] and type(whole) is dict and len(whole) == len(list(model.parameters()))
    opt.state[p]["exp_avg"].zero_()
    out["in_place"] = float(opt.state_dict()["state"][0]["exp_avg"].abs().sum())
    opt.close()
    return out
