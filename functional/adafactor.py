"""Adafactor (factored second moments, relative step size), as torch.optim.Adafactor."""
import enum
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_at_least,
    check_at_most,
    check_lr,
    check_optional_eps_pair,
    check_dense_real_params,
    check_params,
    check_types,
    hyperparameter_argument,
)
from functional._common import (
    new_lr,
    checked_state,
    index_of,
    lr_float,
    lr_of,
    lr_tensor,
    meta_params,
    one_gradient,
    optional_flag,
    scalar,
    unknown_hyperparameter,
)
from functional._flat import Groups, device_dtype_groups
from functional._kernels import (
    check_length,
    increment_steps,
    native_kernels,
    native_op,
    new_operands,
    no_operands,
    refuse,
    release,
    signed,
)
from functional._spec import Operand


class AdafactorOperand(enum.Enum):
    """Positions of ``FunctionalAdafactor``'s state in ``adafactor_gather``'s operand sets
    (``Operand``): ``step``, then the second moment, factored (``row_var``, ``col_var``)
    for a matrix, else ``variance`` in both places."""

    STEP = 2
    FIRST = 3
    SECOND = 4


def machine_epsilon(dtype: torch.dtype) -> float:
    """``torch.finfo(dtype).eps`` for the floating dtypes (``torch.finfo`` is not scriptable)."""
    if dtype == torch.float64:
        return 2.220446049250313e-16
    if dtype == torch.float16:
        return 0.0009765625
    if dtype == torch.bfloat16:
        return 0.0078125
    return 1.1920928955078125e-07


def adafactor_state(p: Tensor) -> Dict[str, Tensor]:
    """A fresh state entry for ``p`` (also the template ``check_state`` compares with):
    factored row and column variances for matrices, a full one otherwise."""
    # On the CPU, as torch.optim's Adafactor keeps it (it has no fused or capturable mode).
    step = torch.full((), 0.0, dtype=torch.float32, device=torch.device("cpu"))
    if p.dim() > 1:
        row_shape = list(p.shape)
        row_shape[-1] = 1
        col_shape = list(p.shape)
        col_shape[-2] = 1
        return {"step": step, "row_var": p.new_zeros(row_shape), "col_var": p.new_zeros(col_shape)}
    return {"step": step, "variance": torch.zeros_like(p, memory_format=torch.preserve_format)}


def adafactor_gather(
    operand_sets: List[List[List[Tensor]]],
    params: List[Tensor],
    state: Dict[int, Dict[str, Tensor]],
    groups: Groups,
    gradients: List[Optional[Tensor]],
) -> None:
    """``_kernels.gather`` for Adafactor, whose state depends on a parameter's shape: per
    group, the operand sets ``[params, grads, steps, row_vars, col_vars]`` of matrices and
    ``[params, grads, steps, variances, variances]`` of the rest, into ``operand_sets``."""
    check_length(params, gradients)
    operand_sets.clear()
    created: List[int] = []
    for group in groups.dense:  # Adafactor is never flattened: no flat buffers
        mat = new_operands(3)
        vec = new_operands(3)
        for i in group:
            g = gradients[i]
            if g is not None:
                p = params[i]
                if (not g.is_same_size(p) or g.dtype != p.dtype or g.layout != torch.strided
                        or g.device != p.device or p.is_complex()):
                    if p.is_complex():
                        for j in created:
                            del state[j]
                        raise RuntimeError("Adafactor does not support complex parameters")  # torch.optim's message
                    refuse(state, created, i, g, p, "Adafactor does not support sparse gradients")
                if p.numel() == 0:  # torch.optim divides by its element count: ZeroDivisionError
                    for j in created:
                        del state[j]
                    raise ValueError(
                        f"Invalid params[{i}]: shape {list(p.shape)}, no elements (expected a parameter "
                        f"with elements: Adafactor scales its step by the parameter's RMS)"
                    )
                if i not in state:
                    state[i] = adafactor_state(p)
                    created.append(i)
                entry = state[i]
                if g.dim() > 1:
                    ops, first, second = mat, "row_var", "col_var"
                else:
                    ops, first, second = vec, "variance", "variance"
                ops[Operand.PARAMS.value].append(p)
                ops[Operand.GRADS.value].append(g)
                ops[AdafactorOperand.STEP.value].append(entry["step"])
                ops[AdafactorOperand.FIRST.value].append(entry[first])
                ops[AdafactorOperand.SECOND.value].append(entry[second])
        operand_sets.append(mat)
        operand_sets.append(vec)


@native_op
def adafactor_native(
    ops: List[List[Tensor]],
    lr: float,
    eps1: float,
    eps2: float,
    beta2_decay: float,
    d: float,
    weight_decay: float,
    maximize: bool,
    factored: bool,
) -> None:
    """``adafactor_update`` on the fused CPU kernel (``csrc/elementwise_ops.cpp``): three
    passes over each gradient instead of about ten."""
    torch.ops.distopt_kernels.adafactor_(
        ops[Operand.PARAMS.value], ops[Operand.GRADS.value], ops[AdafactorOperand.STEP.value],
        ops[AdafactorOperand.FIRST.value], ops[AdafactorOperand.SECOND.value], lr, beta2_decay,
        eps1, eps2, d, weight_decay, maximize, factored,
    )


def factored_estimates(
    grads: List[Tensor],
    row_vars: List[Tensor],
    col_vars: List[Tensor],
    decays: List[Union[int, float, complex]],
    eps1: float,
) -> List[Tensor]:
    """Matrices' second-moment estimates ``R C / max(mean_-2(R), eps1)``, after moving the
    row and column variances ``R``, ``C`` towards the gradients' row and column mean squares
    by ``decays`` (in place)."""
    row_sizes: List[Union[int, float, complex]] = [g.size(-1) for g in grads]
    col_sizes: List[Union[int, float, complex]] = [g.size(-2) for g in grads]
    row_means = [torch.linalg.vector_norm(g, 2.0, [-1], True) for g in grads]
    torch._foreach_mul_(row_means, row_means)
    torch._foreach_div_(row_means, row_sizes)
    torch._foreach_lerp_(row_vars, row_means, decays)
    col_means = [torch.linalg.vector_norm(g, 2.0, [-2], True) for g in grads]
    torch._foreach_mul_(col_means, col_means)
    torch._foreach_div_(col_means, col_sizes)
    torch._foreach_lerp_(col_vars, col_means, decays)
    estimates = [torch.matmul(row_vars[j], col_vars[j]) for j in range(len(grads))]
    row_var_means = [r.mean(dim=-2, keepdim=True) for r in row_vars]
    torch._foreach_clamp_min_(row_var_means, eps1)
    torch._foreach_div_(estimates, row_var_means)
    return estimates


def adafactor_update(
    ops: List[List[Tensor]],
    lr: float,
    eps1: float,
    eps2: float,
    beta2_decay: float,
    d: float,
    weight_decay: float,
    maximize: bool,
    factored: bool,
    native: bool = False,
) -> None:
    """One Adafactor step over ``adafactor_gather``'s operands ``[params, grads, steps,
    first, second]``: row_var/col_var when ``factored``, else the variance twice. On the
    fused CPU kernel when ``native`` (``native_kernels``) and the parameters are on the CPU,
    else on foreach ops."""
    params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
    steps = ops[AdafactorOperand.STEP.value]
    first, second = ops[AdafactorOperand.FIRST.value], ops[AdafactorOperand.SECOND.value]
    if len(params) == 0:
        return
    if native and params[0].device.type == "cpu":
        adafactor_native(ops, lr, eps1, eps2, beta2_decay, d, weight_decay, maximize, factored)
        return
    grads = signed(grads, maximize)
    increment_steps(steps)
    # Foreach ScalarList overloads take TorchScript's `number`, not List[float].
    decays: List[Union[int, float, complex]] = []
    alphas: List[float] = []
    for j in range(len(params)):
        t = float(steps[j].item())
        decays.append(t ** beta2_decay)
        rho = min(lr, 1.0 / (t ** 0.5))
        p = params[j]
        rms = float(torch.linalg.vector_norm(p, 2.0).item()) / (p.numel() ** 0.5)
        alphas.append(max(eps2, rms) * rho)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    if factored:
        estimates = factored_estimates(grads, first, second, decays, eps1)
    else:
        squares = torch._foreach_mul(grads, grads)
        torch._foreach_lerp_(first, squares, decays)
        estimates = [v.clone() for v in first]
    torch._foreach_clamp_min_(estimates, eps1 * eps1)
    torch._foreach_rsqrt_(estimates)
    torch._foreach_mul_(estimates, grads)
    scales: List[Union[int, float, complex]] = []
    for j in range(len(params)):
        u = estimates[j]
        u_rms = float(torch.linalg.vector_norm(u, 2.0).item()) / ((u.numel() ** 0.5) * d)
        scales.append(-alphas[j] / max(1.0, u_rms))
    if len(params) <= 16:
        # A few (<= 16) tensors: one pass each (param += scale * update) beats the foreach
        # pair (scale the updates, then add), which reads and writes every update twice.
        for j in range(len(params)):
            params[j].add_(estimates[j], alpha=scales[j])
    else:
        torch._foreach_mul_(estimates, scales)
        torch._foreach_add_(params, estimates)


class FunctionalAdafactor:
    r"""Adafactor: Adam-like steps whose second moment is kept as row and column factors.

    Same arguments, defaults, state (``step``; ``row_var`` and ``col_var`` for parameters with
    two or more dimensions, factored over the last two; ``variance`` for vectors and scalars)
    and results as :class:`torch.optim.Adafactor`. It needs memory proportional to the rows
    plus the columns of a matrix instead of its size. With gradient :math:`G_t`, learning rate
    :math:`\gamma`, :math:`\tau` = ``beta2_decay``, :math:`(\epsilon_1, \epsilon_2)` = ``eps``,
    clipping threshold :math:`d` and weight decay :math:`\lambda`:

    .. math::
        \hat\beta_{2,t} &= 1 - t^{\tau}, \quad \rho_t = \min(\gamma, 1/\sqrt{t}), \quad
            \alpha_t = \max(\epsilon_2, \mathrm{RMS}(\theta_{t-1})) \rho_t \\
        \theta_{t-1} &\leftarrow (1 - \gamma\lambda) \theta_{t-1} \\
        R_t &= \hat\beta_{2,t} R_{t-1} + (1 - \hat\beta_{2,t}) \mathrm{mean}_{-1}(G_t^2), \quad
        C_t = \hat\beta_{2,t} C_{t-1} + (1 - \hat\beta_{2,t}) \mathrm{mean}_{-2}(G_t^2) \\
        \hat V_t &= R_t C_t / \max(\mathrm{mean}_{-2}(R_t), \epsilon_1)
            \text{ (or } V_t = \hat\beta_{2,t} V_{t-1} + (1 - \hat\beta_{2,t}) G_t^2
            \text{ for vectors)} \\
        U_t &= G_t / \sqrt{\max(\hat V_t, \epsilon_1^2)}, \quad
        \theta_t = \theta_{t-1} - \alpha_t U_t / \max(1, \mathrm{RMS}(U_t) / d)

    :math:`\epsilon_1` = None means the machine epsilon of the first updated parameter's
    dtype, as in torch.optim. CPU steps run on this project's fused kernel where it was built
    (built at the first import: the norms and the row and column means in one pass over the
    gradient, the update's norm in a second, the update in a third), else and with
    ``foreach=True`` on ``torch._foreach_*`` kernels (torch.optim uses them only with
    ``foreach=True``; its per-tensor loop computes the same values).

    Args:
        params: the parameters to update (any iterable of Tensors, e.g.
            ``model.parameters()``), in the order gradients will be given.
        lr: upper bound of the relative step size and weight-decay factor (a float or a
            1-element Tensor).
        beta2_decay: exponent of the step in the second-moment decay rate, <= 0.
        eps: (epsilon1, epsilon2): the variance floor (None: the dtype's machine epsilon)
            and the smallest parameter scale.
        d: clipping threshold of the update's RMS.
        weight_decay: decoupled weight decay coefficient (multiplied by lr).
        foreach: ``True`` selects the foreach kernels.
        maximize: maximize the objective instead of minimizing it.

    Raises:
        ValueError: for a negative lr, epsilon or weight_decay, a positive beta2_decay or
            d < 1.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-2,
        beta2_decay: float = -0.8,
        eps: Tuple[Optional[float], float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        foreach: Optional[bool] = None,
        maximize: bool = False,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalAdafactor)
            params = check_params(params)
            check_dense_real_params(params, "Adafactor")
            check_types(FunctionalAdafactor, locals())
            check_lr(lr)
            check_at_most("beta2_decay", beta2_decay, 0.0)
            check_optional_eps_pair(eps)
            check_at_least("d", d, 1.0)
            check_at_least("weight_decay", weight_decay, 0.0)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.beta2_decay = float(beta2_decay)
        self.eps: Tuple[Optional[float], float] = (eps[0], float(eps[1]))
        self.d = float(d)
        self.weight_decay = float(weight_decay)
        self.foreach = optional_flag(foreach)
        self.maximize = bool(maximize)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.native = native_kernels(foreach, False, exact=False)
        self.operand_sets = no_operands()

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, beta2_decay, eps, d, weight_decay).

        Values are lists so that every class shares the signature. ``eps`` takes two values
        (epsilon1, epsilon2), or one value, epsilon2, which sets epsilon1 to None.
        """
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        if name == "lr":
            self.lr = new_lr(self.lr_tensor, value)
        elif name == "beta2_decay":
            self.beta2_decay = scalar(name, value)
        elif name == "eps":
            if len(value) == 1:
                self.eps = (None, value[0])
            elif len(value) == 2:
                self.eps = (value[0], value[1])
            else:
                raise ValueError(f"Invalid eps: {value} (expected one or two values)")
        elif name == "d":
            self.d = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        else:
            raise ValueError(
                unknown_hyperparameter(
                    "Adafactor", name, ["lr", "beta2_decay", "eps", "d", "weight_decay"]
                )
            )

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError (``checked_state``)."""
        fresh = {i: adafactor_state(p) for i, p in meta_params(self.params, state)}
        return checked_state(self.params, state, fresh)

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
        lr = lr_of(self.lr, self.lr_tensor)
        with torch.no_grad():
            adafactor_gather(self.operand_sets, self.params, self.state, self.groups, gradients)
            eps1 = self._epsilon1(gradients)
            for s in range(len(self.operand_sets)):
                adafactor_update(
                    self.operand_sets[s], lr, eps1, self.eps[1], self.beta2_decay, self.d,
                    self.weight_decay, self.maximize, s % 2 == 0, self.native,
                )
            release(self.operand_sets, self.groups)

    def _epsilon1(self, gradients: List[Optional[Tensor]]) -> float:
        # torch.optim resolves eps1=None once per step, from the first parameter it updates.
        eps1 = self.eps[0]
        if eps1 is not None:
            return eps1
        for i in range(len(gradients)):
            if gradients[i] is not None:
                return machine_epsilon(self.params[i].dtype)
        return 0.0
