"""Adagrad (per-coordinate step sizes from summed squared gradients), as torch.optim.Adagrad."""
import enum
import inspect
from typing import Dict, List, Optional, Union

import torch
from torch import Tensor

from functional._compile import ensure_scripted
from functional._validation import (
    check_at_least,
    check_flags,
    check_fused,
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
    optional_flag,
    scalar,
    unknown_hyperparameter,
    use_fused_kernel,
)
from functional._flat import device_dtype_groups
from functional._kernels import (
    GatherRules,
    add_sparse_,
    check_spec_state,
    copy_back,
    count_back,
    decayed,
    fit_fused_layouts,
    gather,
    increment_steps,
    new_state,
    no_operands,
    numbers,
    on_device,
    release,
    signed,
    step_values,
    scaled_route,
    ScaledRoute,
)
from functional._spec import Operand, StateSpec, scalar_places



def _torch_fuses_cuda() -> bool:
    """Whether torch.optim.Adagrad takes ``fused=True`` for CUDA parameters: torch 2.13 does,
    2.11 refuses them (its fused-device check is called with ``cuda_unsupported=True``)."""
    try:
        source = inspect.getsource(torch.optim.Adagrad)
    except (OSError, TypeError):
        return True
    return "cuda_unsupported=True" not in source


def _fused_anywhere(params: List[Tensor]) -> bool:
    """``fused_devices_ok`` where torch fuses Adagrad on every device it has a kernel for."""
    return True


def _fused_off_cuda(params: List[Tensor]) -> bool:
    """``fused_devices_ok`` where torch fuses Adagrad on the CPU only: no CUDA parameter."""
    for p in params:
        if p.device.type == "cuda":
            return False
    return True


#: Whether the fused kernel may step every one of a list of parameters, as torch.optim.Adagrad
#: of the installed torch would. Chosen at import, before anything is compiled (TorchScript
#: resolves the name then and takes no module-level bool).
fused_devices_ok = _fused_anywhere if _torch_fuses_cuda() else _fused_off_cuda

class AdagradOperand(enum.Enum):
    """Positions of ``FunctionalAdagrad``'s state in an operand set (``Operand``)."""

    STEP = 2
    SUM = 3


def adagrad_update(
    ops: List[List[Tensor]],
    fit: bool,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    fused: bool,
    grad_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
) -> None:
    """One Adagrad step over ``gather``'s operands ``[params, grads, steps, sums]``, on the
    fused kernel or on foreach ops. ``grad_scale`` and ``found_inf`` (a GradScaler's, fused
    only) go to the kernel, which divides the gradients by the one and skips the update
    where the other is 1."""
    params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
    steps, sums = ops[AdagradOperand.STEP.value], ops[AdagradOperand.SUM.value]
    if len(params) == 0:
        return
    if fused:
        staged = fit_fused_layouts(params, grads, sums) if fit else [params[:0], params[:0]]
        # The kernel reads the already-incremented step, as in torch.optim's fused path.
        increment_steps(steps)
        torch._fused_adagrad_(
            params, grads, sums, steps, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            eps=eps, maximize=maximize, grad_scale=on_device(grad_scale, params[0]),
            found_inf=on_device(found_inf, params[0]),
        )
        count_back(steps, found_inf)
        copy_back(staged)
        return
    grads = signed(grads, maximize)
    increment_steps(steps)
    grads = decayed(params, grads, weight_decay, lr, False)
    minus_clr = numbers([-lr / (1.0 + (t - 1.0) * lr_decay) for t in step_values(steps)])
    torch._foreach_addcmul_(sums, grads, grads, value=1.0)
    std = torch._foreach_sqrt(sums)
    torch._foreach_add_(std, eps)
    numerator = torch._foreach_mul(grads, minus_clr)
    torch._foreach_addcdiv_(params, numerator, std)


def adagrad_sparse_update(
    ops: List[List[Tensor]], lr: float, lr_decay: float, eps: float, maximize: bool
) -> None:
    """torch.optim's per-tensor rule, the only one that takes sparse gradients, for each of
    ``[params, grads, steps, sums]``: the update is non-linear, so repeated indices are
    summed (coalesced) first. (``step`` refuses weight decay with sparse gradients.)"""
    params, grads = ops[Operand.PARAMS.value], ops[Operand.GRADS.value]
    steps, sums = ops[AdagradOperand.STEP.value], ops[AdagradOperand.SUM.value]
    for j in range(len(params)):
        param, grad, step_t, state_sum = params[j], grads[j], steps[j], sums[j]
        step_t.add_(1.0)
        if maximize:
            grad = -grad
        clr = lr / (1.0 + (float(step_t.item()) - 1.0) * lr_decay)
        grad = grad.coalesce()
        indices = grad._indices()
        values = grad._values()
        add_sparse_(state_sum, torch.sparse_coo_tensor(indices, values.pow(2), grad.size()))
        std = state_sum.sparse_mask(grad)
        std_values = std._values().sqrt_().add_(eps)
        add_sparse_(param, torch.sparse_coo_tensor(indices, values / std_values, grad.size()), -clr)


class FunctionalAdagrad:
    r"""Adagrad with learning-rate decay and weight decay, taking gradients as a list.

    Same arguments, defaults, state (``step``, ``sum``) and results as
    :class:`torch.optim.Adagrad`. As there, every parameter's state exists from construction,
    ``sum`` starting at ``initial_accumulator_value``. With gradient :math:`g_t`, weight decay
    :math:`\lambda`, learning-rate decay :math:`\eta` and learning rate :math:`\gamma`:

    .. math::
        g_t &\leftarrow g_t + \lambda \theta_{t-1} \\
        \tilde\gamma_t &= \gamma / (1 + (t - 1) \eta) \\
        s_t &= s_{t-1} + g_t^2 \\
        \theta_t &= \theta_{t-1} - \tilde\gamma_t \, g_t / (\sqrt{s_t} + \epsilon)

    Dense gradients run on ``torch._fused_adagrad_`` (``fused=False`` or ``foreach=True``
    selects the foreach kernels); sparse gradients take the per-tensor path, as torch.optim
    does, and only the rows they hold change.

    Args:
        params: the parameters to update (any iterable of Tensors, e.g.
            ``model.parameters()``), in the order gradients will be given.
        lr: learning rate (a float or a 1-element Tensor).
        lr_decay: learning-rate decay per step.
        weight_decay: L2 penalty (not allowed with sparse gradients).
        initial_accumulator_value: starting value of every ``sum`` element.
        eps: term added to the denominator for numerical stability.
        foreach: ``True`` selects the foreach kernels.
        maximize: maximize the objective instead of minimizing it.
        differentiable: accepted for compatibility; steps never record autograd history.
        fused: ``False`` selects the foreach kernels; otherwise the fused kernel is used.

    Raises:
        ValueError: for a negative lr, lr_decay, weight_decay, initial_accumulator_value or
            eps.
        RuntimeError: for ``foreach=True`` with ``fused=True``, or ``fused=True`` with
            ``differentiable=True`` or non-floating-point parameters; at a step, for a sparse
            gradient with weight decay.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: Union[float, Tensor] = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
    ) -> None:
        if not torch.jit.is_scripting():
            ensure_scripted(FunctionalAdagrad)
            params = check_params(params)
            check_types(FunctionalAdagrad, locals())
            check_lr(lr)
            check_at_least("lr_decay", lr_decay, 0.0)
            check_at_least("weight_decay", weight_decay, 0.0)
            check_at_least("initial_accumulator_value", initial_accumulator_value, 0.0)
            check_at_least("eps", eps, 0.0)
            check_fused(params, fused, differentiable)
            if fused and not fused_devices_ok(params):
                raise RuntimeError(
                    f"Invalid fused: True with CUDA parameters (torch {torch.__version__}'s "
                    f"Adagrad runs fused on the CPU only; expected fused=None or False)"
                )
            check_flags(foreach, fused)
        self.params = params
        self.lr = lr_float(lr)
        self.lr_tensor = lr_tensor(lr)
        self.lr_decay = float(lr_decay)
        self.weight_decay = float(weight_decay)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.eps = float(eps)
        self.foreach = optional_flag(foreach)
        self.maximize = bool(maximize)  # the fused kernel takes no int or None
        self.differentiable = bool(differentiable)
        self.fused = optional_flag(fused)
        self.use_fused = use_fused_kernel(foreach, fused) and fused_devices_ok(params)
        self.state = torch.jit.annotate(Dict[int, Dict[str, Tensor]], {})
        self.groups = device_dtype_groups(params)
        self.operand_sets = no_operands()
        self.places = scalar_places(["step", "sum"], ["step"], self.use_fused)
        # torch.optim.Adagrad creates every parameter's state in its constructor.
        spec = self._spec()
        for i in range(len(params)):
            self.state[i] = new_state(params[i], spec)

    def set_hyperparameter(self, name: str, value: List[float]) -> None:
        """Change a hyper-parameter between steps (lr, lr_decay, weight_decay, eps,
        initial_accumulator_value: the start of state made from now on, so that a torch.optim
        state_dict saved with another value loads, as torch.optim loads it).

        Values are lists so that every class shares the signature (pairs take two).
        """
        if not torch.jit.is_scripting():  # 1e-4 for [1e-4]; compiled, a list only
            value = hyperparameter_argument(name, value)
        if name == "lr":
            self.lr = new_lr(self.lr_tensor, value)
        elif name == "lr_decay":
            self.lr_decay = scalar(name, value)
        elif name == "weight_decay":
            self.weight_decay = scalar(name, value)
        elif name == "eps":
            self.eps = scalar(name, value)
        elif name == "initial_accumulator_value":
            self.initial_accumulator_value = scalar(name, value)
        else:
            raise ValueError(
                unknown_hyperparameter(
                    "Adagrad", name,
                    ["lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value"],
                )
            )

    def check_state(self, state: Dict[int, Dict[str, Tensor]]) -> Dict[int, Dict[str, Tensor]]:
        """``state`` as ``set_state`` would keep it, or ValueError (``checked_state``)."""
        return check_spec_state(self.params, state, self._spec())

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
            RuntimeError: for a sparse gradient while weight_decay is not 0.
        """
        self._update(gradients, None, None)

    def step_scaled(
        self,
        gradients: List[Optional[Tensor]],
        grad_scale: Optional[Tensor],
        found_inf: Optional[Tensor],
    ) -> None:
        """``step`` under a ``GradScaler``, as torch.optim.Adagrad steps with the scaler's
        ``grad_scale`` (None once ``scaler.unscale_`` ran) and ``found_inf``: on the fused
        kernel, which divides the gradients by the scale and changes nothing where
        ``found_inf`` is not 0, the step counted back; on the foreach kernels (or with a
        sparse gradient) as torch.optim's foreach Adagrad under ``GradScaler.unscale_``: the
        gradients divided in place, and no step at all after an inf or NaN
        (``unscale_gradients``)."""
        fused = self.use_fused
        for g in gradients:
            if g is not None and g.is_sparse:
                fused = False
        route = scaled_route(gradients, grad_scale, found_inf, fused)
        if route == ScaledRoute.PLAIN:
            self._update(gradients, None, None)
        elif route == ScaledRoute.FUSED:
            self._update(gradients, grad_scale, found_inf)

    def _update(
        self,
        gradients: List[Optional[Tensor]],
        grad_scale: Optional[Tensor],
        found_inf: Optional[Tensor],
    ) -> None:
        lr = lr_of(self.lr, self.lr_tensor)
        with torch.no_grad():
            rules = GatherRules(self._spec(), "both", "", self.use_fused)
            fits = gather(self.operand_sets, self.params, self.state, self.groups, gradients, rules)
            sparse_ops = self.operand_sets[len(fits) - 1]
            if self.weight_decay != 0.0 and len(sparse_ops[Operand.PARAMS.value]) > 0:
                release(self.operand_sets, self.groups)  # before any parameter changes (torch.optim's message)
                raise RuntimeError("weight_decay option is not compatible with sparse gradients")
            for s in range(len(fits) - 1):
                adagrad_update(
                    self.operand_sets[s], fits[s], lr, self.lr_decay, self.weight_decay, self.eps,
                    self.maximize, self.use_fused, grad_scale, found_inf,
                )
            adagrad_sparse_update(sparse_ops, lr, self.lr_decay, self.eps, self.maximize)
            release(self.operand_sets, self.groups)

    def fills(self) -> List[float]:
        """``new_state``'s values: ``sum`` starts at ``initial_accumulator_value``."""
        return [0.0, self.initial_accumulator_value]

    def _spec(self) -> StateSpec:
        """The state made from now on (``new_state``): ``fills``, read at each use (they
        follow ``set_hyperparameter``), placed by ``places``."""
        return StateSpec(["step", "sum"], self.fills(), self.places)
