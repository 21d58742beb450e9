"""8-bit and 4-bit optimizer state beside torch's fused AdamW, bitsandbytes and torchao.

Prints, in one run on this machine:
- state bytes per parameter after one step;
- step time (median of --repeats steps) on one 4M-element parameter and on --many parameters
  of 1M, with each class's ratio to torch's fused float32 AdamW;
- a GPT-style model's loss after --steps steps of each low-memory class against float32 AdamW.

    python benchmarks/low_memory.py [--repeats 7] [--many 100] [--steps 200] [--markdown]

torchao's optimizers compile their step with torch.compile; the first step (the compile) is
left out of its times. Install the references with ``pip install -e ".[bench]"``.
"""
import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

# The checkout first: this folder's functional.py must not stand for the package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import torch  # noqa: E402

from benchmarks._machine import machine  # noqa: E402
from distopt.optim import AdamW4bit, AdamW8bit  # noqa: E402


def _classes() -> Dict[str, Callable]:
    out: Dict[str, Callable] = {
        "torch AdamW (fused, fp32)": lambda ps: torch.optim.AdamW(ps, fused=True),
        "distopt AdamW8bit": lambda ps: AdamW8bit(ps),
        "distopt AdamW4bit": lambda ps: AdamW4bit(ps),
    }
    try:
        import bitsandbytes as bnb
        out["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps)
    except ImportError as exc:
        print(f"bitsandbytes not measured: {exc}")
    try:
        import torchao.optim as tao
        out["torchao AdamW8bit"] = lambda ps: tao.AdamW8bit(ps)
        out["torchao AdamW4bit"] = lambda ps: tao.AdamW4bit(ps)
    except ImportError as exc:
        print(f"torchao not measured: {exc}")
    return out


def _params(sizes: List[int]) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    for p in ps:
        p.grad = torch.randn(p.numel(), generator=g)
    return ps


def _state_bytes(opt, params) -> float:
    held = 0
    for p in params:
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor):
                inner = [getattr(v, a) for a in ("codes", "scale") if hasattr(v, a)]
                for t in inner or [v]:
                    held += t.numel() * t.element_size()
    return held / sum(p.numel() for p in params)


def _time(make, sizes: List[int], repeats: int) -> Tuple[float, float]:
    params = _params(sizes)
    opt = make(params)
    opt.step()  # state made (and torchao's compile) outside the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, _state_bytes(opt, params)


class _Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    """Tied embeddings, two blocks, 64 wide: a nanoGPT-shaped model of about 0.1M weights."""

    def __init__(self, vocab: int = 256, d: int = 64, t: int = 32) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(t, d))
        self.blocks = torch.nn.Sequential(_Block(d, 4), _Block(d, 4))
        self.ln = torch.nn.LayerNorm(d)
        torch.nn.init.normal_(self.tok.weight, std=0.02)  # as nanoGPT initialises it

    def forward(self, idx):
        x = self.blocks(self.tok(idx) + self.pos[: idx.shape[1]])
        return self.ln(x) @ self.tok.weight.t()


def _loss_after(make, steps: int) -> float:
    torch.manual_seed(0)
    model = TinyGPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = make([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    g = torch.Generator().manual_seed(1)
    # A learnable sequence: each token is the previous plus a fixed stride, modulo the vocab.
    starts = torch.randint(0, 256, (2048, 1), generator=g)
    data = (starts + 7 * torch.arange(33)) % 256
    losses = []
    for step in range(steps):
        batch = data[torch.randint(0, 2048, (16,), generator=g)]
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return statistics.mean(losses[-20:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--many", type=int, default=100, help="parameters of 1M elements")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    print(machine())
    classes = _classes()
    rows = []
    for name, make in classes.items():
        print(f"timing {name} on 1 x 4M ...", flush=True)
        one, bytes_per = _time(make, [4 * 2**20], args.repeats)
        print(f"timing {name} on {args.many} x 1M ...", flush=True)
        many, _ = _time(make, [2**20] * args.many, max(3, args.repeats // 2))
        rows.append((name, bytes_per, one, many))
    base = rows[0]
    bar = "|" if args.markdown else " "
    print(f"\n{bar} optimizer {bar} state B/param {bar} 1x4M ms {bar} ratio {bar} "
          f"{args.many}x1M ms {bar} ratio {bar}")
    if args.markdown:
        print("|---|---|---|---|---|---|")
    for name, bpp, one, many in rows:
        print(f"{bar} {name} {bar} {bpp:.2f} {bar} {one:.1f} {bar} {one / base[2]:.2f} {bar} "
              f"{many:.0f} {bar} {many / base[3]:.2f} {bar}")
    print(f"\nGPT-style model, mean loss of the last 20 of {args.steps} steps:")
    losses = {}
    for name in ("torch AdamW (fused, fp32)", "distopt AdamW8bit", "distopt AdamW4bit"):
        print(f"training with {name} ...", flush=True)
        losses[name] = _loss_after(lambda groups, n=name: classes[n](groups), args.steps)
    ref = losses["torch AdamW (fused, fp32)"]
    for name, loss in losses.items():
        print(f"  {name}: {loss:.4f} ({100 * (loss - ref) / ref:+.2f}% against fp32 AdamW)")


if __name__ == "__main__":
    main()
