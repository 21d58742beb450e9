"""The refusal table every optimizer shares (tests/refused_state_dicts.py), run over
DataParallelOptimizer (unsharded, ``shard="param"``, ``shard="flat"``, an eager class) and
OptimizerInBackward at 2 gloo ranks: each bad state_dict is refused on every rank with a ValueError naming what is
wrong, and every state tensor and param_group value is as it was, the earlier group included
(a load refused for group 1 once replaced group 0's state first: issue 38)."""
import re

import pytest

from tests.helpers import assert_identical
from tests.parallel import state_dict_scenarios as scenarios
from tests.refused_state_dicts import REFUSED


@pytest.fixture(scope="module")
def refused(worlds):
    return worlds.run(scenarios.refusals, 2)


def _rows(kinds):
    return [(kind, name) for name, row in sorted(REFUSED.items())
            for kind in scenarios.runs_of(row.optimizer, name) if kind in kinds]


def _check(refused, kind, name):
    """Refused with a ValueError on every rank, nothing changed, the message naming what is
    wrong."""
    for rank, out in enumerate(refused):
        result = out[f"{kind}/{name}"]
        message = result["error"]
        assert message.startswith("ValueError: "), (rank, message)
        assert_identical(result["after"], result["before"], f"rank {rank}, after the refusal")
        assert re.search(REFUSED[name].pattern, message), (rank, message)


@pytest.mark.parametrize("shard, name", _rows(("None", "param", "flat")))
def test_data_parallel_optimizer_refuses_each_bad_state_dict_and_changes_nothing(
        refused, shard, name):
    _check(refused, shard, name)


@pytest.mark.parametrize("name", [name for _, name in _rows(("in_backward",))])
def test_optimizer_in_backward_refuses_each_bad_state_dict_and_changes_nothing(refused, name):
    _check(refused, "in_backward", name)


@pytest.mark.parametrize("name", [name for _, name in _rows(("eager",))])
def test_an_eager_class_refuses_what_it_can_check_and_changes_nothing(refused, name):
    """A class with no compiled twin steps eagerly: the checks torch.optim lacks (a step
    count that is text left its state half-replaced before) refuse the same rows."""
    _check(refused, "eager", name)
