"""The rank side of tests/parallel/test_state_dict.py: every state_dict of the shared table
(tests/refused_state_dicts.py) offered to DataParallelOptimizer (unsharded, ``shard="param"``,
``shard="flat"``) and to OptimizerInBackward after two steps; what each load raised, and the
whole state_dict just before and just after it."""
from typing import Any, Dict

import torch
from torch.nn.parallel import DistributedDataParallel

from distopt.parallel import DataParallelOptimizer, OptimizerInBackward
from tests.helpers import error_of
from tests.parallel.training import SMALL_BUCKETS_MB, whole_state_dict
from tests.refused_state_dicts import OPTIMIZERS, REFUSED, bad_state_dict

#: The optimizers: DataParallelOptimizer's shard modes, OptimizerInBackward, and
#: DataParallelOptimizer over a class with no compiled twin (it steps eagerly).
KINDS = ("None", "param", "flat", "in_backward", "eager")
#: The rows an eager class refuses too: torch.optim itself checks nothing of an entry's
#: keys, dtypes or shapes (and its options may change), so those rows load there as they
#: load into torch.optim.
EAGER_ROWS = ("another-class", "later-group-lacks-lr", "group-count", "parameter-count",
              "shape", "unknown-parameter", "no-state", "step-as-text")
#: The table's four parameters in the order of their global indices (group 0: the first two).
SHAPES = ((5, 3), (6, 3), (4, 2), (3, 2))


class FourParameters(torch.nn.Module):
    """The table's parameters, each in one term of the output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES])

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return sum(((w * scale).tanh() ** 2).sum() for w in self.weights)


def runs_of(optimizer: str, name: str) -> tuple:
    """The kinds that refuse row ``name`` of ``optimizer``: ``shard="flat"`` refuses
    Adafactor at construction (its factored state cannot be cut inside a parameter); an
    eager class, the ``EAGER_ROWS``."""
    return tuple(k for k in KINDS if not (k == "flat" and optimizer == "Adafactor")
                 and (k != "eager" or name in EAGER_ROWS))


def _trained(kind: str, optimizer: str, rank: int) -> Any:
    """An optimizer of ``kind`` over ``FourParameters``, ``OPTIMIZERS[optimizer]``'s
    options, two steps taken on this rank's inputs."""
    cls, defaults, options0, options1 = OPTIMIZERS[optimizer]
    model = FourParameters()
    weights = list(model.weights)
    groups = [{"params": weights[:2], **options0}, {"params": weights[2:], **options1}]
    if kind == "in_backward":
        forward = DistributedDataParallel(model)
        opt = OptimizerInBackward(forward, cls, groups, **defaults)
    elif kind == "eager":
        forward = model
        # A subclass has no functional twin; named as its base, the messages read alike.
        eager_cls = type(cls.__name__, (cls,), {})
        opt = DataParallelOptimizer(eager_cls, groups, bucket_cap_mb=SMALL_BUCKETS_MB,
                                    **defaults)
    else:
        forward = model
        opt = DataParallelOptimizer(cls, groups, bucket_cap_mb=SMALL_BUCKETS_MB,
                                    shard=None if kind == "None" else kind, **defaults)
    for step in range(2):
        forward(torch.tensor(0.5 + step + rank)).backward()
        opt.step()
        opt.zero_grad()
    return opt


def refusals(rank: int, world_size: int) -> Dict[str, Any]:
    """``"<kind>/<row>"`` -> what loading the row's state_dict raised (``error_of``), and the
    whole state_dict before and after it."""
    out: Dict[str, Any] = {}
    for optimizer in OPTIMIZERS:
        for kind in KINDS:
            names = [name for name, row in REFUSED.items()
                     if row.optimizer == optimizer and kind in runs_of(optimizer, name)]
            if not names:
                continue
            opt = _trained(kind, optimizer, rank)
            for name in names:
                before = whole_state_dict(opt)
                bad = bad_state_dict(before, name)
                error = error_of(lambda: opt.load_state_dict(bad))
                out[f"{kind}/{name}"] = {"error": error, "before": before,
                                         "after": whole_state_dict(opt)}
            if kind != "in_backward":
                opt.close()
    return out
