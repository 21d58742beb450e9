"""Every private torch API the functional package calls, each behind one name that says why.

The functional side's counterpart of ``distopt/_torch.py`` (functional imports torch and
typing only). The functions without a leading underscore that take tensors are TorchScript
functions as well as Python ones: compiled optimizers call them from TorchScript, which
compiles them with their callers. A torch release that moves or renames one of these should
change this file only (the package runs on torch 2.11 and 2.13). Not here: torch's
``_foreach_*`` and ``_fused_*`` kernels, which torch.optim itself runs and which every
optimizer calls from TorchScript by name; and ``Tensor._values()`` / ``_indices()``, a sparse
gradient's uncoalesced parts, read as torch.optim's sparse code reads them.
"""
from typing import Any, Callable, List, Optional

import torch
import torch._jit_internal as _jit_internal
from torch import Tensor

__all__ = [
    "chunk_cat",
    "class_resolution_callback",
    "is_view",
    "mkldnn_layout",
    "storage_use_count",
    "unscale_and_check_",
]


def chunk_cat(tensors: List[Tensor], dim: int, num_chunks: int, out: Tensor) -> None:
    """Each tensor flattened from ``dim`` on and cut into ``num_chunks``, concatenated into
    ``out`` (TorchScript).

    Needed to fill a flat gradient buffer from gradients of any shape in one kernel (0.36 us
    a gradient on CPU, against 0.45 us for ``_foreach_copy_``): torch exposes it only as
    ``torch._chunk_cat``.
    """
    torch._chunk_cat(tensors, dim, num_chunks, out=out)


def unscale_and_check_(grads: List[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """Multiply ``grads`` (one device and dtype) by ``inv_scale`` in place, and set
    ``found_inf`` to 1 where one holds an inf or NaN (TorchScript).

    Needed to unscale a GradScaler's gradients inside a compiled step as
    ``GradScaler.unscale_`` does: torch exposes its kernel only as
    ``torch._amp_foreach_non_finite_check_and_unscale_``.
    """
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def mkldnn_layout() -> int:
    """``torch._mkldnn``, the layout of MKL-DNN tensors (an integer in TorchScript, hence
    the annotation; a ``torch.layout`` in Python).

    Needed to name that layout in messages: it is the one layout torch has no public name for.
    """
    return torch._mkldnn


def storage_use_count(storage: Any) -> Optional[int]:
    """How many references the C++ side holds to ``storage`` (an ``untyped_storage()``):
    every tensor viewing it, and the Storage object asked; None where torch lacks the query.

    Needed by ``flatten_parameters`` to leave alone a parameter whose storage another tensor
    shares (a view, a tied weight, a numpy array): torch exposes the count only as
    ``torch._C._storage_Use_Count`` of the storage's ``_cdata`` pointer.
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else int(use_count(storage._cdata))


def is_view(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor.

    Needed by ``flatten_parameters``, which must not move a view's data into a flat buffer
    (its base would no longer see it); torch exposes a view's base only as ``Tensor._base``.
    """
    return tensor._base is not None


def class_resolution_callback(cls: type) -> Callable[[str], Any]:
    """The function TorchScript resolves the names in ``cls``'s methods with: from the
    module that defines ``cls``.

    Needed to compile a class from any caller: ``torch.jit.script(cls)`` resolves names
    from its caller's frame unless given one (``_rcb``), and torch builds one only in
    ``torch._jit_internal.createResolutionCallbackForClassMethods``.
    """
    return _jit_internal.createResolutionCallbackForClassMethods(cls)
