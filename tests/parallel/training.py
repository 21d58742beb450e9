"""What the scenario modules of tests/parallel (``*_scenarios.py``) train with: the small
models, their batches and loss, two param groups, an eager stand-in for a class, and the
results as plain data (``flat_params``, ``whole_state_dict``)."""
import contextlib
from typing import Any, Dict, List

import torch

#: Buckets of 64 float32 elements at most: every model here has several.
SMALL_BUCKETS_MB = 256 / 2**20


def make_model(biases: bool = True, seed: int = 0, sizes=(6, 12, 8, 1)) -> torch.nn.Module:
    """Three Linear layers (``sizes``: their widths), Tanh between."""
    torch.manual_seed(seed)
    a, b, c, d = sizes
    return torch.nn.Sequential(
        torch.nn.Linear(a, b, bias=biases), torch.nn.Tanh(),
        torch.nn.Linear(b, c, bias=biases), torch.nn.Tanh(),
        torch.nn.Linear(c, d, bias=biases),
    )


class Branchy(torch.nn.Module):
    """A model whose ``extra`` layer a step may use on every rank, on one, or on none; with
    ``never``, also a layer no step uses."""

    def __init__(self, never: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8, 1)
        self.extra = torch.nn.Linear(8, 1)
        if never:
            self.never = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h) + (self.extra(h) if use_extra else 0.0)


class ComplexModel(torch.nn.Module):
    """Real, complex64 and complex128 parameters (buckets of three dtypes); ``rot.weight``
    (192 elements) is cut inside by ``shard="flat"`` at 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 8)
        self.rot = torch.nn.Linear(8, 24, dtype=torch.complex64)
        self.phase = torch.nn.Parameter(torch.randn(24, dtype=torch.complex128))
        self.head = torch.nn.Linear(24, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x)).to(torch.complex64)
        z = self.rot(h).to(torch.complex128) * self.phase
        return self.head(z.abs().float())


def data(n: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def groups_of(model: torch.nn.Module, lr: float) -> List[Dict[str, Any]]:
    """Two param groups: the first layer at ``lr``, the rest at half of it."""
    params = list(model.parameters())
    first = [p for p in model[0].parameters()]
    rest = [p for p in params if all(p is not q for q in first)]
    return [{"params": first}, {"params": rest, "lr": lr / 2}]


def eager_class(cls: type) -> type:
    """A subclass with no functional twin: DataParallelOptimizer steps it eagerly."""
    return type(f"Eager{cls.__name__}", (cls,), {})


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's elements in one float tensor (a complex one's real and imaginary
    parts, in float64 when the model has any)."""
    params = [p.detach() for p in model.parameters()]
    if not any(p.is_complex() for p in params):
        return torch.cat([p.reshape(-1) for p in params])
    return torch.cat([(torch.view_as_real(p) if p.is_complex() else p).reshape(-1).double()
                      for p in params])


#: Per step: the ranks that use ``Branchy.extra``, and whether ``zero_grad`` then sets the
#: gradients to None. Steps 2 and 3: no rank uses it and its ``.grad`` is zeros (DDP leaves
#: them, torch.optim steps them); step 4: ``.grad`` None (left alone); step 5: one rank uses
#: it (the average with zeros).
UNUSED_STEPS = [((0, 1), False), ((0, 1), False), ((), False), ((), True), ((), False),
                ((1,), False)]

#: Classes whose state or weight decay moves a parameter with a zero gradient, on the fused
#: kernels (those the compiled steps run; torch's single-tensor SGD rounds a 1-element
#: momentum update differently now and then), so that DDP + torch.optim agrees bit for bit.
ZERO_GRAD_CASES = {
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}),
    "SGD-weight_decay": (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1, "fused": True}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2, "fused": True}),
}


def train_unused(model: Branchy, forward: Any, opt: Any, rank: int, passes: int = 1,
                 quiet: Any = None) -> Dict[str, Any]:
    """``UNUSED_STEPS``, each of ``passes`` backward passes (all but the last inside
    ``quiet()`` when given). Per step: ``extra``'s parameters, its weight's ``.grad`` after
    the step (a copy, or None) and whether that is the tensor it was before backward."""
    steps = []
    for step, (users, to_none) in enumerate(UNUSED_STEPS):
        before = model.extra.weight.grad
        for k in range(passes):
            x, y = data(4, seed=50 + 10 * step + 3 * rank + k)
            with quiet() if quiet is not None and k < passes - 1 else contextlib.nullcontext():
                ((forward(x, rank in users) - y) ** 2).mean().backward()
        opt.step()
        grad = model.extra.weight.grad
        steps.append({"extra": flat_params(model.extra), "same_grad": grad is before,
                      "grad": None if grad is None else grad.clone()})
        opt.zero_grad(set_to_none=to_none)
    return {"steps": steps, "params": flat_params(model),
            "never_grad_none": model.never.weight.grad is None}


#: Classes stepped on complex parameters, with torch.optim's options whose kernel the
#: compiled step runs on their ``view_as_real`` (foreach Adam: torch refuses fused=True for
#: complex parameters).
COMPLEX_CASES = {
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2, "foreach": True}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5}),
}


def train_complex(model: ComplexModel, forward: Any, opt: Any, rank: int,
                  steps: int = 4) -> torch.Tensor:
    """``steps`` steps on this rank's batches; the parameters after them."""
    for step in range(steps):
        x, y = data(4, seed=70 + 10 * step + rank)
        ((forward(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return flat_params(model)


def whole_state_dict(opt: Any) -> Dict[str, Any]:
    """``opt.state_dict()`` on every rank; sharded, after ``consolidate_state_dict(to=None)``
    (a collective) has gathered every rank's pieces onto every rank."""
    if getattr(opt, "shard", None) is not None:
        opt.consolidate_state_dict(to=None)
    return opt.state_dict()


def mse_steps(model: torch.nn.Module, opt: Any, batches: List[Any]) -> None:
    """One step of ``opt`` per ``(x, y)`` batch on the mean squared error of ``model(x)``."""
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
