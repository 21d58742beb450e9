"""TorchScript-compilable helpers shared by every functional optimizer: parameter groups,
hyper-parameter values, and the state checks (``checked_state``). The kernel layer's shared
half, and the TorchScript workarounds, are in ``functional/_kernels.py``.
"""
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from functional._torch import mkldnn_layout


def dtype_name(dtype: torch.dtype) -> str:
    """``str(dtype)`` that also works in TorchScript, where a dtype is a bare integer."""
    known = [
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool,
    ]
    names = [
        "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "int64",
        "int32", "int16", "int8", "uint8", "bool",
    ]
    for k in range(len(known)):
        if dtype == known[k]:
            return "torch." + names[k]
    return "dtype " + str(dtype)


def layout_name(layout: int) -> str:
    """``str(layout)`` that also works in TorchScript, where a layout is a bare integer
    (hence the annotation; eager code passes a ``torch.layout``)."""
    known = [
        torch.strided, torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
        torch.sparse_bsc, mkldnn_layout(),
    ]
    names = ["strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn"]
    for k in range(len(known)):
        if layout == known[k]:
            return "torch." + names[k]
    return str(layout)


def index_of(params: List[Tensor], param: Tensor) -> int:
    """Position of ``param`` (by identity) in ``params``."""
    for i in range(len(params)):
        if params[i] is param:
            return i
    raise ValueError(
        f"Invalid param: tensor of shape {param.shape} is not one of this optimizer's "
        f"{len(params)} parameters"
    )


def one_gradient(n: int, index: int, grad: Optional[Tensor]) -> List[Optional[Tensor]]:
    """A gradient list of length ``n`` holding ``grad`` at ``index`` and None elsewhere."""
    gradients: List[Optional[Tensor]] = [None for _ in range(n)]
    gradients[index] = grad
    return gradients


def scalar(name: str, value: List[float]) -> float:
    """The one float of a hyper-parameter given as a list (see ``set_hyperparameter``)."""
    if len(value) != 1:
        raise ValueError(f"Invalid {name}: {value} (expected one value)")
    return value[0]


def pair(name: str, value: List[float]) -> List[float]:
    """The two floats of a pair hyper-parameter (betas, etas, step_sizes)."""
    if len(value) != 2:
        raise ValueError(f"Invalid {name}: {value} (expected two values)")
    return value


def unknown_hyperparameter(cls_name: str, name: str, known: List[str]) -> str:
    """The message for ``set_hyperparameter`` with a name the class does not have."""
    return f"Invalid hyper-parameter name for {cls_name}: '{name}' (expected one of {known})"


def new_lr(lr_tensor: Optional[Tensor], value: List[float]) -> float:
    """The lr ``set_hyperparameter("lr", value)`` sets; a Tensor lr given to the constructor
    takes the new value in place too, as a scheduler's change to a Tensor lr does."""
    lr = scalar("lr", value)
    if lr_tensor is not None:
        lr_tensor.fill_(lr)
    return lr


def lr_of(lr: float, lr_tensor: Optional[Tensor]) -> float:
    """The learning rate in effect: the Tensor lr's current value when one was given."""
    if lr_tensor is not None:
        return float(lr_tensor.item())
    return lr


def step_lr(
    lr: float,
    lr_tensor: Optional[Tensor],
    capturable: bool,
    state: Optional[Dict[int, Dict[str, Tensor]]] = None,
    gradients: Optional[List[Optional[Tensor]]] = None,
) -> Tuple[float, Optional[Tensor]]:
    """A step's learning rate, as ``(float, Tensor or None)``.

    A capturable step given a Tensor lr reads that Tensor on its device (a CUDA graph then
    replays with its current value; a host read could not be recorded at all): it comes back
    0-dim, beside the float last set. The float is read from the Tensor on the host only when
    a class whose new state starts at lr (Rprop's ``step_size``, ASGD's ``eta``) passes its
    ``state`` and the step's ``gradients`` and one of them makes state: the warm-up steps
    before a capture. Otherwise the float is ``lr_of``'s and the Tensor None.
    """
    if capturable and lr_tensor is not None:
        value = lr
        if state is not None and gradients is not None and makes_state(state, gradients):
            value = lr_of(lr, lr_tensor)
        return value, lr_tensor.reshape(())
    return lr_of(lr, lr_tensor), None


def makes_state(state: Dict[int, Dict[str, Tensor]], gradients: List[Optional[Tensor]]) -> bool:
    """Whether a step with ``gradients`` gives some parameter its first state."""
    if len(state) == len(gradients):
        return False
    for i in range(len(gradients)):
        if gradients[i] is not None and i not in state:
            return True
    return False


def lr_float(lr: Union[float, Tensor]) -> float:
    """The float value of an lr given as a float or a 1-element Tensor."""
    if isinstance(lr, Tensor):
        return float(lr.item())
    return float(lr)


def lr_tensor(lr: Union[float, Tensor]) -> Optional[Tensor]:
    """The Tensor lr, kept so that in-place changes to it are seen; None for a float lr."""
    if isinstance(lr, Tensor):
        return lr
    return None


def tensor_pair(
    pair: Tuple[Union[float, Tensor], Union[float, Tensor]]
) -> Optional[List[Tensor]]:
    """A pair hyper-parameter given as two 1-element Tensors (Adam's Tensor betas), kept so
    that changes to them in place are seen (``pair_of``); None for floats."""
    first, second = pair
    if isinstance(first, Tensor) and isinstance(second, Tensor):
        return [first, second]
    return None


def pair_of(
    values: Tuple[float, float], tensors: Optional[List[Tensor]], capturable: bool
) -> Tuple[float, float]:
    """The pair a step uses: the Tensors given to the constructor read now, as torch.optim
    reads its Tensor betas at every step, else ``values``. A capturable step does not read a
    Tensor on a GPU on the host (a CUDA graph cannot record that): it takes ``values``, the
    pair given to the constructor or set last by ``set_hyperparameter``."""
    if tensors is None:
        return values
    if capturable and (tensors[0].device.type != "cpu" or tensors[1].device.type != "cpu"):
        return values
    return (float(tensors[0].item()), float(tensors[1].item()))


def new_pair(name: str, tensors: Optional[List[Tensor]], value: List[float]) -> Tuple[float, float]:
    """The pair ``set_hyperparameter(name, value)`` sets; Tensors given to the constructor
    take the new values in place too, as ``new_lr`` fills a Tensor lr."""
    values = pair(name, value)
    if tensors is not None:
        tensors[0].fill_(values[0])
        tensors[1].fill_(values[1])
    return (values[0], values[1])


def optional_flag(value: Optional[bool]) -> Optional[bool]:
    """A ``foreach`` / ``fused`` flag as a Python bool or None, whatever torch.optim would read
    for its truth (a numpy bool, an int): TorchScript keeps only a bool."""
    if value is None:
        return None
    return bool(value)


def use_fused_kernel(foreach: Optional[bool], fused: Optional[bool]) -> bool:
    """Whether a class with a fused kernel uses it: yes unless fused=False or foreach=True."""
    if fused is not None and not fused:
        return False
    if foreach is not None and foreach:
        return False
    return True


def meta_like(p: Tensor) -> Tensor:
    """A tensor with ``p``'s shape, strides and dtype on the meta device (no memory).

    Each class makes its state templates by running its own state helper on it, at no cost:
    the template has the keys, shapes, dtypes and layouts a fresh state would have.
    """
    return torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device=torch.device("meta"))


def meta_params(
    params: List[Tensor], state: Dict[int, Dict[str, Tensor]]
) -> List[Tuple[int, Tensor]]:
    """``(i, meta_like(params[i]))`` for each parameter ``state`` has an entry for: what a
    class's state helper turns into the templates ``checked_state`` compares with.

    Raises:
        ValueError: an entry for an index out of range.
    """
    out: List[Tuple[int, Tensor]] = []
    for i in state.keys():
        if i < 0 or i >= len(params):
            raise ValueError(
                f"Invalid state: an entry for parameter {i} (expected indices 0..{len(params) - 1}"
                f" for {len(params)} parameters)"
            )
        out.append((i, meta_like(params[i])))
    return out


def checked_state(
    params: List[Tensor],
    state: Dict[int, Dict[str, Tensor]],
    templates: Dict[int, Dict[str, Tensor]],
    sparse_keys: Optional[List[str]] = None,
) -> Dict[int, Dict[str, Tensor]]:
    """``state`` checked against fresh-state ``templates``; the state to keep.

    Every key of a parameter's template must be there with the template's shape and dtype,
    on the parameter's device (or the template's, for ``step`` on the CPU); a key the
    template lacks must be shaped like the parameter, with its dtype and device (state of an
    option switched off, such as Adam's ``max_exp_avg_sq`` without amsgrad). Tensors are
    dense, but for the keys in ``sparse_keys`` (SGD's momentum for sparse gradients, which
    torch.optim keeps sparse), whose indices must lie inside the parameter. Nothing is kept unless everything passes,
    so a bad state leaves the optimizer as it was, and the kernels never see a buffer of the
    wrong size. Tensors laid out unlike the template (a contiguous ``exp_avg`` for a
    transposed parameter) are copied into the template's layout, which the fused kernels
    need, and a scalar (``step``) on the CPU where the class keeps it on the parameter's
    device, or the other way round, is moved there, as torch.optim's load_state_dict moves
    it; an empty entry is dropped (no state yet).

    Raises:
        ValueError: naming the parameter, the key and both values.
    """
    for i, template in templates.items():
        entry = state[i]
        p = params[i]
        if len(entry) == 0:
            continue
        for key in template.keys():
            if key not in entry:
                raise ValueError(
                    f"Invalid state[{i}]: no '{key}' (expected keys {sorted(template.keys())}, "
                    f"got {sorted(entry.keys())})"
                )
        for key, value in entry.items():
            expected = meta_like(p)
            if key in template:
                expected = template[key]
            sparse_ok = sparse_keys is not None and key in sparse_keys
            _check_state_tensor(i, key, value, expected, p, sparse_ok)
    kept: Dict[int, Dict[str, Tensor]] = {}
    for i, template in templates.items():
        entry = state[i]
        if len(entry) == 0:
            continue
        layout = torch.empty_like(meta_like(params[i]))
        new_entry: Dict[str, Tensor] = {}
        for key, value in entry.items():
            expected = layout
            if key in template:
                expected = template[key]
            if value.dim() == 0 and expected.dim() == 0:
                # A scalar goes where this class keeps it (``_spec.scalar_places``): the
                # parameter's device (a template on the meta device) or the CPU.
                place = params[i].device if expected.device.type == "meta" else expected.device
                if value.device != place:
                    value = value.to(place)
            elif not value.is_sparse and value.dim() > 0 and value.stride() != expected.stride():
                fitted = torch.empty_strided(
                    expected.size(), expected.stride(), dtype=value.dtype, device=value.device
                )
                fitted.copy_(value)
                value = fitted
            new_entry[key] = value
        kept[i] = new_entry
    return kept


def _check_state_tensor(
    i: int, key: str, value: Tensor, expected: Tensor, param: Tensor, sparse_ok: bool
) -> None:
    """One state tensor against its template: shape, dtype and device (the parameter's, where
    the template is on the meta device). A 0-dim entry (``step``, ``mu_product``) may be any
    floating dtype on the CPU or the parameter's device, as torch.optim's load_state_dict
    leaves it; a sparse one only where ``sparse_ok``, with every index inside its shape (the
    kernels trust them: one outside writes outside the parameter).
    """
    if value.is_sparse:
        if not sparse_ok:
            raise ValueError(
                f"Invalid state[{i}]['{key}']: a sparse tensor (expected a dense one, as "
                f"this class keeps it)"
            )
        _check_sparse_indices(i, key, value)
    elif value.layout != torch.strided:
        raise ValueError(
            f"Invalid state[{i}]['{key}']: layout {value.layout} (expected a dense tensor)"
        )
    if value.shape != expected.shape:
        raise ValueError(
            f"Invalid state[{i}]['{key}']: shape {list(value.shape)} (expected "
            f"{list(expected.shape)} for params[{i}] of shape {list(param.shape)})"
        )
    if expected.dim() == 0:
        if not value.is_floating_point():
            raise ValueError(
                f"Invalid state[{i}]['{key}']: dtype {dtype_name(value.dtype)} (expected a "
                f"floating-point dtype)"
            )
        if value.device != param.device and value.device.type != "cpu":
            raise ValueError(
                f"Invalid state[{i}]['{key}']: device {value.device} (expected cpu or "
                f"{param.device}, the device of params[{i}])"
            )
        return
    if value.dtype != expected.dtype:
        raise ValueError(
            f"Invalid state[{i}]['{key}']: dtype {dtype_name(value.dtype)} (expected "
            f"{dtype_name(expected.dtype)} for params[{i}] of dtype {dtype_name(param.dtype)})"
        )
    device = expected.device
    if device.type == "meta":
        device = param.device
    if value.device != device:
        raise ValueError(
            f"Invalid state[{i}]['{key}']: device {value.device} (expected {device}, the device "
            f"of params[{i}])"
        )


def _check_sparse_indices(i: int, key: str, value: Tensor) -> None:
    """A sparse COO state tensor's indices must lie inside its shape (torch does not check
    them unless asked, and a step would write where they point)."""
    indices = value._indices()
    values = value._values()
    dense_shape = list(value.shape)[value.sparse_dim():]
    if (
        indices.size(0) != value.sparse_dim()
        or values.size(0) != indices.size(1)
        or list(values.shape)[1:] != dense_shape
    ):
        raise ValueError(
            f"Invalid state[{i}]['{key}']: indices of shape {list(indices.shape)} for values of "
            f"shape {list(values.shape)} (expected {value.sparse_dim()} rows, one column per "
            f"value)"
        )
    if indices.numel() == 0:
        return
    for d in range(value.sparse_dim()):
        low = int(indices[d].min().item())
        high = int(indices[d].max().item())
        if low < 0 or high >= value.size(d):
            raise ValueError(
                f"Invalid state[{i}]['{key}']: index {high if low >= 0 else low} in dimension "
                f"{d} (expected 0..{value.size(d) - 1})"
            )
