"""Muon (momentum orthogonalized by Newton-Schulz) for 2-D parameters, as torch.optim.Muon."""
import enum
import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_at_least,
    check_below,
    check_choice,
    check_length,
    check_lr,
    check_matrix_params,
    check_dense_real_params,
    check_params,
    check_types,
    hyperparameter_argument,
)
from functional._common import (
    index_of,
    one_gradient,
    scalar,
    unknown_hyperparameter,
)
from functional._flat import device_dtype_groups
from functional._kernels import GatherRules, check_spec_state, gather, no_operands, release
from functional._spec import Operand, Place, StateSpec


class MuonOperand(enum.Enum):
    """Positions of ``FunctionalMuon``'s state in an operand set (``Operand``)."""

    MOMENTUM_BUFFER = 2


def newton_schulz_orthogonalize(
    matrix: Tensor, coefficients: Tuple[float, float, float], steps: int, eps: float
) -> Tensor:
    """An approximately orthogonal matrix with ``matrix``'s singular vectors, in bfloat16.

    Runs ``steps`` quintic Newton-Schulz iterations :math:`X \\leftarrow aX + (bA + cA^2)X`,
    :math:`A = XX^\\top`, on the matrix scaled to Frobenius norm <= 1 (``eps`` keeps the
    division finite), working on the wide orientation so that :math:`A` is the smaller Gram
    matrix; the same bfloat16 operations as torch.optim.Muon.
    """
    a = coefficients[0]
    b = coefficients[1]
    c = coefficients[2]
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.to(torch.bfloat16)
    if tall:
        x = x.t()
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = torch.matmul(x, x.t())
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    if tall:
        x = x.t()
    return x


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], rows: int, cols: int) -> float:
    """The learning rate scaled for a ``rows`` x ``cols`` matrix, as torch.optim.Muon does."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1.0, float(rows) / float(cols)))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(float(max(rows, cols)))
    else:
        ratio = 1.0
    return lr * ratio


def muon_update(
    ops: List[List[Tensor]],
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: Tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: Optional[str],
) -> None:
    """One Muon step over ``gather``'s operands ``[params, grads, momentum_buffers]``, one
    matrix at a time (each update is orthogonalized on its own)."""
    params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
    bufs = ops[MuonOperand.MOMENTUM_BUFFER.value]
    for j in range(len(params)):
        param, grad, buf = params[j], grads[j], bufs[j]
        buf.lerp_(grad, 1.0 - momentum)
        if nesterov:
            update = grad.lerp(buf, momentum)
        else:
            update = buf
        update = newton_schulz_orthogonalize(update, ns_coefficients, ns_steps, eps)
        adjusted = adjusted_lr(lr, adjust_lr_fn, param.size(0), param.size(1))
        param.mul_(1.0 - lr * weight_decay)
        param.add_(update, alpha=-adjusted)


class FunctionalMuon:
    r"""Muon: SGD-momentum whose update matrix is orthogonalized before it is applied.

    Same arguments, defaults, state (``momentum_buffer``) and results as
    :class:`torch.optim.Muon`; every parameter must be 2-D. Orthogonalizing equalizes the
    update's singular values, so no direction of a weight matrix dominates the step. With
    gradient :math:`g_t`, momentum :math:`\mu`, weight decay :math:`\lambda`, learning rate
    :math:`\gamma` and Newton-Schulz operator :math:`\mathrm{NS}` (``ns_steps`` iterations
    with ``ns_coefficients``, in bfloat16):

    .. math::
        B_t &= \mu B_{t-1} + (1 - \mu) g_t \\
        \tilde B_t &= \begin{cases} (1 - \mu) g_t + \mu B_t & \text{Nesterov} \\
            B_t & \text{otherwise} \end{cases} \\
        \theta_t &= (1 - \gamma\lambda) \theta_{t-1} - s(\gamma)\, \mathrm{NS}(\tilde B_t)

    where :math:`s(\gamma)` is :math:`\gamma \sqrt{\max(1, A/B)}` for an :math:`A \times B`
    matrix (``adjust_lr_fn`` None or ``"original"``) or :math:`0.2 \gamma \sqrt{\max(A, B)}`
    (``"match_rms_adamw"``). torch.optim has no foreach form, so parameters are updated one
    by one.

    Args:
        params: 2-D parameters to update, in the order gradients will be given.
        lr: learning rate (a float).
        weight_decay: decoupled weight decay coefficient (multiplied by lr).
        momentum: momentum factor.
        nesterov: use Nesterov momentum.
        ns_coefficients: (a, b, c) of the quintic Newton-Schulz polynomial.
        eps: floor of the norm the matrix is divided by before the iterations.
        ns_steps: number of Newton-Schulz iterations (< 100).
        adjust_lr_fn: ``None``, ``"original"`` or ``"match_rms_adamw"``.

    Raises:
        ValueError: for a negative lr, momentum or weight_decay, an unknown adjust_lr_fn,
            a parameter that is not 2-D, ns_coefficients not of three values or
            ns_steps >= 100 (torch.optim checks the last two only when it steps).
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: Optional[str] = None,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalMuon)
            params = check_params(params)
            check_dense_real_params(params, "Muon")
            check_types(FunctionalMuon, locals())
            check_lr(lr)
            check_at_least("momentum", momentum, 0.0)
            check_at_least("weight_decay", weight_decay, 0.0)
            check_choice("adjust_lr_fn", adjust_lr_fn, [None, "original", "match_rms_adamw"])
            check_matrix_params(params)
            check_length("ns_coefficients", ns_coefficients, 3)
            check_below("ns_steps", ns_steps, 100)
        self.params = params
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.ns_coefficients = (
            float(ns_coefficients[0]),
            float(ns_coefficients[1]),
            float(ns_coefficients[2]),
        )
        self.eps = float(eps)
        self.ns_steps = ns_steps
        self.adjust_lr_fn = adjust_lr_fn
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.spec = StateSpec(["momentum_buffer"], [0.0], [Place.PARAM_LAYOUT])
        self.operand_sets = no_operands()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, weight_decay, momentum, eps,
        ns_coefficients).

        Values are lists so that every class shares the signature (ns_coefficients take
        three).
        """
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        if name == "lr":
            self.lr = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        elif name == "momentum":
            self.momentum = scalar(name, value)
        elif name == "eps":
            self.eps = scalar(name, value)
        elif name == "ns_coefficients":
            if len(value) != 3:
                raise ValueError(f"Invalid ns_coefficients: {value} (expected three values)")
            self.ns_coefficients = (value[0], value[1], value[2])
        else:
            raise ValueError(
                unknown_hyperparameter(
                    "Muon", name, ["lr", "weight_decay", "momentum", "eps", "ns_coefficients"]
                )
            )

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError (``checked_state``)."""
        return check_spec_state(self.params, state, self.spec)

    def set_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Replace the whole state, checked first (``check_state``): a bad one changes nothing."""
        self.state = self.check_state(state)

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Update one parameter with its gradient (None: leave it and its state as they are)."""
        self.step(one_gradient(len(self.params), index_of(self.params, param), grad))

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None.

        Args:
            gradients: one gradient (or None to skip that parameter) per parameter.

        Raises:
            ValueError: if the list's length, or a gradient's shape or dtype, does not match.
            RuntimeError: for a sparse gradient or a complex parameter (as torch.optim).
        """
        for i in range(min(len(gradients), len(self.params))):
            if gradients[i] is not None and self.params[i].is_complex():
                raise RuntimeError("Muon does not support complex parameters")  # torch.optim's message
        with torch.no_grad():
            rules = GatherRules(
                self.spec, "dense", "Muon does not support sparse gradients", False
            )
            gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            for s in range(len(self.operand_sets)):
                muon_update(
                    self.operand_sets[s], self.lr, self.weight_decay, self.momentum, self.nesterov,
                    self.ns_coefficients, self.ns_steps, self.eps, self.adjust_lr_fn,
                )
            release(self.operand_sets, self.groups)
