"""Adam and AdamW with 8-bit and 4-bit blockwise-quantised state (functional form).

The two moments of a parameter are kept as one code per element (8 bits, or 4 bits packed
two to a byte, high nibble first) and one float32 scale per block of ``block_size``
elements, cut from the parameter's start: ``exp_avg`` / ``exp_avg_sq`` hold the codes,
``exp_avg_absmax`` / ``exp_avg_sq_absmax`` the scales, ``step`` the count (a float32 CPU
scalar, as torch.optim keeps it). A parameter of fewer than ``min_8bit_size`` elements keeps
float32 moments shaped like it, as bitsandbytes does. Each step is one pass of the fused
kernel ``torch.ops.distopt_kernels.blockwise_adam_`` (``csrc/elementwise_ops.cpp``): decode
a block, update it and the parameter in float32, encode it again.

- 8 bits: bitsandbytes' dynamic code books (signed for ``exp_avg``, unsigned for
  ``exp_avg_sq``) and its CPU encoding; the step equals bitsandbytes 0.50's ``AdamW8bit``
  (and ``Adam8bit`` without weight decay) bit for bit: parameters, codes and scales.
- 4 bits: torchao's code books (a signed dynamic map of 3 exponent bits for ``exp_avg``, 16
  evenly spaced values above zero for ``exp_avg_sq``) and its encoding, block 128.

Whether a parameter is quantised, and where its blocks start, depend on the whole parameter
only (``whole_sizes``: the element counts of the parameters the given tensors are pieces of,
when they are pieces), so a sharded run quantises exactly as an unsharded one.
"""
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._common import (
    dtype_name,
    index_of,
    lr_float,
    one_gradient,
    pair,
    scalar,
    unknown_hyperparameter,
)
from functional._kernels import check_length, refuse
from functional._validation import (
    check_at_least,
    check_betas,
    check_lr,
    check_params,
    check_types,
    hyperparameter_argument,
)

#: The keys of a quantised parameter's state that are not laid out like it: codes (one a
#: byte at 8 bits, two at 4) and one scale per block.
QUANTISED_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")


def is_quantised_entry(entry: Any) -> bool:
    """Whether a saved state entry is a quantised parameter's (it has scales)."""
    return isinstance(entry, dict) and "exp_avg_absmax" in entry


def dynamic_code(signed: bool, exponent_bits: int, bits: int) -> Tensor:
    """The dynamic quantisation map of ``bits`` bits (Dettmers, 8-bit approximations for
    parallelism, 2016), with the values bitsandbytes and torchao give it: for each exponent
    ``e`` from ``-(exponent_bits - 1)`` to 0, the midpoints of an even split of [0.1, 1] (into
    ``2**i`` parts for the i-th exponent, twice as many when unsigned) times ``10**e``, negated
    too when ``signed``; then 0 and 1. Ascending, float32, padded with zeros to ``2**bits``.
    """
    magnitude_bits = bits - 1
    pieces: List[Tensor] = []
    power = 1.0
    for i in range(exponent_bits):
        parts = 1 << (i + magnitude_bits - exponent_bits + (0 if signed else 1))
        edges = torch.linspace(0.1, 1.0, parts + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        power = 10.0 ** float(-(exponent_bits - 1) + i)
        pieces.append(power * mids)
        if signed:
            pieces.append(-power * mids)
    spare = (1 << (magnitude_bits - exponent_bits)) - 1
    if spare > 0:
        edges = torch.linspace(0.1, 1.0, spare + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        pieces.append(power * mids)
        if signed:
            pieces.append(-power * mids)
    pieces.append(torch.tensor([0.0, 1.0], dtype=torch.float32))
    values = torch.cat(pieces)
    padding = torch.zeros((1 << bits) - values.numel(), dtype=torch.float32)
    return torch.sort(torch.cat([values, padding]))[0].contiguous()


def positive_linear_code(bits: int) -> Tensor:
    """``2**bits`` evenly spaced values in (0, 1], zero left out (torchao's 4-bit map of the
    second moment: the root of a code is never taken of zero)."""
    return torch.linspace(0.0, 1.0, (1 << bits) + 1, dtype=torch.float32)[1:].contiguous()


def code_books(bits: int) -> Tuple[Tensor, Tensor]:
    """The code books of ``bits`` (8 or 4 bits): that of exp_avg, that of exp_avg_sq."""
    if bits == 8:
        return dynamic_code(True, 7, 8), dynamic_code(False, 7, 8)
    return dynamic_code(True, 3, 4), positive_linear_code(4)


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of codes of ``numel`` elements in blocks of an even size: one per element at 8
    bits, one per two at 4 (a block's odd last element takes a byte of its own)."""
    return numel if bits == 8 else (numel + 1) // 2


def blocks_of(numel: int, block_size: int) -> int:
    """Blocks of ``block_size`` cut from ``numel`` elements (the last one may be short)."""
    return (numel + block_size - 1) // block_size


def fresh_state(p: Tensor, quantised: bool, bits: int, block_size: int) -> Dict[str, Tensor]:
    """The state of ``p`` before its first step: zero codes and scales (or float32 zeros)."""
    # The shape () taken from p: TorchScript folds ``torch.zeros(())`` into one constant
    # tensor, which every parameter would then share as its step count.
    state: Dict[str, Tensor] = {"step": torch.zeros(p.shape[:0], dtype=torch.float32)}
    if quantised:
        n = p.numel()
        # Each made from another, for the same reason.
        state["exp_avg"] = torch.zeros(code_bytes(n, bits), dtype=torch.uint8, device=p.device)
        state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        state["exp_avg_absmax"] = torch.zeros(blocks_of(n, block_size), dtype=torch.float32,
                                              device=p.device)
        state["exp_avg_sq_absmax"] = torch.zeros_like(state["exp_avg_absmax"])
    else:
        # The second made from the first: TorchScript merges two equal ``torch.zeros`` calls
        # into one tensor, which both moments would then share.
        state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
    return state


def state_problem(
    p: Tensor, entry: Dict[str, Tensor], quantised: bool, bits: int, block_size: int
) -> str:
    """What is wrong with ``entry`` as the state of ``p`` ("" if nothing)."""
    want = fresh_state(p, quantised, bits, block_size)
    keys = sorted(entry.keys())
    if keys != sorted(want.keys()):
        return "has keys " + str(keys) + ", expected " + str(sorted(want.keys()))
    for key, like in want.items():
        got = entry[key]
        if key == "step":
            if got.numel() != 1 or not got.is_floating_point():
                return "'step' is not a one-element floating-point tensor"
        elif got.dtype != like.dtype or got.shape != like.shape:
            return (
                "'" + key + "' is " + dtype_name(got.dtype) + " of shape " + str(list(got.shape))
                + ", expected " + dtype_name(like.dtype) + " of shape " + str(list(like.shape))
            )
    return ""


def blockwise_step(
    params: List[Tensor],
    gradients: List[Optional[Tensor]],
    state: Dict[int, Dict[str, Tensor]],
    quantised: List[bool],
    code1: Tensor,
    code2: Tensor,
    lr: float,
    betas: Tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    bits: int,
    block_size: int,
) -> None:
    """One step of every parameter with a gradient: the quantised ones in one call of the
    blockwise kernel, the float32 ones in one call of bitsandbytes' float32 rule."""
    qp: List[Tensor] = []
    qg: List[Tensor] = []
    qs: List[List[Tensor]] = [[], [], [], [], []]
    fp: List[Tensor] = []
    fg: List[Tensor] = []
    fs: List[List[Tensor]] = [[], [], []]
    originals: List[Tensor] = []
    copies: List[Tensor] = []
    created: List[int] = []
    check_length(params, gradients)
    for i in range(len(params)):
        g = gradients[i]
        if g is not None:
            p = params[i]
            if (not g.is_same_size(p) or g.dtype != p.dtype or g.layout != torch.strided
                    or g.device != p.device):
                # Names the gradient; the state made in this pass is taken back first.
                refuse(state, created, i, g, p,
                       "blockwise Adam does not support sparse gradients")
            if i not in state:
                state[i] = fresh_state(p, quantised[i], bits, block_size)
                created.append(i)
            entry = state[i]
            if not p.is_contiguous():
                # Blocks follow the parameter's logical order (bitsandbytes makes such a
                # parameter contiguous); the copy is written back after the kernels.
                work = p.contiguous()
                originals.append(p)
                copies.append(work)
                p = work
            if quantised[i]:
                qp.append(p)
                qg.append(g.contiguous())
                keys = ["step", "exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"]
                for k in range(5):
                    qs[k].append(entry[keys[k]])
            else:
                fp.append(p)
                fg.append(g.contiguous())
                keys = ["step", "exp_avg", "exp_avg_sq"]
                for k in range(3):
                    fs[k].append(entry[keys[k]])
    empty: List[int] = []
    if len(qp) > 0:
        torch.ops.distopt_kernels.blockwise_adam_(
            qp, qg, qs[0], qs[1], qs[2], qs[3], qs[4], code1, code2, empty, empty,
            lr, betas[0], betas[1], eps, weight_decay, decoupled, maximize, bits, block_size,
        )
    if len(fp) > 0:
        torch.ops.distopt_kernels.float_state_adam_(
            fp, fg, fs[0], fs[1], fs[2], lr, betas[0], betas[1], eps, weight_decay,
            decoupled, maximize,
        )
    for k in range(len(originals)):
        originals[k].copy_(copies[k])


def quantised_flags(sizes: List[int], min_8bit_size: int) -> List[bool]:
    """Which parameters are quantised: those of at least ``min_8bit_size`` elements (in the
    whole parameter: ``sizes``)."""
    return [n >= min_8bit_size for n in sizes]


def param_problem(p: Tensor) -> str:
    """Why blockwise Adam cannot step ``p`` ("" if it can): the kernel is a CPU kernel of
    real float32, float16 and bfloat16 parameters."""
    if p.device.type != "cpu":
        return "on " + str(p.device) + " (blockwise Adam steps CPU parameters)"
    if p.dtype not in [torch.float32, torch.float16, torch.bfloat16]:
        return (str(p.dtype) + " (blockwise Adam steps float32, float16 and bfloat16 "
                "parameters)")
    return ""


def whole_sizes_of(params: List[Tensor], whole_sizes: Optional[List[int]]) -> List[int]:
    """``whole_sizes``, checked, or each parameter's own element count (and every parameter
    on the CPU: the kernel is a CPU kernel)."""
    for i in range(len(params)):
        problem = param_problem(params[i])
        if problem != "":
            raise ValueError("Invalid params[" + str(i) + "]: " + problem)
    if whole_sizes is None:
        return [p.numel() for p in params]
    if len(whole_sizes) != len(params):
        raise ValueError(
            "Invalid whole_sizes: " + str(len(whole_sizes)) + " sizes for "
            + str(len(params)) + " params"
        )
    for i in range(len(params)):
        if whole_sizes[i] < params[i].numel():
            raise ValueError(
                "Invalid whole_sizes[" + str(i) + "]: " + str(whole_sizes[i])
                + " for a piece of " + str(params[i].numel()) + " elements"
            )
    return whole_sizes


def checked_state(
    params: List[Tensor], state: Dict[int, Dict[str, Tensor]], quantised: List[bool], bits: int,
    block_size: int,
) -> Dict[int, Dict[str, Tensor]]:
    """``state`` moved to each parameter's device, or ValueError naming what is wrong."""
    out: Dict[int, Dict[str, Tensor]] = {}
    for i, entry in state.items():
        if i < 0 or i >= len(params):
            raise ValueError("Invalid state: an entry for parameter " + str(i) + " of " + str(len(params)))
        problem = state_problem(params[i], entry, quantised[i], bits, block_size)
        if problem != "":
            raise ValueError("Invalid state of parameter " + str(i) + ": " + problem)
        moved: Dict[str, Tensor] = {}
        for key, value in entry.items():
            moved[key] = value.to(torch.float32) if key == "step" else value.to(params[i].device)
        out[i] = moved
    return out


def check_arguments(lr: Union[float, Tensor], betas: Tuple[float, float], eps: float,
                    weight_decay: float, block_size: int, min_8bit_size: int) -> None:
    """ValueError naming the first bad argument of a blockwise Adam."""
    check_lr(lr)
    check_betas(betas)
    check_at_least("eps", eps, 0.0)
    check_at_least("weight_decay", weight_decay, 0.0)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"Invalid block_size: {block_size!r} (expected an even int >= 2)")
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
        raise ValueError(f"Invalid min_8bit_size: {min_8bit_size!r} (expected an int >= 0)")


def _set(name: str, value: List[float], lr: float, betas: Tuple[float, float], eps: float,
         weight_decay: float, cls_name: str) -> Tuple[float, Tuple[float, float], float, float]:
    if name == "lr":
        lr = scalar(name, value)
    elif name == "betas":
        b = pair(name, value)
        betas = (b[0], b[1])
    elif name == "eps":
        eps = scalar(name, value)
    elif name == "weight_decay":
        weight_decay = scalar(name, value)
    else:
        raise ValueError(
            unknown_hyperparameter(cls_name, name, ["lr", "betas", "eps", "weight_decay"])
        )
    return lr, betas, eps, weight_decay


class FunctionalAdam8bit:
    r"""Adam with 8-bit blockwise state, taking gradients as a list.

    torch.optim.Adam's update (``weight_decay`` an L2 penalty added to the gradient) on the
    state described in the module's docstring; equal to bitsandbytes' ``Adam8bit`` bit for bit
    without weight decay (bitsandbytes decouples the decay of its Adam8bit).

    Args:
        params: the parameters to update, in the order gradients will be given.
        lr, betas, eps, weight_decay, maximize: as torch.optim.Adam.
        block_size: elements per scale (256).
        min_8bit_size: parameters smaller than this keep float32 moments (4096).
        whole_sizes: when ``params`` are pieces of larger parameters (a shard), the element
            counts of those parameters, which decide what is quantised.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        maximize: bool = False,
        block_size: int = 256,
        min_8bit_size: int = 4096,
        whole_sizes: Optional[List[int]] = None,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalAdam8bit)
            params = check_params(params)
            check_types(FunctionalAdam8bit, locals())
            check_arguments(lr, betas, eps, weight_decay, block_size, min_8bit_size)
            if amsgrad:
                raise ValueError("Invalid amsgrad: True (expected False: blockwise Adam keeps no max of exp_avg_sq)")
        self.params = params
        self.lr = lr_float(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.maximize = bool(maximize)
        self.block_size = block_size
        self.min_8bit_size = min_8bit_size
        self.amsgrad = False
        self.blockwise = True
        self.bits = 8
        self.decoupled = False
        self.quantised = quantised_flags(whole_sizes_of(params, whole_sizes), min_8bit_size)
        self.code1 = torch.empty(0)
        self.code2 = torch.empty(0)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change lr, betas, eps or weight_decay between steps (a number alone too)."""
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        self.lr, self.betas, self.eps, self.weight_decay = _set(
            name, value, self.lr, self.betas, self.eps, self.weight_decay, "Adam8bit")

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError."""
        return checked_state(self.params, state, self.quantised, self.bits, self.block_size)

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Replace the whole state, checked first: a bad one changes nothing."""
        self.state = self.check_state(state)

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Update one parameter with its gradient (None: leave it as it is)."""
        self.step(one_gradient(len(self.params), index_of(self.params, param), grad))

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None."""
        if self.code1.numel() == 0:
            self.code1, self.code2 = code_books(self.bits)
        with torch.no_grad():
            blockwise_step(
                self.params, gradients, self.state, self.quantised, self.code1, self.code2,
                self.lr, self.betas, self.eps, self.weight_decay, self.decoupled, self.maximize,
                self.bits, self.block_size,
            )


class FunctionalAdamW8bit:
    r"""AdamW with 8-bit blockwise state, taking gradients as a list: torch.optim.AdamW's
    update and arguments plus ``block_size`` (256), ``min_8bit_size`` (4096) and
    ``whole_sizes`` (``FunctionalAdam8bit``); equal to bitsandbytes' ``AdamW8bit`` bit for bit.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
        block_size: int = 256,
        min_8bit_size: int = 4096,
        whole_sizes: Optional[List[int]] = None,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalAdamW8bit)
            params = check_params(params)
            check_types(FunctionalAdamW8bit, locals())
            check_arguments(lr, betas, eps, weight_decay, block_size, min_8bit_size)
            if amsgrad:
                raise ValueError("Invalid amsgrad: True (expected False: blockwise Adam keeps no max of exp_avg_sq)")
        self.params = params
        self.lr = lr_float(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.maximize = bool(maximize)
        self.block_size = block_size
        self.min_8bit_size = min_8bit_size
        self.amsgrad = False
        self.blockwise = True
        self.bits = 8
        self.decoupled = True
        self.quantised = quantised_flags(whole_sizes_of(params, whole_sizes), min_8bit_size)
        self.code1 = torch.empty(0)
        self.code2 = torch.empty(0)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change lr, betas, eps or weight_decay between steps (a number alone too)."""
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        self.lr, self.betas, self.eps, self.weight_decay = _set(
            name, value, self.lr, self.betas, self.eps, self.weight_decay, "AdamW8bit")

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError."""
        return checked_state(self.params, state, self.quantised, self.bits, self.block_size)

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Replace the whole state, checked first: a bad one changes nothing."""
        self.state = self.check_state(state)

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Update one parameter with its gradient (None: leave it as it is)."""
        self.step(one_gradient(len(self.params), index_of(self.params, param), grad))

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None."""
        if self.code1.numel() == 0:
            self.code1, self.code2 = code_books(self.bits)
        with torch.no_grad():
            blockwise_step(
                self.params, gradients, self.state, self.quantised, self.code1, self.code2,
                self.lr, self.betas, self.eps, self.weight_decay, self.decoupled, self.maximize,
                self.bits, self.block_size,
            )


class FunctionalAdamW4bit:
    r"""AdamW with 4-bit blockwise state, taking gradients as a list: torch.optim.AdamW's
    update and arguments plus ``block_size`` (128), ``min_8bit_size`` (4096: below it, float32
    moments) and ``whole_sizes``; torchao's 4-bit code books and encoding.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
        block_size: int = 128,
        min_8bit_size: int = 4096,
        whole_sizes: Optional[List[int]] = None,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalAdamW4bit)
            params = check_params(params)
            check_types(FunctionalAdamW4bit, locals())
            check_arguments(lr, betas, eps, weight_decay, block_size, min_8bit_size)
            if amsgrad:
                raise ValueError("Invalid amsgrad: True (expected False: blockwise Adam keeps no max of exp_avg_sq)")
        self.params = params
        self.lr = lr_float(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.maximize = bool(maximize)
        self.block_size = block_size
        self.min_8bit_size = min_8bit_size
        self.amsgrad = False
        self.blockwise = True
        self.bits = 4
        self.decoupled = True
        self.quantised = quantised_flags(whole_sizes_of(params, whole_sizes), min_8bit_size)
        self.code1 = torch.empty(0)
        self.code2 = torch.empty(0)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change lr, betas, eps or weight_decay between steps (a number alone too)."""
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        self.lr, self.betas, self.eps, self.weight_decay = _set(
            name, value, self.lr, self.betas, self.eps, self.weight_decay, "AdamW4bit")

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError."""
        return checked_state(self.params, state, self.quantised, self.bits, self.block_size)

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Replace the whole state, checked first: a bad one changes nothing."""
        self.state = self.check_state(state)

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Update one parameter with its gradient (None: leave it as it is)."""
        self.step(one_gradient(len(self.params), index_of(self.params, param), grad))

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None."""
        if self.code1.numel() == 0:
            self.code1, self.code2 = code_books(self.bits)
        with torch.no_grad():
            blockwise_step(
                self.params, gradients, self.state, self.quantised, self.code1, self.code2,
                self.lr, self.betas, self.eps, self.weight_decay, self.decoupled, self.maximize,
                self.bits, self.block_size,
            )


# ---------------------------------------------------------------------------------------
# The torch.optim classes (public as distopt.optim.Adam8bit, AdamW8bit, AdamW4bit).


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
            raise ValueError(f"Invalid amsgrad: {amsgrad!r} (expected False: {name} keeps no max of exp_avg_sq)")
        check_arguments(lr, betas, eps, weight_decay, block_size, min_8bit_size)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, block_size=block_size, min_8bit_size=min_8bit_size)
        super().__init__(params, defaults)  # each group checked by add_param_group
        self._codes = code_books(self.blockwise_bits)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch.optim's, then the group's own settings checked as the constructor checks
        its arguments (a group's ``block_size``, ``lr``, ``amsgrad``, ...: a bad one raises
        ValueError naming the group, and the group is not added)."""
        super().add_param_group(param_group)
        g, group = len(self.param_groups) - 1, self.param_groups[-1]
        name = type(self).__name__
        try:
            if group["amsgrad"]:
                raise ValueError(f"Invalid amsgrad: {group['amsgrad']!r} (expected False: "
                                 f"{name} keeps no max of exp_avg_sq)")
            check_arguments(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                            group["block_size"], group["min_8bit_size"])
        except ValueError as exc:
            self.param_groups.pop()
            raise ValueError(f"param_groups[{g}]: {exc}") from None
        for k, p in enumerate(group["params"]):
            problem = param_problem(p)
            if problem:
                self.param_groups.pop()
                raise ValueError(
                    f"Invalid params: param_groups[{g}]['params'][{k}] is {problem}"
                    .replace("blockwise Adam", name)
                )

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """torch.optim's (copy.deepcopy, pickle), and the code books, which it leaves out."""
        super().__setstate__(state)
        self._codes = code_books(self.blockwise_bits)

    def _fixed_layout(self, g: int, group: Dict[str, Any]) -> None:
        """A group's ``block_size`` and ``min_8bit_size`` lay its state out: fixed once it
        has state (ValueError naming the change, before anything steps)."""
        layouts = self.__dict__.setdefault("_layouts", {})
        now = (int(group["block_size"]), int(group["min_8bit_size"]))
        before = layouts.setdefault(g, now)
        for k, name in enumerate(("block_size", "min_8bit_size")):
            if now[k] != before[k]:
                raise ValueError(
                    f"Invalid param_groups[{g}]['{name}']: {now[k]} (it was {before[k]} when "
                    f"the group's state was made, which it lays out; set it before the first "
                    f"step, or load a state made with it)"
                )

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
        for g, group in enumerate(self.param_groups):
            self._fixed_layout(g, group)
        for group in self.param_groups:
            self._group_step(group)
        return loss

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch.optim's, with every saved entry checked first (a bad one changes nothing)
        and the codes, scales and float32 moments kept as saved (torch.optim would cast the
        floating ones to a bfloat16 / float16 parameter's dtype)."""
        groups = state_dict.get("param_groups", [])
        saved = {i: _tensor_steps(i, entry) for i, entry in state_dict.get("state", {}).items()}
        state_dict = {**state_dict, "state": saved}
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
        self.__dict__["_layouts"] = {}  # the loaded groups' block sizes lay the state out
        if len(ids) == len(params):
            for i, p in zip(ids, params):
                for key, value in saved.get(i, {}).items():
                    if key != "step":
                        self.state[p][key] = value.to(device=p.device, copy=True)


def _tensor_steps(i: Any, entry: Any) -> Dict[str, Any]:
    """A saved entry with a number ``step`` as a float32 tensor (torch.optim's older form),
    or ValueError naming what is not a tensor."""
    if not isinstance(entry, dict):
        raise ValueError(f"Invalid state_dict: the state of parameter {i} is "
                         f"{type(entry).__name__} (expected a dict)")
    out = dict(entry)
    step = out.get("step")
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        out["step"] = torch.tensor(float(step), dtype=torch.float32)
    for key, value in out.items():
        if not isinstance(value, Tensor):
            raise ValueError(f"Invalid state_dict: state[{i}][{key!r}] is "
                             f"{type(value).__name__} (expected a Tensor)")
    return out


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
