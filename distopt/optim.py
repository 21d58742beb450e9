"""Optimizers with 8-bit and 4-bit blockwise state: ``Adam8bit``, ``AdamW8bit``, ``AdamW4bit``.

Each is a ``torch.optim.Optimizer`` taking torch.optim.Adam's / AdamW's arguments plus
``block_size`` (elements per scale: 256, 256, 128) and ``min_8bit_size`` (parameters smaller
than this keep float32 moments: 4096), usable on its own like ``torch.optim.AdamW`` and as
the ``optimizer_class`` of ``DistributedOptimizer``, ``DataParallelOptimizer`` and the DDP
hooks, where the compiled twins of ``functional.blockwise_adam`` step without the GIL.

Per parameter the state holds ``step`` and, for a quantised one, ``exp_avg`` /
``exp_avg_sq`` as uint8 codes (one per element at 8 bits, two per byte at 4) with
``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (one float32 scale per block): 2.03 bytes per
parameter at 8 bits, 1.06 at 4 bits (docs/guide/low_memory.md).

``AdamW8bit`` equals bitsandbytes 0.50's ``AdamW8bit`` bit for bit (parameters, codes and
scales), ``Adam8bit`` its ``Adam8bit`` without weight decay (bitsandbytes decouples the
decay of its Adam8bit; ours adds it to the gradient, as torch.optim.Adam does).
"""
from functional.blockwise_adam import Adam8bit, AdamW4bit, AdamW8bit

__all__ = ["Adam8bit", "AdamW8bit", "AdamW4bit"]
