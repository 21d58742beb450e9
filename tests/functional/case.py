"""One parity case: a torch.optim class, its functional twin, and the arguments to try."""
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch

DEFAULT_SHAPES: Tuple[Tuple[int, ...], ...] = ((5, 3), (4,), (2, 3, 2), (6, 4))


@dataclasses.dataclass
class Case:
    """A row of the parity table.

    Attributes:
        torch_cls: the torch.optim class that is the reference.
        functional_cls: the functional class under test.
        kwargs: arguments given to both (a Tensor lr is copied for each).
        shapes: parameter shapes.
        dtype: parameter dtype.
        sparse: give sparse COO gradients (rows of the first dimension) instead of dense.
        steps: how many steps to run.
        torch_kwargs: the reference's arguments where torch.optim cannot run ``kwargs``
            itself (a torch bug, named in the case's comment); None means ``kwargs``.
    """

    torch_cls: type
    functional_cls: type
    kwargs: Dict[str, Any]
    shapes: Tuple[Tuple[int, ...], ...] = DEFAULT_SHAPES
    dtype: torch.dtype = torch.float32
    sparse: bool = False
    steps: int = 12
    torch_kwargs: Optional[Dict[str, Any]] = None

    @property
    def id(self) -> str:
        args = ",".join(f"{k}={_short(v)}" for k, v in self.kwargs.items())
        extra = ("-sparse" if self.sparse else "") + (
            "" if self.dtype == torch.float32 else f"-{str(self.dtype).replace('torch.', '')}"
        )
        return f"{self.torch_cls.__name__}({args}){extra}"

    def kwargs_copy(self) -> Dict[str, Any]:
        """The arguments, with a fresh copy of any Tensor so that no two optimizers share one."""
        return _copy(self.kwargs)

    def torch_kwargs_copy(self) -> Dict[str, Any]:
        """The reference torch.optim optimizer's arguments."""
        return _copy(self.kwargs if self.torch_kwargs is None else self.torch_kwargs)

    def make_params(self, seed: int = 0) -> List[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(s, generator=gen, dtype=self.dtype) for s in self.shapes]

    def make_gradients(self, step: int, seed: int = 1) -> List[Optional[torch.Tensor]]:
        """Gradients for one step: one in four is None, in a pattern that moves each step."""
        gen = torch.Generator().manual_seed(seed * 1000 + step)
        grads: List[Optional[torch.Tensor]] = []
        for i, s in enumerate(self.shapes):
            g = torch.randn(s, generator=gen, dtype=self.dtype)
            if (step + i) % 4 == 3:
                grads.append(None)
            elif self.sparse:
                grads.append(_row_sparse(g, step + i))
            else:
                grads.append(g)
        return grads


def _row_sparse(dense: torch.Tensor, salt: int) -> torch.Tensor:
    """A sparse COO gradient holding some rows of ``dense``, one row index repeated."""
    rows = dense.shape[0]
    idx = torch.tensor([salt % rows, (salt + 2) % rows, salt % rows])
    values = dense[idx]
    size = dense.shape
    return torch.sparse_coo_tensor(idx.unsqueeze(0), values, size)


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor({v.item():g})"
    return repr(v)


def _copy(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
