"""Models shaped like users' train under DataParallelOptimizer exactly as under DDP +
torch.optim: a transformer language model with tied embeddings and dropout, the same under
activation checkpointing, bf16 autocast, a frozen sub-module and torch.compile; bit for bit
after every step, with overlap, without, and with sharded state. (A CNN with BatchNorm is
in test_features.py's buffer tests: its running statistics need ``module=``.)"""
import pytest
import torch

from tests.parallel import model_scenarios as scenarios


@pytest.fixture(scope="module")
def trained(worlds):
    return worlds.run(scenarios.users_models, 2)


@pytest.mark.parametrize("run", list(scenarios.RUNS))
@pytest.mark.parametrize("case", list(scenarios.CASES))
def test_users_models_step_as_under_ddp(trained, case, run):
    for rank in range(2):
        ddp = trained[rank][f"{case}/ddp"]
        mine = trained[rank][f"{case}/{run}"]
        for step, (a, b) in enumerate(zip(mine, ddp)):
            assert torch.equal(a, b), (
                f"rank {rank}, step {step}: {(a - b).abs().max().item():.3g} from DDP"
            )
    assert torch.equal(trained[0][f"{case}/{run}"][-1], trained[1][f"{case}/{run}"][-1])
    first, last = trained[0][f"{case}/ddp"][0], trained[0][f"{case}/ddp"][-1]
    assert not torch.equal(first, last), "the model did not train"
