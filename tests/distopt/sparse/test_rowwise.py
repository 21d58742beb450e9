"""RowWiseAdagrad and PartialRowWiseAdam through the RPC path (issue 39, item 2).

RowWiseAdagrad against fbgemm-gpu-cpu 1.8.0's own CPU step (``EXACT_ROWWISE_ADAGRAD``,
sequence lookups, ``EmbeddingLocation.HOST``) on the same rows, weight-decay mode by mode;
PartialRowWiseAdam, which fbgemm 1.8.0 cannot step on the CPU, against its CUDA kernel's
rule evaluated in float64 here. Both over several steps of repeated indices in several
lookups of two tables; then state keyed the same under every partition, resumes and bad
arguments.
"""
import types

import numpy as np
import pytest
import torch
import torch.distributed.autograd as dist_autograd
from distopt.sparse import PartialRowWiseAdam, RowWiseAdagrad, ShardedEmbedding
from tests.distopt.sparse import harness

#: (rows, dim) of the two tables: fbgemm takes dims that are multiples of 4.
TABLES = ((23, 8), (9, 4))
STEPS = 4
#: Our weight_decay_mode -> the name of fbgemm's WeightDecayMode.
MODES = {"none": "NONE", "l2": "L2", "decouple": "DECOUPLE"}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between ``a`` and ``b`` (float32, same signs) in units in the last place."""
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    assert bool(((a < 0) == (b < 0)).all() | (a == b).all())
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def fbgemm() -> types.SimpleNamespace:
    """fbgemm-gpu-cpu's names these tests use, imported at first use rather than at
    collection (the import takes about 3 s, which every test worker would pay)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    from fbgemm_gpu.tbe.config.embedding_config import ComputeDevice
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    return types.SimpleNamespace(
        EmbOptimType=EmbOptimType, EmbeddingLocation=EmbeddingLocation, PoolingMode=PoolingMode,
        SplitTableBatchedEmbeddingBagsCodegen=SplitTableBatchedEmbeddingBagsCodegen,
        ComputeDevice=ComputeDevice, WeightDecayMode=WeightDecayMode)


def make_tables(partition: str, owners=harness.OWNERS):
    return [ShardedEmbedding(n, d, list(owners), partition=partition, seed=20 + i)
            for i, (n, d) in enumerate(TABLES)]


def fbgemm_tables(sharded, mode: str, **kwargs):
    """One fbgemm TBE per table (sequence lookups, on the host), holding the same rows."""
    fb = fbgemm()
    tbes = []
    for emb in sharded:
        tbe = fb.SplitTableBatchedEmbeddingBagsCodegen(
            [(emb.num_embeddings, emb.embedding_dim, fb.EmbeddingLocation.HOST,
              fb.ComputeDevice.CPU)],
            optimizer=fb.EmbOptimType.EXACT_ROWWISE_ADAGRAD, pooling_mode=fb.PoolingMode.NONE,
            weight_decay_mode=fb.WeightDecayMode[MODES[mode]], **kwargs)
        with torch.no_grad():
            tbe.split_embedding_weights()[0].copy_(emb.full_weight())
        tbes.append(tbe)
    return tbes


def one_lookup(step: int):
    """The harness's lookups of ``step``, each table's joined into one (rows repeat)."""
    return [[torch.cat([idx.reshape(-1).to(torch.int64) for idx in lookups])]
            for lookups in harness.step_lookups(step)]


def loss_of(lookup, lookups, step: int) -> torch.Tensor:
    """The harness's loss over ``lookups`` (per table, a list of index tensors)."""
    terms = []
    for t, table_lookups in enumerate(lookups):
        for j, idx in enumerate(table_lookups):
            rows = lookup(t, idx)
            terms.append((rows - harness.targets(step + j, tuple(rows.shape))).pow(2).sum())
    return torch.stack(terms).sum()


def fbgemm_step(tbes, lookups, step: int) -> None:
    """One step on fbgemm: each table's lookups in one forward, in the order made."""
    pieces = []
    for tbe, table_lookups in zip(tbes, lookups):
        flat = torch.cat([idx.reshape(-1).to(torch.int64) for idx in table_lookups])
        rows = tbe(flat, torch.tensor([0, flat.numel()]))
        split = rows.split([idx.numel() for idx in table_lookups])
        pieces.append(iter([r.view(*idx.shape, -1) for r, idx in zip(split, table_lookups)]))
    loss_of(lambda t, idx: next(pieces[t]), lookups, step).backward()


def dist_step(sharded, opt, lookups, step: int) -> None:
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [loss_of(lambda t, idx: sharded[t](idx), lookups, step)])
        opt.step(ctx)


@pytest.mark.parametrize("lookups_of", [one_lookup, harness.step_lookups],
                         ids=["one-lookup", "several-lookups"])
def test_rowwise_adagrad_equals_fbgemm_cpu(world, lookups_of):
    """Bit for bit, weights and momentum1, when a table is looked up once per step (rows
    repeated in it: each row's gradients summed in order, as fbgemm sums them). With
    several lookups per step, torch's backward adds the lookups' sparse gradients merging
    some entries of a row as it meets them, an order of addition fbgemm does not follow:
    the sums differ in their last bit, and the results by a few ulps (measured: at most 4
    after 4 steps)."""
    kwargs = {"learning_rate": 0.05, "eps": 1e-8, "weight_decay": 0.02}
    measured = {}
    for mode in MODES:
        sharded = make_tables("hash")
        opt = RowWiseAdagrad(sharded, lr=0.05, eps=1e-8, weight_decay=0.02,
                             weight_decay_mode=mode)
        tbes = fbgemm_tables(sharded, mode, **kwargs)
        for step in range(STEPS):
            dist_step(sharded, opt, lookups_of(step), step)
            fbgemm_step(tbes, lookups_of(step), step)
        state = opt.state_dict()["state"]
        measured[mode] = max(
            max(ulps(emb.full_weight(), tbe.split_embedding_weights()[0].detach()),
                ulps(state[t]["momentum1"], tbe.split_optimizer_states()[0][0]))
            for t, (emb, tbe) in enumerate(zip(sharded, tbes)))
        assert [float(state[t]["step"]) for t in state] == [STEPS, STEPS]
    print(f"RowWiseAdagrad vs fbgemm, {lookups_of.__name__}: max ulps {measured}")
    if lookups_of is one_lookup:
        assert measured == {"none": 0, "l2": 0, "decouple": 0}
    else:
        assert max(measured.values()) <= 4, measured


def fbgemm_partial_rowwise_adam_row(w, g, m1, m2, it, lr, betas, eps, weight_decay):
    """fbgemm 1.8.0's PARTIAL_ROWWISE_ADAM update of one row, transcribed from its CUDA
    kernel (``codegen/genscript/optimizers.py``) into numpy scalars: float32 operands and
    hyper-parameters (its kernel's arguments), float64 where C++ promotes (``1.0 - beta``),
    one rounding in ``fma``, the row's squares added one after another (the CUDA kernel's
    warp reduction adds them in another order). Returns (w, m1, m2) of the row, float32."""
    f32, f64 = np.float32, np.float64
    lr, b1, b2, eps, wd = (f32(x) for x in (lr, betas[0], betas[1], eps, weight_decay))
    total = f32(0.0)
    for x in g:
        total = f32(total + f32(x * x))
    g_avg = f32(total / f32(len(g)))
    v_t = f64(g_avg) * (1.0 - f64(b2)) + f64(f32(m2 * b2))
    v_hat = f32(v_t / (1.0 - f64(f32(f64(b2) ** it))))
    one_minus_b1 = f32(1.0 - f64(b1))
    m = (g.astype(f64) * f64(one_minus_b1) + (m1 * b1).astype(f64)).astype(f32)
    denom = f32(f32(np.sqrt(v_hat)) + eps)
    update = f64(lr) * (m.astype(f64) / (1.0 - f64(f32(f64(b1) ** it))) / f64(denom)
                        + (wd * w).astype(f64))
    return (w.astype(f64) - update).astype(f32), m, f32(v_t)


def test_partial_rowwise_adam_equals_fbgemms_kernel_rule(world):
    """fbgemm 1.8.0 refuses PARTIAL_ROWWISE_ADAM on the CPU (so the reference is its CUDA
    kernel's rule, transcribed; a later fbgemm that steps it on the CPU fails this first
    check, and should become the reference)."""
    kwargs = {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}
    fb = fbgemm()
    with pytest.raises(AssertionError, match="partial_row_wise_adam is not supported in CPU"):
        fb.SplitTableBatchedEmbeddingBagsCodegen(
            [(8, 4, fb.EmbeddingLocation.HOST, fb.ComputeDevice.CPU)],
            optimizer=fb.EmbOptimType.PARTIAL_ROWWISE_ADAM)
    sharded = make_tables("range")
    opt = PartialRowWiseAdam(sharded, **kwargs)
    weights = [emb.full_weight().numpy() for emb in sharded]
    m1 = [np.zeros_like(w) for w in weights]
    m2 = [np.zeros(w.shape[0], dtype=np.float32) for w in weights]
    for step in range(STEPS):
        lookups = one_lookup(step)
        dist_step(sharded, opt, lookups, step)
        tables = [torch.from_numpy(w.copy()) for w in weights]
        rows = [table[idx].requires_grad_() for table, [idx] in zip(tables, lookups)]
        loss_of(lambda t, idx: rows[t], lookups, step).backward()
        for t, [idx] in enumerate(lookups):
            grads = rows[t].grad.numpy()
            for r in dict.fromkeys(idx.tolist()):  # each row once, summed in lookup order
                g = np.zeros(grads.shape[1], dtype=np.float32)
                for k in (idx == r).nonzero().reshape(-1).tolist():
                    g = g + grads[k]
                weights[t][r], m1[t][r], m2[t][r] = fbgemm_partial_rowwise_adam_row(
                    weights[t][r], g, m1[t][r], m2[t][r], step + 1, **kwargs)
    state = opt.state_dict()["state"]
    worst = max(max(ulps(emb.full_weight(), torch.from_numpy(w)),
                    ulps(state[t]["momentum1"], torch.from_numpy(a)),
                    ulps(state[t]["momentum2"], torch.from_numpy(b)))
                for t, (emb, w, a, b) in enumerate(zip(sharded, weights, m1, m2)))
    print(f"PartialRowWiseAdam vs fbgemm's kernel rule: max ulps {worst}")
    assert worst == 0


@pytest.mark.parametrize("cls,kwargs", [
    (RowWiseAdagrad, {"lr": 0.05, "weight_decay": 0.01, "weight_decay_mode": "l2"}),
    (PartialRowWiseAdam, {"lr": 0.05, "weight_decay": 0.01}),
], ids=["adagrad", "adam"])
def test_state_loads_under_another_partition_and_resumes_exactly(world, tmp_path, cls, kwargs):
    ranged = make_tables("range")
    opt = cls(ranged, **kwargs)
    harness.train(ranged, opt, None, None, range(2))
    saved = opt.state_dict()
    opt.save(str(tmp_path))
    hashed = [ShardedEmbedding.from_pretrained(e.full_weight(), e.owners, partition="hash")
              for e in ranged]
    same = [ShardedEmbedding.from_pretrained(e.full_weight(), e.owners, partition="range")
            for e in ranged]
    harness.train(ranged, opt, None, None, range(2, 4))
    other = cls(hashed, **kwargs)
    other.load_state_dict(saved)
    assert_same_state(other.state_dict(), saved, cls)  # keys and values of any partition
    resumed = cls(same, **kwargs)
    resumed.load(str(tmp_path))
    for tables, o in ((hashed, other), (same, resumed)):
        harness.train(tables, o, None, None, range(2, 4))
        for a, b in zip(ranged, tables):
            assert torch.equal(a.full_weight(), b.full_weight())
        assert_same_state(o.state_dict(), opt.state_dict(), cls)


def assert_same_state(got, want, cls) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"]) == [0, 1]
    keys = ["momentum1", "step"] if cls is RowWiseAdagrad else ["momentum1", "momentum2", "step"]
    for t in want["state"]:
        assert sorted(got["state"][t]) == keys
        for key in keys:
            assert torch.equal(got["state"][t][key], want["state"][t][key]), (t, key)
    rows = [n for n, _ in TABLES]
    shapes = [tuple(want["state"][t]["momentum1"].shape) for t in range(2)]
    assert shapes == ([(n,) for n in rows] if cls is RowWiseAdagrad
                      else [(n, d) for n, d in TABLES])


BAD = [
    (RowWiseAdagrad, {"lr": -0.1}, "Invalid lr: -0.1 (expected >= 0)"),
    (RowWiseAdagrad, {"eps": -1e-8}, "Invalid eps: -1e-08 (expected >= 0.0)"),
    (RowWiseAdagrad, {"weight_decay": -0.5}, "Invalid weight_decay: -0.5 (expected >= 0.0)"),
    (RowWiseAdagrad, {"weight_decay_mode": "L2"},
     "Invalid weight_decay_mode: 'L2' (expected one of ['none', 'l2', 'decouple'])"),
    (RowWiseAdagrad, {"duplicates": "max"},
     "Invalid duplicates: 'max' (expected one of ['sum', 'mean'])"),
    (PartialRowWiseAdam, {"betas": (0.9, 1.0)}, "Invalid betas[1]: 1.0 (expected in [0, 1))"),
    (PartialRowWiseAdam, {"eps": -1.0}, "Invalid eps: -1.0 (expected >= 0.0)"),
]


def test_bad_arguments_are_refused_before_any_state_changes(world):
    sharded = make_tables("hash")
    opt = RowWiseAdagrad(sharded, lr=0.05)
    harness.train(sharded, opt, None, None, range(1))
    before = opt.state_dict()
    for cls, kwargs, message in BAD:
        with pytest.raises(ValueError) as raised:
            cls(sharded, **kwargs)
        assert message in str(raised.value), (kwargs, str(raised.value))
    bad = {"state": {0: {"momentum1": torch.zeros(5), "step": torch.tensor(1.0)}},
           "param_groups": before["param_groups"]}
    with pytest.raises(ValueError, match=r"state\[0\]\['momentum1'\] has 5 rows \(expected 23"):
        opt.load_state_dict(bad)
    assert_same_state(opt.state_dict(), before, RowWiseAdagrad)
