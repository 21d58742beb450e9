"""Memory layouts for parameters and gradients, shared by the layout tests.

A parameter is placed in a layout by building its values contiguously and copying them into
a tensor of that layout; the storage around a non-dense parameter is filled with a sentinel
so that a kernel writing outside the parameter is caught.
"""
from typing import Optional, Tuple

import torch

SENTINEL = 1234.5

#: Parameter layouts: dense ones (contiguous, transposed, channels_last) and non-dense ones
#: (a slice of a wider tensor, an as_strided view with gaps, a stepped 1-d slice).
PARAM_LAYOUTS = ("contiguous", "slice", "transpose", "as_strided", "channels_last")

#: Gradient layouts: the parameter's own strides, contiguous, another dense order, and
#: rows broadcast with stride 0 (an expanded tensor).
GRAD_LAYOUTS = ("own", "contiguous", "permuted", "expanded")


def place(values: torch.Tensor, layout: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``values`` copied into a new tensor of ``layout``; also the storage's base tensor
    (filled with SENTINEL outside the view, see ``outside_intact``) for the non-dense
    layouts, else None."""
    shape = tuple(values.shape)
    n = len(shape)
    if layout == "contiguous" or n == 0:
        return values.clone(), None
    if layout == "transpose":
        out = torch.empty(shape[::-1], dtype=values.dtype).permute(*range(n - 1, -1, -1))
        return out.copy_(values), None
    if layout == "channels_last":
        if n != 4:
            raise ValueError(f"Invalid layout: channels_last for shape {shape} (expected 4-d)")
        return values.contiguous(memory_format=torch.channels_last), None
    if layout == "slice":
        if n == 1:
            base = torch.full((2 * shape[0] + 1,), SENTINEL, dtype=values.dtype)
            view = base[1::2]
        else:
            base = torch.full(shape[:-1] + (shape[-1] + 3,), SENTINEL, dtype=values.dtype)
            view = base[..., 1:1 + shape[-1]]
        return view.copy_(values), base
    if layout == "as_strided":
        # Column-major order with one element of padding per dimension: non-overlapping,
        # not dense, and not in any standard memory format.
        strides, span = [], 1
        for size in shape:
            strides.append(span)
            span *= size + 1
        base = torch.full((span + 2,), SENTINEL, dtype=values.dtype)
        view = base.as_strided(shape, strides, storage_offset=1)
        return view.copy_(values), base
    raise ValueError(f"Invalid layout: {layout!r} (expected one of {PARAM_LAYOUTS})")


def layout_for(shape: Tuple[int, ...], index: int) -> str:
    """The parameter layout given to the ``index``-th parameter of a case (they cycle)."""
    if len(shape) == 4:
        return "channels_last"
    return PARAM_LAYOUTS[index % 4]


def gradient_in(values: torch.Tensor, param: torch.Tensor, layout: str) -> torch.Tensor:
    """A gradient holding ``values`` (or, for "expanded", their first row broadcast)."""
    if layout == "own":
        return torch.empty_strided(param.shape, param.stride(), dtype=values.dtype).copy_(values)
    if layout == "contiguous" or values.dim() == 0:
        return values.contiguous()
    if layout == "permuted":
        n = values.dim()
        if n == 1:
            return torch.zeros(2 * values.shape[0], dtype=values.dtype)[::2].copy_(values)
        # Reverse the dimension order, unless that is the parameter's own order.
        order = list(range(n - 1, -1, -1))
        if param.permute(*order).is_contiguous():
            order = [1, 0] + list(range(2, n))
        inverse = [order.index(d) for d in range(n)]
        shaped = torch.empty([values.shape[d] for d in order], dtype=values.dtype)
        return shaped.permute(*inverse).copy_(values)
    if layout == "expanded":
        return values[:1].expand(values.shape)
    raise ValueError(f"Invalid layout: {layout!r} (expected one of {GRAD_LAYOUTS})")


def in_own_layout(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """What local autograd would give the reference: the values in ``empty_like(param)``."""
    return torch.empty_like(param).copy_(grad)


def outside_intact(param: torch.Tensor) -> bool:
    """Whether every element of ``param``'s storage outside ``param`` still holds SENTINEL
    (trivially true for a parameter that fills its storage)."""
    n = param.untyped_storage().nbytes() // param.element_size()
    flat = torch.empty(0, dtype=param.dtype).set_(param.untyped_storage(), 0, (n,), (1,))
    mask = torch.ones(n, dtype=torch.bool)
    inside = torch.arange(n).as_strided(param.shape, param.stride(), param.storage_offset())
    mask[inside.reshape(-1)] = False
    return bool((flat[mask] == SENTINEL).all())
