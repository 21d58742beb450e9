"""The TorchScript workarounds of functional/_kernels.py, each checked where it would bite.

1. In-place kernels on lists built inside a compiled method are removed as dead code unless
   the lists escape (``gather`` writes them into the class's ``live`` attribute): a dropped
   update leaves a parameter or a state tensor as it was. Every case of the parity table, on
   every kernel path, must change each parameter that has a gradient and every state tensor
   that the eager step changes, by the same bits.
2. Identical ``zeros_like`` calls are merged, and ``torch.zeros(())`` is folded into one
   constant: two state entries would then share memory. No two state tensors of a compiled
   optimizer may share storage, across parameters and across instances.
"""
from typing import Dict, List

import pytest
import torch

from functional import script_optimizer

from .case import Case
from .cases import ALL_CASES

# Kernel paths: the default (fused where torch has a CPU kernel) and foreach.
PATHS = [{}, {"foreach": True}]


def _cases() -> List[Case]:
    return [c for c in ALL_CASES if c.dtype == torch.float32]


def _grads(case: Case, step: int):
    """Every parameter gets a gradient, so every one must move."""
    gen = torch.Generator().manual_seed(step)
    grads = []
    for s in case.shapes:
        g = torch.randn(s, generator=gen, dtype=case.dtype)
        if case.sparse:
            rows = torch.tensor([[0, s[0] - 1]])
            g = torch.sparse_coo_tensor(rows, g[rows[0]], s)
        grads.append(g)
    return grads


def _run(case: Case, extra: Dict, compiled: bool):
    params = case.make_params()
    optim = case.functional_cls(params, **case.kwargs_copy(), **extra)
    opt = script_optimizer(optim) if compiled else optim
    states = []
    for step in range(3):
        opt.step(_grads(case, step))
        state = opt.get_state() if compiled else opt.state
        states.append({i: {k: v.clone() for k, v in e.items()} for i, e in state.items()})
    return params, states, (opt.get_state() if compiled else opt.state)


def _accepts(case: Case, extra: Dict) -> bool:
    if case.sparse or "foreach" in case.kwargs or "fused" in case.kwargs:
        return not extra
    try:
        case.functional_cls([torch.zeros(2)], **case.kwargs_copy(), **extra)
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


ROWS = [(c, e) for c in _cases() for e in PATHS if _accepts(c, e)]


@pytest.mark.parametrize("case, extra", ROWS, ids=[f"{c.id}-{e}" for c, e in ROWS])
def test_no_compiled_update_is_dropped(case: Case, extra: Dict) -> None:
    start = case.make_params()
    eager_params, eager_states, _ = _run(case, extra, compiled=False)
    params, states, _ = _run(case, extra, compiled=True)
    for i, (p, q, s) in enumerate(zip(params, eager_params, start)):
        assert not torch.equal(p, s), f"params[{i}] did not move in compiled mode"
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for step, (ours, eager) in enumerate(zip(states, eager_states)):
        assert sorted(ours) == sorted(eager)
        for i in eager:
            assert sorted(ours[i]) == sorted(eager[i])
            for key, value in eager[i].items():
                mine = ours[i][key]
                if value.is_sparse:
                    value, mine = value.to_dense(), mine.to_dense()
                torch.testing.assert_close(
                    mine, value, rtol=0, atol=0, msg=f"step {step}: state[{i}]['{key}']")


def _storages(state) -> List[int]:
    return [v.untyped_storage().data_ptr() for e in state.values() for v in e.values()
            if not v.is_sparse and v.numel() > 0]


@pytest.mark.parametrize("case", _cases(), ids=[c.id for c in _cases()])
def test_no_two_state_tensors_share_memory(case: Case) -> None:
    _, _, first = _run(case, {}, compiled=True)
    _, _, second = _run(case, {}, compiled=True)
    pointers = _storages(first) + _storages(second)
    assert len(pointers) == len(set(pointers))
