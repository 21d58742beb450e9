"""Row-wise optimizers for embedding tables, with fbgemm's rules: one second moment per row.

``FunctionalRowWiseAdagrad`` is fbgemm's ``EXACT_ROWWISE_ADAGRAD`` and
``FunctionalPartialRowWiseAdam`` its ``PARTIAL_ROWWISE_ADAM``, on a 2-D parameter (a table,
or a shard of one) and its row-sparse gradient: only the rows the gradient holds change.
"Exact" is fbgemm's word for summing the gradients of a row looked up several times in one
step before the update (the update is not linear in the gradient); the sum runs over the
gradient's entries in their order, one after another, as fbgemm's CPU kernel sums a row's
lookups (``summed_rows``).

The arithmetic follows fbgemm-gpu 1.8.0's kernels step by step: its CPU kernel for
row-wise Adagrad (float32 operands, ``sqrtf``, the sum of squares accumulated one element
after another, and the final ``correction * w - g * multiplier`` contracted to one fused
multiply-add, as its compiler emits it), its CUDA kernel for partial row-wise Adam (which
has no CPU kernel in 1.8.0). torch's float32 ``sqrt`` on the CPU is not always correctly
rounded (measured: 1 ulp off on some inputs, torch 2.13), so ``sqrtf`` is taken in float64
and rounded, and a fused multiply-add is taken in float64 and rounded (the product of two
float32 values is exact there).
"""
import enum
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from functional._common import (
    index_of,
    lr_float,
    lr_of,
    lr_tensor,
    new_lr,
    one_gradient,
    pair,
    scalar,
    unknown_hyperparameter,
)
from functional._compile import ensure_scripted
from functional._flat import device_dtype_groups
from functional._kernels import GatherRules, check_spec_state, gather, no_operands, release
from functional._spec import Operand, Place, StateSpec
from functional._validation import (
    check_at_least,
    check_betas,
    check_choice,
    check_dense_real_params,
    check_lr,
    check_params,
    check_types,
    hyperparameter_argument,
)

#: fbgemm's ``WeightDecayMode`` values row-wise Adagrad takes, by name: none, L2 (added to
#: the gradient before its mean square), decoupled (the row shrunk by ``lr * weight_decay``).
WEIGHT_DECAY_MODES = ["none", "l2", "decouple"]

#: State keys that may hold one value per row of a 2-D parameter (fbgemm's names).
ROW_STATE_KEYS = ("momentum1", "momentum2")


class RowWiseAdagradOperand(enum.Enum):
    """Positions of ``FunctionalRowWiseAdagrad``'s state in an operand set (``Operand``)."""

    STEP = 2
    MOMENTUM1 = 3


class PartialRowWiseAdamOperand(enum.Enum):
    """Positions of ``FunctionalPartialRowWiseAdam``'s state in an operand set (``Operand``)."""

    STEP = 2
    MOMENTUM1 = 3
    MOMENTUM2 = 4


def summed_rows(grad: Tensor) -> Tuple[Tensor, Tensor]:
    """The rows a sparse COO gradient holds (ascending, each once) and each one's gradient:
    its entries added one after another in the order they come (``coalesce`` promises no
    order)."""
    indices = grad._indices()[0]
    values = grad._values()
    rows, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    summed = torch.zeros((rows.numel(), values.shape[1]), dtype=values.dtype, device=values.device)
    summed.index_add_(0, inverse, values)
    return rows, summed


def _fma(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """``a * b + c`` rounded once to ``c``'s dtype (float32 operands: their product is exact
    in float64, so the float64 sum rounded to float32 is the fused multiply-add but for a
    tie in the second rounding)."""
    return torch.add(c.double(), a.double() * b.double()).to(c.dtype)


def _sqrtf(x: Tensor) -> Tensor:
    """The correctly rounded square root, as C's ``sqrtf``."""
    return x.double().sqrt_().to(x.dtype)


def _mean_square(g: Tensor) -> Tensor:
    """Each row's mean of squares, the squares added one after another (fbgemm's CPU order;
    one vector op per column, on the squares transposed so that each column is contiguous)."""
    squares = (g * g).t().contiguous()
    total = torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
    for d in range(g.shape[1]):
        total.add_(squares[d])
    return total / float(g.shape[1])


def rowwise_adagrad_update(
    param: Tensor,
    grad: Tensor,
    step_t: Tensor,
    momentum1: Tensor,
    lr: float,
    eps: float,
    weight_decay: float,
    weight_decay_mode: str,
) -> None:
    """One EXACT_ROWWISE_ADAGRAD step of one table on the rows its gradient holds."""
    step_t.add_(1.0)
    if grad._nnz() == 0:
        return
    rows, g = summed_rows(grad)
    dtype = param.dtype
    w = param.index_select(0, rows)
    lr_t = torch.tensor(lr, dtype=dtype)
    wd_t = torch.tensor(weight_decay, dtype=dtype)
    decayed = _fma(w, wd_t, g) if weight_decay_mode == "l2" else g
    moment = momentum1.index_select(0, rows) + _mean_square(decayed)
    momentum1.index_put_((rows,), moment)  # index_copy_ of a vector: 7x slower here
    multiplier = lr_t / (_sqrtf(moment) + torch.tensor(eps, dtype=dtype))
    # Contracted too: 1 - multiplier * weight_decay is fma(multiplier, -weight_decay, 1).
    if weight_decay_mode == "l2":
        correction = _fma(multiplier, -wd_t, torch.ones_like(multiplier))
    elif weight_decay_mode == "decouple":
        correction = (1.0 - lr_t * wd_t).expand_as(multiplier)
    else:  # correction 1: fma(1, w, -x) is w - x rounded once, in float32 already
        param.index_copy_(0, rows, w - g * multiplier.unsqueeze(1))
        return
    # correction * w - g * multiplier, contracted: fma(correction, w, -(g * multiplier)).
    new_w = _fma(w, correction.unsqueeze(1), -(g * multiplier.unsqueeze(1)))
    param.index_copy_(0, rows, new_w)


def partial_rowwise_adam_update(
    param: Tensor,
    grad: Tensor,
    step_t: Tensor,
    momentum1: Tensor,
    momentum2: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One PARTIAL_ROWWISE_ADAM step of one table on the rows its gradient holds."""
    step_t.add_(1.0)
    if grad._nnz() == 0:
        return
    t = float(step_t.item())
    rows, g = summed_rows(grad)
    dtype = param.dtype
    b1 = float(torch.tensor(beta1, dtype=dtype).item())
    b2 = float(torch.tensor(beta2, dtype=dtype).item())
    w = param.index_select(0, rows)
    # v = g_avg * (1 - b2) (double) + (v * b2) (float), kept as float.
    v_old = momentum2.index_select(0, rows)
    v = _mean_square(g).double() * (1.0 - b2) + (v_old * b2).double()
    momentum2.index_put_((rows,), v.to(dtype))
    v_hat = (v / (1.0 - float(torch.tensor(b2 ** t, dtype=dtype).item()))).to(dtype)
    # m = fma(g, (float)(1 - b1), m * b1)
    m = _fma(g, torch.tensor(1.0 - b1, dtype=dtype), momentum1.index_select(0, rows) * b1)
    momentum1.index_copy_(0, rows, m)
    bias1 = 1.0 - float(torch.tensor(b1 ** t, dtype=dtype).item())
    denom = (_sqrtf(v_hat) + torch.tensor(eps, dtype=dtype)).double().unsqueeze(1)
    decay = (w * torch.tensor(weight_decay, dtype=dtype)).double()
    lr_f = float(torch.tensor(lr, dtype=dtype).item())
    update = (m.double() / bias1 / denom + decay) * lr_f
    param.index_copy_(0, rows, (w.double() - update).to(dtype))


class FunctionalRowWiseAdagrad:
    r"""Row-wise Adagrad (fbgemm's ``EXACT_ROWWISE_ADAGRAD``) on row-sparse gradients.

    One number of state per row, ``momentum1``: the running sum of the row's mean squared
    gradient. For a row the gradient :math:`g_t` holds (its lookups summed), of dimension
    :math:`D`, weight decay :math:`\lambda` and learning rate :math:`\gamma`:

    .. math::
        \tilde g_t &= g_t + \lambda \theta_{t-1} \text{ (L2) else } g_t \\
        m_t &= m_{t-1} + \frac{1}{D} \sum_d \tilde g_{t,d}^2 \\
        c_t &= 1 - \frac{\gamma \lambda}{\sqrt{m_t} + \epsilon} \text{ (L2)}, \quad
            1 - \gamma \lambda \text{ (decouple)}, \quad 1 \text{ (none)} \\
        \theta_t &= c_t \, \theta_{t-1} - \frac{\gamma}{\sqrt{m_t} + \epsilon} g_t

    Rows the gradient does not hold keep their values and state. ``step`` (a 0-dim float32
    tensor) counts the steps; the rule does not read it.

    Args:
        params: 2-D dense parameters (tables or shards of them).
        lr: learning rate, >= 0 (fbgemm's default 0.01).
        eps: term added to the denominator, >= 0 (fbgemm's default 1e-8).
        weight_decay: weight decay factor, >= 0.
        weight_decay_mode: ``"none"``, ``"l2"`` or ``"decouple"`` (fbgemm's
            ``WeightDecayMode.NONE``, ``L2``, ``DECOUPLE``).

    Raises:
        ValueError: a negative lr, eps or weight_decay, an unknown weight_decay_mode, or a
            parameter that is not a dense, real 2-D tensor.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-2,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        weight_decay_mode: str = "none",
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalRowWiseAdagrad)
            params = check_params(params)
            check_types(FunctionalRowWiseAdagrad, locals())
            check_lr(lr)
            check_at_least("eps", eps, 0.0)
            check_at_least("weight_decay", weight_decay, 0.0)
            check_choice("weight_decay_mode", weight_decay_mode, WEIGHT_DECAY_MODES)
            check_table_params(params, "RowWiseAdagrad")
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.weight_decay_mode = weight_decay_mode
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.spec = StateSpec(["step", "momentum1"], [0.0, 0.0], [Place.CPU_SCALAR, Place.ROW])
        self.operand_sets = no_operands()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, eps, weight_decay)."""
        if not torch.jit.is_scripting():
            value = hyperparameter_argument(name, value)
        if name == "lr":
            self.lr = new_lr(self.lr_tensor, value)
        elif name == "eps":
            self.eps = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        else:
            raise ValueError(
                unknown_hyperparameter("RowWiseAdagrad", name, ["lr", "eps", "weight_decay"])
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
            gradients: one sparse COO gradient (or None) per parameter.

        Raises:
            ValueError: a list of another length, or a gradient of another shape or dtype.
            RuntimeError: a dense gradient; nothing is updated.
        """
        lr = lr_of(self.lr, self.lr_tensor)
        with torch.no_grad():
            rules = GatherRules(self.spec, "sparse", "RowWiseAdagrad takes sparse gradients only "
                                "(a table's row-sparse gradient)", False)
            gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            for ops in self.operand_sets:
                params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
                steps = ops[RowWiseAdagradOperand.STEP.value]
                moments = ops[RowWiseAdagradOperand.MOMENTUM1.value]
                for j in range(len(params)):
                    rowwise_adagrad_update(
                        params[j], grads[j], steps[j], moments[j], lr, self.eps,
                        self.weight_decay, self.weight_decay_mode,
                    )
            release(self.operand_sets, self.groups)


class FunctionalPartialRowWiseAdam:
    r"""Partial row-wise Adam (fbgemm's ``PARTIAL_ROWWISE_ADAM``) on row-sparse gradients.

    The first moment ``momentum1`` per element, the second ``momentum2`` per row (the mean
    of the row's squared gradient). For a row the gradient :math:`g_t` holds (its lookups
    summed), of dimension :math:`D`, with :math:`t` the step count:

    .. math::
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t, \quad
        v_t = \beta_2 v_{t-1} + (1 - \beta_2) \frac{1}{D} \sum_d g_{t,d}^2 \\
        \theta_t &= \theta_{t-1} - \gamma \left( \frac{m_t / (1 - \beta_1^t)}
            {\sqrt{v_t / (1 - \beta_2^t)} + \epsilon} + \lambda \theta_{t-1} \right)

    Rows the gradient does not hold keep their values and moments (lazy, as
    ``torch.optim.SparseAdam``); ``step`` (a 0-dim float32 tensor) counts every step.

    Args:
        params: 2-D dense parameters (tables or shards of them).
        lr: learning rate, >= 0 (fbgemm's default 0.01).
        betas: decay rates of the two moments, each in [0, 1) (fbgemm's 0.9, 0.999).
        eps: term added to the denominator, >= 0 (fbgemm's default 1e-8).
        weight_decay: decoupled weight decay factor, >= 0 (fbgemm's rule: inside the
            learning rate, on the rows stepped).

    Raises:
        ValueError: a negative lr, eps or weight_decay, a beta outside [0, 1), or a
            parameter that is not a dense, real 2-D tensor.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-2,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalPartialRowWiseAdam)
            params = check_params(params)
            check_types(FunctionalPartialRowWiseAdam, locals())
            check_lr(lr)
            check_betas(betas)
            check_at_least("eps", eps, 0.0)
            check_at_least("weight_decay", weight_decay, 0.0)
            check_table_params(params, "PartialRowWiseAdam")
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.spec = StateSpec(
            ["step", "momentum1", "momentum2"], [0.0, 0.0, 0.0],
            [Place.CPU_SCALAR, Place.PARAM_LAYOUT, Place.ROW],
        )
        self.operand_sets = no_operands()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, betas, eps, weight_decay)."""
        if not torch.jit.is_scripting():
            value = hyperparameter_argument(name, value)
        if name == "lr":
            self.lr = new_lr(self.lr_tensor, value)
        elif name == "betas":
            betas = pair(name, value)
            self.betas = (betas[0], betas[1])
        elif name == "eps":
            self.eps = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        else:
            raise ValueError(unknown_hyperparameter(
                "PartialRowWiseAdam", name, ["lr", "betas", "eps", "weight_decay"]))

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
            gradients: one sparse COO gradient (or None) per parameter.

        Raises:
            ValueError: a list of another length, or a gradient of another shape or dtype.
            RuntimeError: a dense gradient; nothing is updated.
        """
        lr = lr_of(self.lr, self.lr_tensor)
        with torch.no_grad():
            rules = GatherRules(self.spec, "sparse", "PartialRowWiseAdam takes sparse gradients "
                                "only (a table's row-sparse gradient)", False)
            gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            for ops in self.operand_sets:
                params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
                steps = ops[PartialRowWiseAdamOperand.STEP.value]
                m1 = ops[PartialRowWiseAdamOperand.MOMENTUM1.value]
                m2 = ops[PartialRowWiseAdamOperand.MOMENTUM2.value]
                for j in range(len(params)):
                    partial_rowwise_adam_update(
                        params[j], grads[j], steps[j], m1[j], m2[j], lr, self.betas[0],
                        self.betas[1], self.eps, self.weight_decay,
                    )
            release(self.operand_sets, self.groups)


def check_table_params(params: List[Tensor], algorithm: str) -> None:
    """Every parameter must be a dense, real, 2-D floating-point tensor (a table's rows)."""
    check_dense_real_params(params, algorithm)
    for i, p in enumerate(params):
        if p.dim() != 2 or not p.is_floating_point():
            raise ValueError(
                f"Invalid params[{i}]: {p.dim()}-D {p.dtype} (expected a 2-D floating-point "
                f"table: {algorithm} keeps its state per row)"
            )
