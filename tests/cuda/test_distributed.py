"""DistributedOptimizer with CUDA parameters on its owners (all on the one GPU).

A trainer and two owners over TensorPipe with device maps ``{0: 0}`` between every pair: the
owners' loss terms come back to the trainer as CUDA tensors, the gradients stay on the
owners' GPU in the autograd context, the compiled Adam step runs there; gradient clipping,
state_dict (CPU copies to the trainer), save / load and a sharded embedding table on the GPU
with SparseAdam are checked against torch.optim and torch.nn.utils on the same device in this
process.
"""
import io

import pytest
import torch
import torch.nn.functional as F

from tests import worlds
from tests.cuda import remote
from tests.cuda.conftest import CUDA, DEVICE

pytestmark = CUDA

LIMIT_S = 240


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = worlds.CONTEXT.Queue()
    port = worlds.free_port()
    folder = str(tmp_path_factory.mktemp("cuda_rpc"))
    with worlds.spawned(*[(remote.run, (rank, port, str(DEVICE), out, folder))
                          for rank in range(len(remote.NAMES))]):
        status, result = out.get(timeout=LIMIT_S)
    assert status == "ok", result
    return torch.load(io.BytesIO(result), weights_only=False)


def _reference():
    """The same training in this process with torch.optim on the device."""
    params = [remote.initial(k).to(DEVICE).requires_grad_() for k in range(len(remote.SHAPES))]
    opt = torch.optim.Adam(params, lr=0.05)
    table = torch.randn(*remote.TABLE, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    table.requires_grad_()
    sparse = torch.optim.SparseAdam([table], lr=0.05)
    norms = []
    for step in range(remote.STEPS):
        opt.zero_grad()
        sparse.zero_grad()
        loss = sum(remote.term(p, remote.data(step, k)) for k, p in enumerate(params))
        emb = F.embedding(remote.rows(step).to(DEVICE), table, sparse=True).pow(2).sum()
        (loss + emb).backward()
        if step == remote.CLIP_AT:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, remote.MAX_NORM)))
        opt.step()
        sparse.step()
    return params, opt, table, norms


def test_parameters_stay_on_the_device_and_equal_torch_optim(trained) -> None:
    params, _, _, _ = _reference()
    assert trained["devices"] == [str(DEVICE if DEVICE.index is not None or DEVICE.type == "cpu"
                                      else torch.device(DEVICE.type, 0))] * len(params)
    for k, (got, want) in enumerate(zip(trained["params"], params)):
        torch.testing.assert_close(got, want.detach().cpu(), rtol=1e-5, atol=1e-6, msg=f"param {k}")


def test_clip_grad_norm_equals_torch(trained) -> None:
    _, _, _, norms = _reference()
    assert trained["norms"] == pytest.approx(norms, rel=1e-5)


def test_state_dict_reaches_the_trainer_as_cpu_copies(trained) -> None:
    _, opt, _, _ = _reference()
    assert trained["state_devices"] == ["cpu"]
    theirs = opt.state_dict()["state"]
    for i, entry in theirs.items():
        for key, value in entry.items():
            torch.testing.assert_close(trained["state"]["state"][i][key], value.cpu(),
                                       rtol=1e-5, atol=1e-6, msg=f"state[{i}][{key!r}]")


def test_load_restores_the_saved_state(trained) -> None:
    before, after = trained["state"]["state"], trained["reloaded"]["state"]
    assert sorted(before) == sorted(after)
    for i in before:
        for key in before[i]:
            assert torch.equal(before[i][key], after[i][key]), f"state[{i}][{key!r}]"


def test_sharded_embedding_on_the_device_equals_sparse_adam(trained) -> None:
    _, _, table, _ = _reference()
    torch.testing.assert_close(trained["table"], table.detach().cpu(), rtol=1e-5, atol=1e-6)


def test_a_step_is_complete_before_the_next_request_reads(trained) -> None:
    """TensorPipe runs each request on streams of its own; the owner's step synchronizes its
    device before reading the gradients and before replying (pytorch/pytorch#57960)."""
    assert trained["race"] == [[-float(n), -float(n)] for n in range(remote.RACE_STEPS + 1)]


def test_cuda_owners_step_on_the_synchronizing_path(trained) -> None:
    flags = [f for owner in trained["exclusive"] for f in owner]
    assert flags and not any(flags) if DEVICE.type == "cuda" else all(flags)
