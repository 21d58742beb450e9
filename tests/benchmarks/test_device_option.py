"""The benchmarks' ``--device cuda`` path, checked on the CPU: the option's refusal where torch
has no GPU, and the functional benchmark's GPU arrangement (its cases shrunk, its warm-up
rounds) run on the CPU. Nothing here times anything or needs a GPU."""
import argparse
import importlib.util
import os

import pytest
import torch

from benchmarks import _rpc_world
from benchmarks._machine import add_device_argument, check_device, device_clock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _functional_benchmark():
    """``benchmarks/functional.py`` as a module (its name is the package it measures)."""
    path = os.path.join(ROOT, "benchmarks", "functional.py")
    spec = importlib.util.spec_from_file_location("benchmarks_functional_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_cuda_refused_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    check_device(parser, parser.parse_args([]).device)  # cpu, the default: accepted
    with pytest.raises(SystemExit) as exit_info:
        check_device(parser, parser.parse_args(["--device", "cuda"]).device)
    assert exit_info.value.code == 2
    assert "Invalid --device: 'cuda'" in capsys.readouterr().err


def test_functional_benchmark_cuda_arrangement_on_cpu():
    bench = _functional_benchmark()
    large, many = bench.CASES["cuda"]
    assert bench.elements(large.shapes) == 100_000_000
    assert len(many.shapes) == 10_000 and bench.elements(many.shapes) == 10_000 * 1024
    # The same kinds of shape, shrunk: one 2-D parameter, many of 32 x 32.
    cpu = torch.device("cpu")
    large_shapes, many_shapes = ((10, 1000),), ((32, 32),) * 20
    clock = device_clock(cpu)
    steps = {}
    for name, impl in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        step = bench.torch_step(torch.optim.Adam, large_shapes, {}, impl, cpu)
        assert step is not None, name
        steps[name] = step
    steps["distopt"], state_bytes = bench.functional_step(torch.optim.Adam, large_shapes, {}, cpu)
    steps["flat"], _ = bench.functional_step(torch.optim.Adam, many_shapes, {}, cpu, flat=True)
    medians = bench.interleaved_medians(steps, 1, clock, bench.CUDA_WARMUP)
    assert set(medians) == set(steps) and all(ms > 0 for ms in medians.values())
    # exp_avg and exp_avg_sq, float32: the floor reads and writes them beside the parameter.
    assert state_bytes == 2 * 4 * 10_000
    bandwidth = bench.copy_bandwidth_gbs(2 * bench.elements(large_shapes), cpu, repeats=2)
    floor = bench.floor_ms(large_shapes, state_bytes, bandwidth)
    assert floor == pytest.approx((3 * 4 * 10_000 + 2 * state_bytes) / (bandwidth * 1e9) * 1e3)


def test_rpc_world_sets_cross_on_the_cpu():
    """What the owners send back is on the CPU whatever the parameters' device (here the CPU,
    where ``set_values`` must still copy)."""
    params = [torch.ones(3, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)]
    _rpc_world._sets["check"] = params
    try:
        loss = _rpc_world.set_sum("check")
        values = _rpc_world.set_values("check")
    finally:
        _rpc_world.drop("check")
    assert loss.device.type == "cpu" and loss.item() == 9.0 and loss.requires_grad
    assert all(v.device.type == "cpu" for v in values)
    assert values[0].data_ptr() != params[0].data_ptr()
