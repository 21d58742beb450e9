r"""Scheduling the hyper-parameters that torch's learning-rate schedulers leave alone.

``torch.optim.lr_scheduler`` moves ``lr`` (and, in OneCycleLR and CyclicLR, momentum or
beta1 with it). :class:`HyperparameterScheduler` moves any other numeric key of the param
groups (``momentum``, ``weight_decay``, ``eps``, one element of ``betas``, ...) by a factor
of its initial value, as :class:`torch.optim.lr_scheduler.LambdaLR` does for ``lr``:

.. math::
    v_{g,t} = v_{g,0} \cdot f_g(t)

It reads and writes only ``optimizer.param_groups``, so it works on every
``torch.optim.Optimizer`` that keeps torch.optim's param groups: the torch.optim classes,
and ``distopt.DistributedOptimizer``, whose owners receive the changed values with the next
step's RPC. A value the optimizer's class would refuse in its constructor is refused before
it is written (``distopt.arguments.probe_construction``).
"""
import inspect
import logging
import math
import numbers
import re
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor

from distopt.arguments import constructor_keywords, probe_construction
from functional import functional_optim_map

logger = logging.getLogger(__name__)

__all__ = ["HyperparameterScheduler"]

_Factor = Callable[[int], float]


class HyperparameterScheduler:
    r"""Set ``param_groups[g][key]`` to its initial value times ``fn(epoch)`` at each step.

    .. math::
        v_{g,t} = v_{g,0} \cdot f_g(t)

    where :math:`v_{g,0}` is the group's value when the scheduler was built, kept in the
    group as ``f"initial_{key}"`` (as torch's schedulers keep ``initial_lr``; a value already
    there is reused, so a second scheduler, or one built after loading an optimizer
    state_dict, starts from the same value). Construction applies epoch ``last_epoch + 1``
    (epoch 0 by default), as :class:`torch.optim.lr_scheduler.LambdaLR` does.

    A tuple-valued key (``betas``) has one element scheduled, picked by ``index``; the others
    are kept. A tensor value (torch.optim accepts tensor ``momentum``, ``weight_decay``,
    ``eps`` and ``betas``) stays the same tensor, filled in place as torch's schedulers fill a
    tensor ``lr``; tensors that torch.optim's defaults share between several groups are first
    given one copy per group, so that each group's factor reaches only that group.

    Every new value is first checked by the optimizer's class itself (``optimizer_class``
    of distopt's optimizers, else ``type(optimizer)``): the class is built over a 1 x 1
    probe tensor with the group's values and the new one (about 7 µs per group and step for
    a torch.optim class), so the ranges are exactly its constructor's: ``0 <= betas[i] < 1``
    for Adam, ``rho`` in [0, 1] for Adadelta, ``etas`` with ``0 < etas[0] < 1 < etas[1]`` for
    Rprop, ``eps``, ``weight_decay`` and ``lr_decay`` >= 0, ``momentum`` > 0 under
    Nesterov, and so on. Where the constructor sets no bound the scheduler sets none either
    (``torch.optim.SGD`` takes ``momentum=1.8``). For a class of the user's, registered or
    eager, the range is whatever its constructor refuses; a class whose constructor refuses
    the group's present values too (or does not take ``(params, **hyper-parameters)``) is
    not checked.

    Args:
        optimizer: any ``torch.optim.Optimizer`` with torch.optim's ``param_groups``.
        key: the hyper-parameter to schedule; every param group must hold it, as a number, a
            one-element floating-point tensor, or a tuple or list of them. Not ``"lr"``: use
            ``torch.optim.lr_scheduler``.
        fn: a function of the epoch (an int) returning the factor, a finite real number; or a
            list of them, one per param group.
        index: the element of a tuple-valued key to schedule (``0`` for beta1 of ``betas``);
            required for a tuple, ``None`` for a scalar.
        last_epoch: the last epoch applied; ``-1`` starts a new schedule. A value >= 0
            resumes one and needs ``f"initial_{key}"`` in every group.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, ``key`` is not a
            string, ``fn`` is not callable (or holds something that is not), ``index`` or
            ``last_epoch`` is not an int, or ``fn`` returns something that is not a real
            number at epoch ``last_epoch + 1``.
        ValueError: ``key`` is ``"lr"`` or ``"params"``, missing from a group or not numeric
            there; ``fn`` is a list of the wrong length; ``index`` is out of range, given for
            a scalar or missing for a tuple; a stored ``initial_{key}`` is of another kind
            than the value; ``last_epoch`` is below -1, or >= 0 without initial values; a
            factor is not finite; a new value is one the optimizer's class refuses (``Invalid
            betas[0] for param_groups[0]: 1.08 from HyperparameterScheduler (expected in
            [0, 1), as torch.optim.Adam requires)``). Nothing in the param groups has
            changed then.

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> momentum = HyperparameterScheduler(opt, "momentum", lambda e: min(1.0, 0.5 + e / 20))
        >>> for epoch in range(epochs):
        ...     train(opt)
        ...     momentum.step()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        key: str,
        fn: Union[_Factor, Sequence[_Factor]],
        index: Optional[int] = None,
        last_epoch: int = -1,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"Invalid optimizer: {type(optimizer).__name__} (expected a "
                f"torch.optim.Optimizer)"
            )
        groups = optimizer.param_groups
        _check_key(key, groups)
        fns = _check_fns(fn, len(groups))
        _check_index(index, key, groups)
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, int):
            raise TypeError(
                f"Invalid last_epoch: {last_epoch!r} (expected an int, -1 for a new schedule)"
            )
        if last_epoch < -1:
            raise ValueError(f"Invalid last_epoch: {last_epoch!r} (expected >= -1)")
        initial_key = f"initial_{key}"
        initials = []
        for g, group in enumerate(groups):
            if initial_key in group:
                _check_initial(group[initial_key], group[key], initial_key, g)
                initials.append(group[initial_key])
            elif last_epoch >= 0:
                raise ValueError(
                    f"Invalid last_epoch: {last_epoch!r} (expected -1: param_groups[{g}] "
                    f"holds no {initial_key!r} to resume from)"
                )
            else:
                initials.append(_copy(group[key]))

        self.optimizer = optimizer
        self.key = key
        self.index = index
        self.fns: List[_Factor] = fns
        self.base_values: List[Any] = [_copy(_element(v, index)) for v in initials]
        self.last_epoch = last_epoch + 1
        new = self._values_at(self.last_epoch)  # raises before anything is written
        for group, initial in zip(groups, initials):
            group.setdefault(initial_key, initial)
        _unshare_tensors(groups, key)
        self._write(new)

    def step(self) -> None:
        """Advance one epoch and write every group's new value.

        Raises:
            TypeError, ValueError: a factor is not a finite real number, a new value is one
                the optimizer's class refuses, or the optimizer's number of param groups
                changed; no group is changed then.
        """
        new = self._values_at(self.last_epoch + 1)
        self.last_epoch += 1
        self._write(new)

    def get_last_value(self) -> List[Any]:
        """The value each group's scheduled key (or its ``index`` element) was last set to.

        Returns:
            One number (a copy of the tensor, for a tensor value) per param group.
        """
        return list(self._last_value)

    def state_dict(self) -> Dict[str, Any]:
        """The scheduler's state: every attribute but the optimizer, for ``torch.save``.

        As in ``LambdaLR``, ``fns`` are not saved, except the ``__dict__`` of those that are
        callable objects rather than functions or lambdas (``None`` for the others). Save and
        load the optimizer's state_dict too: it holds the current values and the
        ``initial_{key}`` entries.

        Returns:
            A new dict.
        """
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "fns")}
        state["fns"] = [
            None if isinstance(f, types.FunctionType) else dict(f.__dict__) for f in self.fns
        ]
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Adopt a state from :meth:`state_dict`; the param groups are not changed.

        Args:
            state_dict: a scheduler state over the same key, index and number of groups.

        Raises:
            ValueError: ``state_dict`` schedules another key or index, or another number of
                groups; nothing is changed then.
        """
        for name in ("key", "index"):
            if state_dict.get(name) != getattr(self, name):
                raise ValueError(
                    f"Invalid state_dict[{name!r}]: {state_dict.get(name)!r} (expected "
                    f"{getattr(self, name)!r}, this scheduler's)"
                )
        saved_fns = state_dict.get("fns", [None] * len(self.fns))
        if len(saved_fns) != len(self.fns):
            raise ValueError(
                f"Invalid state_dict['fns']: {len(saved_fns)} entries (expected "
                f"{len(self.fns)}, one per param group)"
            )
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "fns"})
        for f, saved in zip(self.fns, saved_fns):
            if saved is not None:
                f.__dict__.update(saved)

    # ------------------------------------------------------------ internals

    def _values_at(self, epoch: int) -> List[Any]:
        groups = self.optimizer.param_groups
        if len(groups) != len(self.fns):
            raise ValueError(
                f"Invalid optimizer.param_groups: {len(groups)} groups (expected "
                f"{len(self.fns)}, as when the {self.key!r} scheduler was built)"
            )
        values = []
        for g, (f, base) in enumerate(zip(self.fns, self.base_values)):
            factor = f(epoch)
            if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
                raise TypeError(
                    f"Invalid fn[{g}]({epoch}): {factor!r} (expected a finite real number, "
                    f"the factor of the initial {self.key})"
                )
            if not math.isfinite(factor):
                raise ValueError(
                    f"Invalid fn[{g}]({epoch}): {factor!r} (expected a finite real number, "
                    f"the factor of the initial {self.key})"
                )
            if type(factor) not in (int, float):
                factor = float(factor)  # numpy scalars: write plain Python numbers
            values.append(base * factor)
        self._check_accepted(values)
        return values

    def _check_accepted(self, values: List[Any]) -> None:
        """Each group's new value must be one the optimizer's class takes with the group's
        other values: its constructor, run over a probe tensor, decides.

        Raises:
            ValueError: naming the key, the group, the value and the range.
        """
        cls = _optimizer_class(self.optimizer)
        keywords = constructor_keywords(cls)
        if self.key not in keywords:
            return
        for g, (group, value) in enumerate(zip(self.optimizer.param_groups, values)):
            kwargs = {k: group[k] for k in keywords if k in group}
            current = kwargs[self.key]
            kwargs[self.key] = _replaced(current, self.index, value)
            refusal = _refusal(cls, kwargs)
            if refusal is None:
                continue
            if _refusal(cls, {**kwargs, self.key: current}) is not None:
                logger.debug("%s refuses param_groups[%d] as it is: %s unchecked", cls, g, self.key)
                continue
            name = self.key if self.index is None else f"{self.key}[{self.index}]"
            shown = float(value) if isinstance(value, Tensor) else value
            raise ValueError(
                f"Invalid {name} for param_groups[{g}]: {shown!r} from HyperparameterScheduler "
                f"(expected {_expected_range(cls, kwargs, refusal)})"
            )

    def _write(self, values: List[Any]) -> None:
        for group, value in zip(self.optimizer.param_groups, values):
            current = group[self.key]
            group[self.key] = _replaced(
                current, self.index, _assign(_element(current, self.index), value)
            )
        self._last_value = [
            _copy(_element(group[self.key], self.index)) for group in self.optimizer.param_groups
        ]


def _is_scalar(value: Any) -> bool:
    """A number or a one-element floating-point tensor: what a factor can scale."""
    if isinstance(value, Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_tuple(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(_is_scalar(v) for v in value)


def _check_key(key: Any, groups: List[Dict[str, Any]]) -> None:
    if not isinstance(key, str):
        raise TypeError(f"Invalid key: {key!r} (expected a str, a param group key)")
    if key == "lr":
        raise ValueError(
            "Invalid key: 'lr' (expected another hyper-parameter: schedule the learning rate "
            "with torch.optim.lr_scheduler)"
        )
    if key == "params":
        raise ValueError("Invalid key: 'params' (expected a hyper-parameter, not the parameters)")
    for g, group in enumerate(groups):
        if key not in group:
            keys = sorted(k for k in group if k != "params")
            raise ValueError(
                f"Invalid key: {key!r} (expected a key of every param group; "
                f"param_groups[{g}] has {keys!r})"
            )
        value = group[key]
        if not (_is_scalar(value) or _is_tuple(value)):
            raise ValueError(
                f"Invalid key: {key!r} (expected a numeric hyper-parameter: a number, a "
                f"one-element floating-point tensor or a tuple of them; param_groups[{g}] "
                f"holds {value!r})"
            )


def _check_fns(fn: Any, num_groups: int) -> List[_Factor]:
    if isinstance(fn, (list, tuple)):
        if len(fn) != num_groups:
            raise ValueError(
                f"Invalid fn: a list of {len(fn)} (expected {num_groups}, one per param group)"
            )
        for g, f in enumerate(fn):
            if not callable(f):
                raise TypeError(f"Invalid fn[{g}]: {f!r} (expected a callable epoch -> factor)")
        return list(fn)
    if not callable(fn):
        raise TypeError(
            f"Invalid fn: {fn!r} (expected a callable epoch -> factor, or a list of them, one "
            f"per param group)"
        )
    return [fn] * num_groups


def _check_index(index: Any, key: str, groups: List[Dict[str, Any]]) -> None:
    if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
        raise TypeError(f"Invalid index: {index!r} (expected an int or None)")
    for g, group in enumerate(groups):
        value = group[key]
        if _is_scalar(value):
            if index is not None:
                raise ValueError(
                    f"Invalid index: {index!r} (expected None: param_groups[{g}][{key!r}] is "
                    f"{value!r}, not a tuple)"
                )
        elif index is None:
            raise ValueError(
                f"Invalid index: None (expected the element of param_groups[{g}][{key!r}] = "
                f"{value!r} to schedule, 0 to {len(value) - 1})"
            )
        elif not 0 <= index < len(value):
            raise ValueError(
                f"Invalid index: {index!r} (expected 0 to {len(value) - 1}: "
                f"param_groups[{g}][{key!r}] is {value!r})"
            )


def _check_initial(initial: Any, current: Any, name: str, g: int) -> None:
    """A stored initial value must have the shape of the value it is the start of."""
    if _is_scalar(current):
        ok = _is_scalar(initial)
    else:
        ok = _is_tuple(initial) and len(initial) == len(current)
    if not ok:
        raise ValueError(
            f"Invalid param_groups[{g}][{name!r}]: {initial!r} (expected the initial value "
            f"of {current!r}, of the same kind)"
        )


def _element(value: Any, index: Optional[int]) -> Any:
    return value if index is None else value[index]


def _replaced(current: Any, index: Optional[int], value: Any) -> Any:
    """``current`` with its scheduled element ``value``: ``value`` itself for a scalar, a new
    tuple (or list) for a tuple-valued key."""
    if index is None:
        return value
    items = list(current)
    items[index] = value
    return tuple(items) if isinstance(current, tuple) else items


def _optimizer_class(optimizer: torch.optim.Optimizer) -> type:
    """The class whose constructor rules the values: distopt's optimizers name the class
    they step (``optimizer_class``); a torch.optim optimizer is its own."""
    cls = getattr(optimizer, "optimizer_class", None)
    return cls if inspect.isclass(cls) else type(optimizer)


def _refusal(cls: Any, kwargs: Dict[str, Any]) -> Optional[Exception]:
    """What ``cls``'s constructor raises for ``kwargs`` over a probe tensor; None if nothing."""
    try:
        probe_construction(cls, kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        return exc
    return None


def _expected_range(cls: type, kwargs: Dict[str, Any], refusal: Exception) -> str:
    """The range ``cls`` requires, in words: torch.optim's messages name no range, so it is
    taken from the functional twin's refusal of the same values (``(expected in [0, 1))``)
    where it has one that refuses them too; otherwise ``cls``'s own message."""
    name = _class_name(cls)
    twin = functional_optim_map.get(cls)
    if twin is not None:
        keywords = constructor_keywords(twin)
        said = _refusal(twin, {k: v for k, v in kwargs.items() if k in keywords})
        found = re.search(r"\(expected (.*)\)$", str(said)) if said is not None else None
        if found:
            return f"{found.group(1)}, as {name} requires"
    return f"a value {name} accepts; it raises {type(refusal).__name__}: {refusal}"


def _class_name(cls: type) -> str:
    return f"torch.optim.{cls.__name__}" if getattr(torch.optim, cls.__name__, None) is cls else (
        cls.__qualname__
    )


def _copy(value: Any) -> Any:
    """A copy that later in-place fills cannot reach."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _assign(current: Any, value: Any) -> Any:
    """``value`` in the form of ``current``: a tensor filled in place, or the number."""
    if isinstance(current, Tensor):
        with torch.no_grad():  # a differentiable optimizer's tensors may require grad
            current.fill_(value.reshape(()) if isinstance(value, Tensor) else value)
        return current
    return float(value) if isinstance(value, Tensor) else value


def _unshare_tensors(groups: List[Dict[str, Any]], key: str) -> None:
    """Give each group its own copy of a tensor value that an earlier group holds too."""
    seen = set()
    for group in groups:
        value = group[key]
        items = list(value) if isinstance(value, (tuple, list)) else [value]
        copied = False
        for i, item in enumerate(items):
            if isinstance(item, Tensor):
                if id(item) in seen:
                    items[i] = item.detach().clone()
                    copied = True
                seen.add(id(items[i]))
        if copied:
            if isinstance(value, tuple):
                group[key] = tuple(items)
            elif isinstance(value, list):
                group[key] = items
            else:
                group[key] = items[0]
