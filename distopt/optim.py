"""Optimizers with 8-bit and 4-bit blockwise state: ``Adam8bit``, ``AdamW8bit``, ``AdamW4bit``.

Each is a ``torch.optim.Optimizer`` taking torch.optim.Adam's / AdamW's arguments plus
``block_size`` (elements per scale: 256, 256, 128) and ``min_8bit_size`` (parameters smaller
than this keep float32 moments: 4096), usable on its own like ``torch.optim.AdamW`` and as
the ``optimizer_class`` of ``DistributedOptimizer``, ``DataParallelOptimizer`` and the DDP
hooks, where the compiled twins of ``functional.blockwise_adam`` step without the GIL.

Per parameter the state holds ``step`` and, for a quantised one, ``exp_avg`` /
``exp_avg_sq`` as uint8 codes (one per element at 8 bits, two per byte at 4) with
``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (one float32 scale per block): 2 bytes and 1/64
per element at 8 bits: 2.03 bytes per parameter, 1.06 at 4 bits (docs/guide/low_memory.md).

``AdamW8bit`` equals bitsandbytes 0.50's ``AdamW8bit`` bit for bit (parameters, codes and
scales), ``Adam8bit`` its ``Adam8bit`` without weight decay (bitsandbytes decouples the
decay of its Adam8bit; ours adds it to the gradient, as torch.optim.Adam does).
"""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from functional._registry import functional_optim_map
from functional.blockwise_adam import (
    FunctionalAdam8bit,
    FunctionalAdamW4bit,
    FunctionalAdamW8bit,
    blockwise_step,
    check_arguments,
    code_books,
    state_problem,
)

__all__ = ["Adam8bit", "AdamW8bit", "AdamW4bit"]


class _BlockwiseAdam(torch.optim.Optimizer):
    """Adam / AdamW on blockwise-quantised state (the three public classes)."""

    #: Bits per code (read by the sharded engine too), and whether weight decay is decoupled.
    blockwise_bits = 8
    decoupled = True

    def __init__(
        self,
        params: Any,
        lr: float,
        betas: Tuple[float, float],
        eps: float,
        weight_decay: float,
        amsgrad: bool,
        maximize: bool,
        block_size: int,
        min_8bit_size: int,
    ) -> None:
        name = type(self).__name__
        if amsgrad:
            raise ValueError(f"Invalid amsgrad: {amsgrad!r} ({name} keeps no max of exp_avg_sq)")
        check_arguments(lr, betas, eps, weight_decay, block_size, min_8bit_size)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, block_size=block_size, min_8bit_size=min_8bit_size)
        super().__init__(params, defaults)
        self._codes = code_books(self.blockwise_bits)

    def _group_step(self, group: Dict[str, Any]) -> None:
        params: List[Tensor] = list(group["params"])
        gradients: List[Optional[Tensor]] = [p.grad for p in params]
        state = {i: self.state[p] for i, p in enumerate(params) if len(self.state.get(p, {})) > 0}
        quantised = [p.numel() >= group["min_8bit_size"] for p in params]
        lr = group["lr"]
        blockwise_step(
            params, gradients, state, quantised, self._codes[0], self._codes[1],
            float(lr.item() if isinstance(lr, Tensor) else lr),
            (float(group["betas"][0]), float(group["betas"][1])), float(group["eps"]),
            float(group["weight_decay"]), self.decoupled, bool(group["maximize"]), self.blockwise_bits,
            int(group["block_size"]),
        )
        for i, entry in state.items():
            self.state[params[i]] = entry

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One step of every parameter with a gradient; ``closure`` re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._group_step(group)
        return loss

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch.optim's, with every saved entry checked first (a bad one changes nothing)
        and the codes, scales and float32 moments kept as saved (torch.optim would cast the
        floating ones to a bfloat16 / float16 parameter's dtype)."""
        groups = state_dict.get("param_groups", [])
        saved = state_dict.get("state", {})
        ids = [i for g in groups for i in g.get("params", [])]
        params = [p for g in self.param_groups for p in g["params"]]
        if len(ids) == len(params):
            by_id = dict(zip(ids, params))
            group_of = {i: g for g in groups for i in g.get("params", [])}
            for i, entry in saved.items():
                if i not in by_id:
                    continue
                p = by_id[i]
                quantised = p.numel() >= group_of[i].get("min_8bit_size", 4096)
                problem = state_problem(p, entry, quantised, self.blockwise_bits,
                                        int(group_of[i].get("block_size", 256)))
                if problem:
                    raise ValueError(f"Invalid state_dict: the state of parameter {i}: {problem}")
        super().load_state_dict(state_dict)
        if len(ids) == len(params):
            for i, p in zip(ids, params):
                for key, value in saved.get(i, {}).items():
                    if key != "step":
                        self.state[p][key] = value.to(device=p.device, copy=True)


class Adam8bit(_BlockwiseAdam):
    """torch.optim.Adam with 8-bit blockwise state (block 256); ``weight_decay`` is an L2
    penalty added to the gradient, as torch.optim.Adam's."""

    blockwise_bits = 8
    decoupled = False

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 maximize: bool = False, block_size: int = 256, min_8bit_size: int = 4096) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize, block_size,
                         min_8bit_size)


class AdamW8bit(_BlockwiseAdam):
    """torch.optim.AdamW with 8-bit blockwise state (block 256): bitsandbytes' AdamW8bit, bit
    for bit."""

    blockwise_bits = 8
    decoupled = True

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, block_size: int = 256, min_8bit_size: int = 4096) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize, block_size,
                         min_8bit_size)


class AdamW4bit(_BlockwiseAdam):
    """torch.optim.AdamW with 4-bit blockwise state (block 128; torchao's code books)."""

    blockwise_bits = 4
    decoupled = True

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, block_size: int = 128, min_8bit_size: int = 4096) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize, block_size,
                         min_8bit_size)


# The compiled twins every entry point steps with (compiled at their first construction).
functional_optim_map[Adam8bit] = FunctionalAdam8bit
functional_optim_map[AdamW8bit] = FunctionalAdamW8bit
functional_optim_map[AdamW4bit] = FunctionalAdamW4bit
