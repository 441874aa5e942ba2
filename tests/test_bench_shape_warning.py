"""A benchmark of a real model's shape started off CUDA says, before any work, that it takes hours and GBs:
`bench rollout --shape qwen3-1.7b` on a CPU grew to 24 GB and was killed by the OS without a word, and only
`bench iteration` warned. The benchmark itself is replaced here by one that stops at once."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kv4rl.cli import app


class Stopped(Exception):
    pass


def _stop(*args, **kwargs):
    raise Stopped("the benchmark was reached")


COMMANDS = {
    "generate": ("kv4rl.bench.generate", "bench_generate", ["--no-hf"]),
    "rollout": ("kv4rl.bench.rollout", "bench_rollout", []),
    "learner": ("kv4rl.bench.learner", "bench_learner", ["--workload", "uniform", "--seq-len", "256", "--prompt-len", "64"]),
    "iteration": ("kv4rl.bench.iteration", "bench_iteration", ["--prompt-len", "16", "--max-len", "64", "--median-len", "32"]),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("shape", ["qwen3-1.7b", "qwen3-tiny"])
def test_a_real_shape_on_the_cpu_is_warned_before_the_benchmark_starts(monkeypatch, command, shape):
    import importlib

    module, function, extra = COMMANDS[command]
    monkeypatch.setattr(importlib.import_module(module), function, _stop)
    res = CliRunner().invoke(app, ["bench", command, "--shape", shape, "--device", "cpu", *extra])
    assert isinstance(res.exception, Stopped), res.output
    warned = f"--shape {shape} is a real model's size: on the CPU" in res.output
    assert warned == (shape != "qwen3-tiny")
