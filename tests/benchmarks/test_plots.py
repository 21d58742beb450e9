"""The benchmarks' pictures (``--timeline``, ``--plot``), checked without running a benchmark:
matplotlib is an extra, so without it the options stop at once naming it; the timeline's
lanes come from what runs on each thread. Nothing here times anything."""
import argparse
import sys

import pytest

from benchmarks import _plot
from benchmarks import data_parallel


def test_without_matplotlib_the_options_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    with pytest.raises(SystemExit) as raised:
        _plot.pyplot("--plot")
    assert "--plot needs matplotlib" in str(raised.value)
    assert 'pip install -e ".[bench]"' in str(raised.value)
    # Refused before any rank is spawned.
    monkeypatch.setattr(data_parallel, "run_world", lambda options: pytest.fail("spawned"))
    with pytest.raises(SystemExit) as raised:
        data_parallel.main(["--timeline", "never.png"])
    assert 'pip install -e ".[bench]"' in str(raised.value)


def test_timeline_and_arrival_are_refused_together(capsys):
    with pytest.raises(SystemExit):
        data_parallel.main(["--timeline", "never.png", "--arrival"])
    assert "--arrival and --timeline" in capsys.readouterr().err


def _rank(shift):
    """A made-up trace of one step: (name, thread, start ms, end ms)."""
    engine = data_parallel.ENGINE + ": AddmmBackward0"
    return [
        ("forward", 1, 0 + shift, 10 + shift), ("backward", 1, 10 + shift, 40 + shift),
        (engine, 1, 11 + shift, 20 + shift), (engine, 1, 21 + shift, 30 + shift),
        ("optimizer step", 1, 40 + shift, 41 + shift),
        ("distopt.dp.reduce[bucket 0]", 4, 15 + shift, 16 + shift),
        ("distopt.dp.reduce.wait[bucket 0]", 7, 16 + shift, 25 + shift),
        ("distopt.dp.step[bucket 0]", 7, 25 + shift, 27 + shift),
        (data_parallel.GLOO, 5, 16 + shift, 24 + shift),
        (data_parallel.GLOO, 6, 22 + shift, 35 + shift),
    ]


def test_lanes_are_told_apart_by_what_runs_on_each_thread():
    lanes = data_parallel._lanes(_rank(0))
    assert [label for label, _ in lanes] == [
        "main thread", "distopt communication thread", "distopt finishing thread",
        "gloo threads",  # gloo's two threads in one lane
    ]
    assert len(lanes[3][1]) == 2
    # all_reduce runs 16..35 ms (merged), backward computes 11..30: 14 of its 19 ms.
    ((compute, running, share),) = data_parallel._overlap(_rank(0))
    assert (compute, running) == (19, 19) and share == pytest.approx(14 / 19)


def test_timeline_is_drawn_one_lane_per_thread_per_rank(tmp_path):
    ranks = []
    for r in range(2):
        result = {"layers": 2}
        for name, (kind, _) in data_parallel.TIMELINE_CONFIGS.items():
            events = _rank(r)
            if kind == "ddp":
                events = [e for e in events if not e[0].startswith("distopt.")]
            result[name] = {"events": events, "buckets": None if kind == "ddp" else 1}
        ranks.append(result)
    options = argparse.Namespace(timeline=str(tmp_path / "timeline.png"), warmup=1, batch=4,
                                 markdown=True)
    lines = data_parallel.timeline_report(ranks, options)
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert any("| DDP + torch.optim.Adam(fused=True) | DDP's |" in line for line in lines)
