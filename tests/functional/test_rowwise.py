"""FunctionalRowWiseAdagrad and FunctionalPartialRowWiseAdam on their own: eager equals
compiled, state one value per row, refusals (their parity with fbgemm runs through the RPC
path in tests/distopt/sparse/test_rowwise.py)."""
import pytest
import torch

from functional import FunctionalPartialRowWiseAdam, FunctionalRowWiseAdagrad, script_optimizer

CASES = [
    (FunctionalRowWiseAdagrad, {"lr": 0.1, "weight_decay": 0.05, "weight_decay_mode": "l2"}),
    (FunctionalPartialRowWiseAdam, {"lr": 0.1, "betas": (0.8, 0.9), "weight_decay": 0.05}),
]
IDS = ["adagrad-l2", "partial-adam"]


def gradients(step: int, shape):
    """A row-sparse gradient with repeated rows (rows 5..9 never appear)."""
    gen = torch.Generator().manual_seed(step)
    rows = torch.tensor([0, 3, 3, step % 5, 1, 3])
    return torch.sparse_coo_tensor(rows.unsqueeze(0), torch.randn(6, shape[1], generator=gen),
                                   shape)


@pytest.mark.parametrize("cls,kwargs", CASES, ids=IDS)
def test_eager_equals_compiled_and_rows_not_looked_up_stay(cls, kwargs):
    start = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    eager_p, compiled_p = start.clone(), start.clone()
    eager = cls([eager_p], **kwargs)
    compiled = script_optimizer(cls([compiled_p], **kwargs))
    for step in range(3):
        eager.step([gradients(step, start.shape)])
        compiled.step([gradients(step, start.shape)])
    assert torch.equal(eager_p, compiled_p)
    assert torch.equal(eager_p[5:], start[5:]) and not torch.equal(eager_p[:5], start[:5])
    state = eager.state[0]
    assert float(state["step"]) == 3.0
    row_key = "momentum1" if cls is FunctionalRowWiseAdagrad else "momentum2"
    assert state[row_key].shape == (10,) and bool((state[row_key][5:] == 0).all())
    for key, value in compiled.optim.state[0].items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("cls,kwargs", CASES, ids=IDS)
def test_refusals_change_nothing(cls, kwargs):
    p = torch.randn(6, 4)
    opt = cls([p], **kwargs)
    opt.step([gradients(0, p.shape)])
    before = p.clone()
    with pytest.raises(RuntimeError, match="takes sparse gradients only"):
        opt.step([torch.ones_like(p)])
    row_key = "momentum1" if cls is FunctionalRowWiseAdagrad else "momentum2"
    bad = {0: {**opt.state[0], row_key: torch.zeros(5)}}
    with pytest.raises(ValueError, match=row_key):
        opt.set_state(bad)
    assert torch.equal(p, before) and opt.state[0][row_key].shape == (6,)
    with pytest.raises(ValueError, match=r"Invalid params\[0\]: 1-D"):
        cls([torch.zeros(4)], **kwargs)
