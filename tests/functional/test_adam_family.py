"""Adam-family options the parity table cannot check against torch.optim on CPU."""
import pytest
import torch

from functional import script_optimizer, to_torch_state_dict
from functional.adam import FunctionalAdam, FunctionalAdamW
from functional.adamax import FunctionalAdamax
from functional.nadam import FunctionalNAdam
from functional.radam import FunctionalRAdam

CLASSES = [FunctionalAdam, FunctionalAdamW, FunctionalAdamax, FunctionalNAdam, FunctionalRAdam]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_capturable_is_recorded_in_the_state_dict(cls, compiled: bool) -> None:
    """capturable, True or False, is kept and handed on in the param group, as torch.optim's
    state_dict has it (the capturable steps' numbers are checked in test_capturable.py)."""
    torch_cls = getattr(torch.optim, cls.__name__[len("Functional"):])
    for capturable in (True, False):
        optim = cls([torch.ones(3, 2)], lr=0.01, capturable=capturable)
        if compiled:
            optim = script_optimizer(optim)
        optim.step([torch.ones(3, 2)])
        group = to_torch_state_dict(optim, torch_cls)["param_groups"][0]
        assert group["capturable"] is capturable


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_sparse_gradients_are_rejected_like_torch(cls) -> None:
    p = torch.zeros(3, 2)
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        cls([p]).step([torch.ones(3, 2).to_sparse()])


@pytest.mark.parametrize("cls", [FunctionalAdam, FunctionalAdamW], ids=lambda c: c.__name__)
def test_adam_flag_rules_match_torch(cls) -> None:
    torch_cls = getattr(torch.optim, cls.__name__[len("Functional"):])
    p = [torch.zeros(2, requires_grad=True)]
    for kwargs, error in [
        ({"lr": torch.tensor(0.1), "foreach": True}, ValueError),
        ({"betas": (torch.tensor(0.9), 0.999)}, ValueError),
        ({"betas": (torch.tensor(0.9), torch.tensor(0.99)), "foreach": True}, ValueError),
        ({"fused": True, "differentiable": True}, RuntimeError),
        ({"fused": True, "foreach": True}, RuntimeError),
    ]:
        with pytest.raises(error):
            torch_cls(p, **kwargs)
        with pytest.raises(error):
            cls(p, **kwargs)


def test_adam_tensor_betas_become_floats() -> None:
    optim = FunctionalAdam([torch.zeros(2)], betas=(torch.tensor(0.8), torch.tensor(0.9)))
    assert optim.betas == pytest.approx((0.8, 0.9))


# (class, options): every kernel our Adam steps Tensor betas on (fused, foreach, capturable).
TENSOR_BETAS_ROWS = [
    (FunctionalAdam, {}),
    (FunctionalAdam, {"fused": False, "amsgrad": True}),
    (FunctionalAdam, {"capturable": True, "weight_decay": 0.1}),
    (FunctionalAdamW, {}),
    (FunctionalAdamW, {"fused": False}),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("cls, options", TENSOR_BETAS_ROWS,
                         ids=[f"{c.__name__}-{o}" for c, o in TENSOR_BETAS_ROWS])
def test_tensor_betas_are_read_at_every_step(cls, options, compiled: bool) -> None:
    """torch.optim reads Tensor betas at every step, so changing them in place (as for a
    Tensor lr) takes effect; set_hyperparameter fills them in place, and the state_dict
    hands on their current values. Ours used their values at construction (0.03 apart
    from torch.optim after 8 steps)."""
    torch_cls = getattr(torch.optim, cls.__name__[len("Functional"):])
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)]
    grads = [[torch.randn(s.shape, generator=gen) for s in start] for _ in range(8)]
    ref = [s.clone().requires_grad_() for s in start]
    ref_betas = (torch.tensor(0.9), torch.tensor(0.999))
    ref_options = {k: v for k, v in options.items() if k not in ("fused", "capturable")}
    reference = torch_cls(ref, lr=0.01, betas=ref_betas, foreach=False, **ref_options)
    params = [s.clone() for s in start]
    betas = (torch.tensor(0.9), torch.tensor(0.999))
    optim = cls(params, lr=0.01, betas=betas, **options)
    opt = script_optimizer(optim) if compiled else optim
    for step in range(8):
        if step == 3:
            ref_betas[0].fill_(0.5)
            betas[0].fill_(0.5)
        if step == 5:
            ref_betas[0].fill_(0.7)
            ref_betas[1].fill_(0.8)
            opt.set_hyperparameter("betas", [0.7, 0.8])
        for p, g in zip(ref, grads[step]):
            p.grad = g.clone()
        reference.step()
        opt.step([g.clone() for g in grads[step]])
        for a, b in zip(params, ref):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    assert betas[0].item() == pytest.approx(0.7) and betas[1].item() == pytest.approx(0.8)
    group = to_torch_state_dict(opt, torch_cls)["param_groups"][0]
    assert [b.item() for b in group["betas"]] == [b.item() for b in betas]
