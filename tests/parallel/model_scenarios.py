"""Models shaped like users' (tied embeddings, dropout, activation checkpointing, autocast, a
frozen sub-module, torch.compile), each trained by DDP + torch.optim and by
DataParallelOptimizer on the same batches, in one world (``test_models.py``)."""
import contextlib
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from distopt.parallel import DataParallelOptimizer

VOCAB, WIDTH, SEQ, BATCH = 24, 16, 6, 3
STEPS = 4
#: The kernel both sides run: DataParallelOptimizer's compiled AdamW is torch's fused one.
OPTIMIZER = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01, "fused": True})


class TinyLM(torch.nn.Module):
    """A one-layer transformer language model: input and output embeddings tied (one
    Parameter used twice), dropout, a pre-norm encoder layer; optionally the encoder layer
    under activation checkpointing, and a frozen positional embedding."""

    def __init__(self, checkpointed: bool = False, frozen: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Embedding(SEQ, WIDTH)
        self.layer = torch.nn.TransformerEncoderLayer(
            WIDTH, nhead=2, dim_feedforward=2 * WIDTH, dropout=0.1, batch_first=True,
            norm_first=True,
        )
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        self.checkpointed = checkpointed
        if frozen:
            self.position.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        if self.checkpointed:
            h = checkpoint(self.layer, h, use_reentrant=False)
        else:
            h = self.layer(h)
        return self.head(self.norm(h))


def _tokens(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + 10 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)


#: name -> (model builder, forward context, whether the forward is torch.compile'd)
CASES: Dict[str, Any] = {
    "tied-dropout": (lambda: TinyLM(), contextlib.nullcontext, False),
    "checkpointed": (lambda: TinyLM(checkpointed=True), contextlib.nullcontext, False),
    "bf16-autocast": (lambda: TinyLM(),
                      lambda: torch.autocast("cpu", dtype=torch.bfloat16), False),
    "frozen": (lambda: TinyLM(frozen=True), contextlib.nullcontext, False),
    # aot_eager: torch.compile's graph capture and compiled autograd function, which is what
    # meets the optimizer's hooks; inductor's C++ kernels (12 s to build here) compute the
    # same graph on both sides.
    "compiled": (lambda: TinyLM(), contextlib.nullcontext, True),
}

#: DataParallelOptimizer's runs: name -> options.
RUNS = {"overlap": {}, "no-overlap": {"overlap": False}, "shard-flat": {"shard": "flat"}}


def _train(model: torch.nn.Module, forward: Callable, opt: Any, context: Callable,
           rank: int) -> List[torch.Tensor]:
    """``STEPS`` steps of next-token loss on this rank's batches; the parameters after each.
    Dropout draws from a generator seeded per step and rank, the same for both sides."""
    after = []
    for step in range(STEPS):
        tokens = _tokens(step, rank)
        torch.manual_seed(500 + 10 * step + rank)
        with context():
            logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        after.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return after


def users_models(rank: int, world_size: int) -> Dict[str, Any]:
    """Per case: DDP + torch.optim's parameters after each step, and each ``RUNS`` run's."""
    from torch.nn.parallel import DistributedDataParallel

    cls, kwargs = OPTIMIZER
    out: Dict[str, Any] = {}
    for case, (build, context, compiled) in CASES.items():
        model = build()
        ddp = DistributedDataParallel(model)
        forward = torch.compile(ddp, backend="aot_eager") if compiled else ddp
        out[f"{case}/ddp"] = _train(model, forward, cls(model.parameters(), **kwargs),
                                    context, rank)
        for name, options in RUNS.items():
            model = build()
            forward = torch.compile(model, backend="aot_eager") if compiled else model
            trained = [p for p in model.parameters() if p.requires_grad]
            opt = DataParallelOptimizer(cls, trained, **options, **kwargs)
            out[f"{case}/{name}"] = _train(model, forward, opt, context, rank)
            opt.close()
    return out
