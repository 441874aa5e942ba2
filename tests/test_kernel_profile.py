"""Kernel families of a profile (`kv4rl.bench.kernel_profile`) and the engine-step window of
`tools/profile_rollout_step.py`, on hand-worked cases (the profiles themselves need a GPU)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kv4rl.bench.kernel_profile import _RUNTIME_CALL, busy_ms, by_family, family, runtime_calls, side_by_side


@pytest.mark.parametrize("name,fam", [
    ("int4_decode_split", "attention"),
    ("_merge_kernel", "attention"),
    ("_decode_split_kernel", "attention"),
    ("_prefill_kernel", "prefill"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_TNT", "gemm"),
    ("_fp8_weight_gemm_kernel", "gemm"),
    ("_kv_write_kernel", "kv_write"),
    ("_gumbel_argmax_kernel", "sampler+logits"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>",
     "sampler+logits"),  # torch.argmax (the greedy rows'), which "argmax" alone missed
    ("_qk_norm_rope_kernel", "norm/rope/act"),
    ("Memcpy HtoD (Pageable -> Device)", "copies"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>", "other"),
])
def test_kernel_names_fall_into_their_family(name, fam):
    assert family(name) == fam


def test_busy_time_is_the_union_of_kernel_intervals():
    """Overlapping kernels (an INT8 item beside its body) count once, nested ones add nothing, gaps are
    left out, and the order of the events does not matter: 0-10, 8-15 (5 more), 12-14 (inside), 20-21."""
    intervals = [(20.0, 21.0), (0.0, 10.0), (12.0, 14.0), (8.0, 15.0)]
    assert busy_ms(intervals) == pytest.approx(16.0 / 1e3)
    assert busy_ms([(0.0, 10.0), (10.0, 12.0)]) == pytest.approx(12.0 / 1e3)  # touching: no gap, no overlap
    assert busy_ms([]) == 0.0


def test_host_time_in_cuda_api_calls_by_name():
    """Per name over 2 steps: calls and ms a step, mean and longest call; most time first. Runtime and
    driver calls count, library and aten ops do not."""
    events = [("cudaMemcpyAsync", 10.0), ("cudaGraphLaunch", 30.0), ("cudaMemcpyAsync", 400.0),
              ("cudaMemcpyAsync", 6.0), ("cuLaunchKernelEx", 4.0)]
    rows = runtime_calls(events, per=2)
    assert [r["name"] for r in rows] == ["cudaMemcpyAsync", "cudaGraphLaunch", "cuLaunchKernelEx"]
    copy = rows[0]
    assert copy["calls"] == 1.5 and copy["ms"] == pytest.approx(0.208) and copy["longest_us"] == 400.0
    assert copy["mean_us"] == pytest.approx(416 / 3)
    assert [bool(_RUNTIME_CALL.match(n)) for n in ("cudaStreamSynchronize", "cuLaunchKernel", "cudnnConvolution",
                                                    "aten::copy_", "cub::DeviceReduce")] == [True, True, False,
                                                                                            False, False]


def test_families_summed_per_step_and_set_side_by_side():
    rows = [{"family": "gemm", "gpu_ms": 30.0}, {"family": "attention", "gpu_ms": 12.0},
            {"family": "gemm", "gpu_ms": 10.0}, {"family": "sampler+logits", "gpu_ms": 3.0}]
    engine = by_family(rows, per=10)
    assert engine == pytest.approx({"gemm": 4.0, "attention": 1.2, "sampler+logits": 0.3})
    pure = {"gemm": 4.0, "attention": 0.9, "copies": 0.05}
    table = side_by_side(engine, pure)
    # largest difference first; attention and the sampler both add 0.3 ms, so by name
    assert [r["family"] for r in table] == ["attention", "sampler+logits", "gemm", "copies", "total"]
    assert [r["extra_ms"] for r in table] == pytest.approx([0.3, 0.3, 0.0, -0.05, 0.55])
    assert (table[-1]["engine_ms"], table[-1]["pure_ms"]) == pytest.approx((5.5, 4.95))


def _tool():
    path = Path(__file__).resolve().parents[1] / "tools" / "profile_rollout_step.py"
    spec = importlib.util.spec_from_file_location("profile_rollout_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Profiler:
    def __init__(self, log):
        self.log = log

    def start(self):
        self.log.append("start")

    def stop(self):
        self.log.append("stop")


class _Engine:
    """Steps numbered from 0; step i runs i % 5 + 1 sequences of length 100 + i each."""

    def __init__(self, log):
        self.log, self.i = log, 0
        self.scheduler = SimpleNamespace(running=[])
        self._set_running()

    def _set_running(self):
        self.scheduler.running = [[0] * (100 + self.i)] * (self.i % 5 + 1)

    def step(self):
        self.log.append(self.i)
        self.last_step = {"step": self.i, "prefill_tokens": 0}
        self.i += 1
        self._set_running()


def test_step_window_profiles_exactly_its_steps_and_restores_the_engine(monkeypatch):
    tool = _tool()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    log = []
    engine = _Engine(log)
    window = tool.StepWindow(engine, skip=3, steps=4)
    window.prof = _Profiler(log)
    while not window.done:
        engine.step()
    assert log == [0, 1, 2, "start", 3, 4, 5, 6, "stop"]
    assert [r["step"] for r in window.records] == [3, 4, 5, 6]
    # the rows before the window's first, middle (3 + 4 // 2) and last step
    assert window.contexts == [[100 + i] * (i % 5 + 1) for i in (3, 5, 6)]
    assert "step" not in vars(engine)  # the class's step again: later steps are not profiled
    engine.step()
    assert log[-1] == 7 and window.wall_s >= 0


def test_step_window_gives_back_a_wrapper_set_before_it(monkeypatch):
    tool = _tool()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    log = []
    engine = _Engine(log)
    inner = engine.step
    engine.step = lambda: (log.append("outer"), inner())[1]  # e.g. bench rollout's RowContexts
    earlier = engine.step
    window = tool.StepWindow(engine, skip=0, steps=3)
    window.prof = _Profiler(log)
    while not window.done:
        engine.step()
    assert engine.step is earlier
    assert log == ["start", "outer", 0, "outer", 1, "outer", 2, "stop"]
