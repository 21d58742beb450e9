"""distopt.parallel.hooks: distopt's compression and steps during backward under torch's DDP.

One gloo world of 2 ranks on 127.0.0.1 runs every scenario (starting a world costs more than
most checks): tests/parallel/hook_scenarios.py holds the rank side, which returns plain
data; the tests assert on it.
"""
import pytest
import torch

from tests.helpers import assert_identical, assert_named_error
from tests.parallel import trace_scenarios
from tests.parallel.cases import CASE_IDS
from tests.parallel.hook_scenarios import HOOK_EDITS, SAME_KERNELS, STEPS, hook_ranks
from tests.parallel.training import (
    COMPLEX_CASES,
    ZERO_GRAD_CASES,
    Branchy,
    ComplexModel,
    flat_params,
    make_model,
)

#: What every refusal of an edit in ``HOOK_EDITS`` must say.
HOOK_EDIT_ERRORS = {
    "appended": "Invalid param_groups[0]['params']: changed after construction (3 parameters, "
                "were 2; added params[2] (a parameter it was not built with)) (expected the "
                "parameters the OptimizerInBackward was built with",
    "moved-from-group-1": "Invalid param_groups[0]['params']: changed after construction (3 "
                          "parameters, were 2; added params[2] (params[0] of param_groups[1]))",
    "group-appended": "Invalid param_groups: 3 groups, were 2",
    "group-deleted": "Invalid param_groups: 1 groups, were 2",
    "key-deleted": "Invalid param_groups[1]: lacks 'betas'",
}


# ---------------------------------------------------------------- tests: compression


@pytest.fixture(scope="module")
def world(worlds):
    return worlds.run(hook_ranks, 2)


@pytest.fixture(scope="module")
def compressed(world):
    return [r["compression"] for r in world]


def test_cast_bf16_hook_equals_data_parallel_optimizer_and_the_exact_sum(compressed):
    assert compressed[0]["cast_rebuilds"] >= 1  # DDP rebuilt its buckets on the way
    for step in range(STEPS):
        # each rank's gradient halved in float32, cast, summed in bfloat16 (2 ranks)
        expected = sum((r["cast"]["local"][step] / 2).to(torch.bfloat16)
                       for r in compressed).float()
        for r in compressed:
            assert torch.equal(r["cast"]["hook"][step], expected), step
            assert torch.equal(r["cast"]["dpo"][step], expected), step


def test_powersgd_hook_equals_torchs_and_completes_with_several_buckets(compressed):
    for r in compressed:
        runs = r["powersgd"]
        assert torch.equal(runs["hook"]["params"], runs["torch"]["params"])
        assert runs["hook-buckets"]["buckets"] >= 2
        assert torch.equal(runs["hook-buckets"]["params"],
                           compressed[0]["powersgd"]["hook-buckets"]["params"])
        assert torch.isfinite(runs["hook-buckets"]["params"]).all()
    # compression moved the parameters off the uncompressed run's
    assert not torch.equal(compressed[0]["powersgd"]["hook"]["params"],
                           compressed[0]["plain"]["ddp"]["params"])


def test_no_compression_equals_ddp_bit_for_bit(compressed):
    for r in compressed:
        for name in ("hook", "hook_views"):  # gradient_as_bucket_view False and True
            assert torch.equal(r["plain"][name]["grads"], r["plain"]["ddp"]["grads"])
            assert torch.equal(r["plain"][name]["params"], r["plain"]["ddp"]["params"])
    assert torch.equal(compressed[0]["plain"]["hook"]["params"],
                       compressed[1]["plain"]["hook"]["params"])


@pytest.mark.parametrize("scheme", ["topk", "threshold"])
def test_error_feedback_through_the_bucket_rebuild(compressed, scheme):
    for r in compressed:
        result = r[scheme]
        assert result["rebuilds"] >= 1
        assert result["worst"] <= 1e-6 * result["scale"]  # residual + sent = gradient sum
        assert result["residual_norm"] > 0  # something was held back
        # CPU autograd runs backward on the thread that calls it: DDP calls the hook there
        assert result["issued_by_backward_caller"]
    # every rank's .grad is the average of what the ranks sent, added in rank order
    for step in range(6):
        for k in range(len(compressed[0][scheme]["sent"][step])):
            total = torch.zeros_like(compressed[0][scheme]["sent"][step][k])
            for r in compressed:
                total += r[scheme]["sent"][step][k]
            for r in compressed:
                assert torch.equal(r[scheme]["averaged"][step][k], total / 2), (step, k)


def test_track_usage_keeps_the_residual_of_unused_parameters(compressed):
    for r in compressed:
        assert r["unused_residual/True"][1:3] == [40.0, 40.0]
        assert r["unused_residual/True"][3] < 40.0  # used again: sent
        assert r["unused_residual/False"][1] < 40.0  # sent while unused, then lost


# ---------------------------------------------------------------- tests: optimizer


@pytest.fixture(scope="module")
def stepped(world):
    return [r["optimizer"] for r in world]


#: Classes whose compiled step equals single-tensor torch.optim (foreach=False) bit for bit
#: (measured on torch 2.13, CPU). The others differ by the kernel only (SAME_KERNELS): within
#: 3e-8 here, checked within rtol/atol 1e-5; ASGD's compiled step matches none of
#: torch.optim's kernels bit for bit (within 1e-8 here).
EXACT_WITH_SINGLE_TENSOR = {"SGD", "Adadelta", "Adamax", "RMSprop", "Rprop", "Adafactor", "Muon"}


@pytest.mark.parametrize("name", CASE_IDS)
def test_optimizer_hook_equals_ddp_with_torch_optim(stepped, name):
    first = stepped[0][name]
    assert first["rebuilds"] >= 1  # DDP rebuilt its buckets after the first step
    for r in stepped:
        assert torch.equal(r[name]["hook"], first["hook"])  # ranks agree
        assert torch.equal(r[name]["hook"], r[name]["dpo"])  # DataParallelOptimizer, bit for bit
    assert not torch.equal(first["hook"], flat_params(make_model(name != "Muon")))
    if name in EXACT_WITH_SINGLE_TENSOR:
        assert torch.equal(first["hook"], first["torch"])
    else:
        scale = float(first["torch"].abs().max())
        assert float((first["hook"] - first["torch"]).abs().max()) <= 1e-5 + 1e-5 * scale
    if name in SAME_KERNELS:
        assert torch.equal(first["hook"], first["torch_same_kernels"])


def test_lr_scheduler_and_lr_changes_apply_at_the_next_backward(stepped):
    runs = stepped[0]["schedule"]
    hook, dpo, ref = runs["hook"], runs["dpo"], runs["torch"]
    assert hook["warnings"] == []  # step() exists, so the scheduler does not complain
    assert hook["lrs"] == dpo["lrs"] == ref["lrs"] == [1e-2 * 0.5 ** STEPS, 0.0]
    for other in (dpo, ref):  # bit for bit
        assert torch.equal(hook["before"], other["before"])
        assert torch.equal(hook["after"], other["after"])
    n = hook["first_group"]
    assert not torch.equal(hook["after"][:n], hook["before"][:n])
    assert torch.equal(hook["after"][n:], hook["before"][n:])  # lr 0: the group stood still


def test_state_dict_moves_to_torch_optim_and_back(stepped):
    hook = stepped[0]["schedule"]["hook"]
    assert hook["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert hook["round_trip"]
    assert hook["bad_state"].startswith("ValueError:") and "exp_avg" in hook["bad_state"]
    assert "amsgrad" in hook["amsgrad"]
    for r in stepped:
        assert r["residual_shapes"] == dict(enumerate(r["param_shapes"]))


def test_rank_0_s_residuals_loaded_on_another_rank_warn_once(stepped):
    assert stepped[0]["residual_warnings"] == []  # its own
    warned = stepped[1]["residual_warnings"]
    assert len(warned) == 1, warned
    assert warned[0].startswith("OptimizerInBackward on rank 1 of 2: loaded the per-rank "
                                "residuals of rank 0 of 2 (state_dict['residuals'])")
    assert "expected each rank's own state_dict(), saved by every rank" in warned[0]


def test_parameters_no_rank_used_are_left_alone(stepped):
    for r in stepped:
        hook, ref = r["unused"]["hook"], r["unused"]["torch"]
        # steps 0, 2 and 4 use `extra` nowhere: it must not move then
        assert torch.equal(hook["extra"][0], flat_params(Branchy().extra))
        assert torch.equal(hook["extra"][2], hook["extra"][1])
        assert torch.equal(hook["extra"][4], hook["extra"][3])
        assert not torch.equal(hook["extra"][1], hook["extra"][0])
        assert torch.equal(hook["params"], ref["params"])  # DDP + fused torch.optim.Adam
    assert torch.equal(stepped[0]["unused"]["hook"]["params"],
                       stepped[1]["unused"]["hook"]["params"])


@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize("case", sorted(ZERO_GRAD_CASES))
def test_zero_grads_of_unused_parameters_step_as_torch_optim(stepped, case, views):
    """zero_grad(set_to_none=False), find_unused_parameters=True: a parameter no rank used
    steps with the zero .grad DDP leaves it, bit for bit as torch.optim (None: left alone)."""
    for r in stepped:
        runs = r["zero_grads"]
        torch_run = runs[f"{case}/{views}/torch"]
        assert_identical(runs[f"{case}/{views}/hook"], torch_run, f"{case}/{views}")
        steps = torch_run["steps"]
        for step in (2, 3):  # no rank used `extra`: its zero .grad moved it all the same
            assert not torch.equal(steps[step]["extra"], steps[step - 1]["extra"]), step
            assert steps[step]["same_grad"] and not steps[step]["grad"].any(), step
        assert steps[4]["grad"] is None and torch.equal(steps[4]["extra"], steps[3]["extra"])


@pytest.mark.parametrize("case", sorted(COMPLEX_CASES))
def test_complex_parameters_step_as_ddp_with_torch_optim(stepped, case):
    first = stepped[0]["complex"]
    for r in stepped:
        runs = r["complex"]
        assert torch.equal(runs[f"{case}/hook"], first[f"{case}/hook"])  # the ranks agree
        assert torch.equal(runs[f"{case}/none"], runs[f"{case}/torch"])  # DDP's reduction
        if case == "SGD":
            # torch.optim.SGD steps complex parameters in complex arithmetic, the compiled
            # step on their view_as_real (as torch.optim's other classes): the last bit
            scale = float(runs[f"{case}/torch"].abs().max())
            assert float((runs[f"{case}/hook"] - runs[f"{case}/torch"]).abs().max()) <= 1e-6 * scale
        else:
            assert torch.equal(runs[f"{case}/hook"], runs[f"{case}/torch"])
    assert not torch.equal(first[f"{case}/hook"], flat_params(ComplexModel()))


def test_compressions_for_real_gradients_refuse_complex_parameters(stepped):
    for r in stepped:
        message = r["complex_refused"]  # at construction, by the parameter's name
        assert message.startswith("ValueError: Invalid params: phase is complex "
                                  "(torch.complex128)"), message
        assert "Threshold" in message
        message = r["complex_refused_in_backward"]  # compression_hook knows no model
        assert "Invalid params: the parameter of shape" in message, message
        assert "is complex" in message and "TopK" in message


def test_a_failed_step_raises_from_backward(stepped):
    for rank, r in enumerate(stepped):
        message = r["step_failure"]
        assert message.startswith("RuntimeError:"), message
        assert f"on rank {rank} of 2" in message and "DDP bucket 0" in message, message
        assert "injected step failure" in message
        assert "Unable to cast" not in message  # a failed future, not a bad value, for DDP


def test_a_second_step_without_backward_is_refused(stepped):
    for r in stepped:
        message = r["second_step"]
        assert message.startswith("RuntimeError: Invalid step: no backward pass has"), message
        assert "torch.optim would step" in message
        assert r["second_step_unchanged"]
        assert r["step_after_zero_grad"] == "no error"


@pytest.mark.parametrize("edit", sorted(HOOK_EDITS))
def test_param_group_edits_are_refused_before_any_collective(stepped, edit):
    for r in stepped:
        result = r["edits"][edit]
        for call in ("backward", "step", "state_dict", "load_state_dict"):
            assert HOOK_EDIT_ERRORS[edit] in result[call], (call, result[call])
        assert result["unchanged"]


def test_a_profiler_trace_names_each_hook_buckets_reduction_and_step(world):
    for result in world:
        trace = result["trace"]
        assert trace["buckets"] >= 3
        ranges = trace["ranges"]
        names = [name for name, _, _, _ in ranges]
        for k in range(trace["buckets"]):
            for what in ("reduce", "reduce.wait", "step"):
                assert names.count(f"distopt.ddp.{what}[bucket {k}]") == trace_scenarios.STEPS, (what, k)

        def threads(name):
            return {thread for n, thread, _, _ in ranges if n == name}

        # Issued from DDP's hook on the thread running backward; waited for and stepped on
        # the hook's own thread.
        assert threads("distopt.ddp.reduce[bucket 0]") == threads("test.backward")
        (own,) = threads("distopt.ddp.step[bucket 0]")
        assert threads("distopt.ddp.reduce.wait[bucket 0]") == {own} != threads("test.backward")


def test_one_tensor_twice_is_refused_as_data_parallel_optimizer_refuses_it(stepped):
    message = stepped[0]["errors_duplicate"]
    assert message.startswith("ValueError: Invalid params: parameters 0 and 2 are the same "
                              "tensor (expected each parameter once"), message


EXPECTED_ERRORS = {
    "outsider": ("ValueError", "not one DDP reduces"),
    "frozen": ("ValueError", "requires_grad=False"),
    "sparse_adam": ("TypeError", "SparseAdam"),
    "lbfgs": ("TypeError", "LBFGS has no functional twin"),
    "subclass": ("TypeError", "MyAdam has no functional twin"),
    "not_ddp": ("TypeError", "ddp_model: Sequential"),
    "compression": ("TypeError", "compression: 'topk'"),
    "lr": ("ValueError", "learning rate: -1.0"),  # torch.optim's words
    "model_as_params": ("TypeError", "module (expected an iterable of Tensors or of param group "
                                     "dicts: pass model.parameters())"),
    "optimizer_instance": ("TypeError", "Invalid optimizer_class: an instance of SGD (expected "
                                        "the class: pass torch.optim.SGD, not an instance"),
}


@pytest.mark.parametrize("case", sorted(EXPECTED_ERRORS))
def test_bad_arguments_are_named(stepped, case):
    assert_named_error(stepped[0]["errors"][case], *EXPECTED_ERRORS[case])


def test_optimizer_in_backward_runs_torch_s_state_dict_hooks(stepped):
    for result in stepped:
        calls, note, keys, refusal = result["state_dict_hooks"]
        assert calls == ["pre", "post", "load_pre", "load_post"]
        assert note == "post" and keys == ["note", "param_groups", "state"]
        assert refusal.startswith("Invalid add_param_group: an OptimizerInBackward's groups "
                                  "are fixed at construction")
