"""Adam for sparse gradients (lazy, row by row), as torch.optim.SparseAdam."""
import enum
import math
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_betas,
    check_dense_real_params,
    check_greater,
    check_lr,
    check_params,
    check_types,
    hyperparameter_argument,
)
from functional._common import (
    new_lr,
    index_of,
    lr_float,
    lr_of,
    lr_tensor,
    one_gradient,
    pair,
    scalar,
    unknown_hyperparameter,
)
from functional._flat import device_dtype_groups
from functional._kernels import (
    GatherRules,
    add_sparse_,
    check_spec_state,
    gather,
    no_operands,
    release,
)
from functional._spec import Operand, state_spec


class SparseAdamOperand(enum.Enum):
    """Positions of ``FunctionalSparseAdam``'s state in an operand set (``Operand``)."""

    STEP = 2
    EXP_AVG = 3
    EXP_AVG_SQ = 4


def sparse_adam_update(
    param: Tensor,
    grad: Tensor,
    step_t: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    maximize: bool,
) -> None:
    """One SparseAdam step of one parameter: the moments and the parameter change only
    at the gradient's entries."""
    # The step counts even when the gradient holds no values (torch.optim does the same).
    step_t.add_(1.0)
    if maximize:
        grad = -grad
    # The update is non-linear, so repeated indices must be summed first.
    grad = grad.coalesce()
    indices = grad._indices()
    values = grad._values()
    if values.numel() == 0:
        return
    size = grad.size()
    # m += (1 - b1) (g - m) and v += (1 - b2) (g^2 - v), on the gradient's entries only.
    old_exp_avg = exp_avg.sparse_mask(grad)._values()
    exp_avg_change = values.sub(old_exp_avg).mul_(1.0 - beta1)
    add_sparse_(exp_avg, torch.sparse_coo_tensor(indices, exp_avg_change, size))
    old_exp_avg_sq = exp_avg_sq.sparse_mask(grad)._values()
    exp_avg_sq_change = values.pow(2).sub_(old_exp_avg_sq).mul_(1.0 - beta2)
    add_sparse_(exp_avg_sq, torch.sparse_coo_tensor(indices, exp_avg_sq_change, size))
    numer = exp_avg_change.add_(old_exp_avg)
    denom = exp_avg_sq_change.add_(old_exp_avg_sq).sqrt_().add_(eps)
    step = float(step_t.item())
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    add_sparse_(param, torch.sparse_coo_tensor(indices, numer.div_(denom) * (-step_size), size))


class FunctionalSparseAdam:
    r"""Adam that updates only the entries a sparse gradient holds (e.g. embedding rows).

    Same arguments, defaults, state (``step``, ``exp_avg``, ``exp_avg_sq``) and results as
    :class:`torch.optim.SparseAdam`: the moments and the parameter change only where the
    coalesced sparse COO gradient :math:`g_t` has values, so rows that were not looked up
    keep their moments, instead of decaying them as Adam would. On those entries:

    .. math::
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t, \quad
        v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
        \theta_t &= \theta_{t-1} - \gamma \frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t}
            \frac{m_t}{\sqrt{v_t} + \epsilon}

    where :math:`t` counts the parameter's steps (``step`` is kept as a 0-dim float32
    tensor; torch.optim keeps a Python int, and the state_dict conversion turns one into
    the other). Sparse arithmetic has no foreach form, so parameters are updated one by one.

    Args:
        params: dense parameters to update, in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor), > 0.
        betas: decay rates of the first and second moment averages, each in [0, 1).
        eps: term added to the denominator, > 0.
        maximize: maximize the objective instead of minimizing it.

    Raises:
        ValueError: for lr or eps not > 0, a beta outside [0, 1), or a sparse or complex
            parameter.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        maximize: bool = False,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalSparseAdam)
            params = check_params(params)
            check_types(FunctionalSparseAdam, locals())
            check_lr(lr)
            check_greater("lr", lr_float(lr), 0.0)
            check_greater("eps", eps, 0.0)
            check_betas(betas)
            check_dense_real_params(params, "SparseAdam")
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.maximize = bool(maximize)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        # torch.optim.SparseAdam's step is a Python int: a CPU scalar here.
        self.spec = state_spec(["step", "exp_avg", "exp_avg_sq"], [0.0, 0.0, 0.0], ["step"], False)
        self.operand_sets = no_operands()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, betas, eps).

        Values are lists so that every class shares the signature (betas take two).
        """
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        if name == "lr":
            self.lr = new_lr(self.lr_tensor, value)
        elif name == "betas":
            betas = pair(name, value)
            self.betas = (betas[0], betas[1])
        elif name == "eps":
            self.eps = scalar(name, value)
        else:
            raise ValueError(unknown_hyperparameter("SparseAdam", name, ["lr", "betas", "eps"]))

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
            gradients: one sparse COO gradient (or None to skip that parameter) per parameter.

        Raises:
            ValueError: if the list's length, or a gradient's shape or dtype, does not match.
            RuntimeError: for a dense gradient (torch.optim's message); nothing is updated.
        """
        lr = lr_of(self.lr, self.lr_tensor)
        with torch.no_grad():
            rules = GatherRules(
                self.spec, "sparse",
                "SparseAdam does not support dense gradients, please consider Adam instead",
                False,
            )
            gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            for ops in self.operand_sets:
                params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
                steps = ops[SparseAdamOperand.STEP.value]
                exp_avgs = ops[SparseAdamOperand.EXP_AVG.value]
                exp_avg_sqs = ops[SparseAdamOperand.EXP_AVG_SQ.value]
                for j in range(len(params)):
                    sparse_adam_update(
                        params[j], grads[j], steps[j], exp_avgs[j], exp_avg_sqs[j], lr,
                        self.betas[0], self.betas[1], self.eps, self.maximize,
                    )
            release(self.operand_sets, self.groups)
