"""GPU kernels of a torch-profiler trace, grouped into families, and two traces set side by side.

Used by the profiling tools (`tools/profile_generate.py`, `tools/profile_rollout_step.py`) for the
step breakdowns in bench/kernel_notes.md: which kind of kernel an engine step spends its device time
on, and what it runs that a pure decode step of the same rows does not.
"""

from __future__ import annotations

import re

_RUNTIME_CALL = re.compile(r"^(cuda[A-Z]|cu[A-Z])")  # runtime (cudaMemcpyAsync) and driver (cuLaunchKernelEx) API

FAMILIES = (  # kernel-name fragments -> family, first match wins
    ("attention", ("decode_split", "merge", "int4_decode", "fp8_decode", "int8_side", "flash", "fmha", "sdpa",
                   "attention")),
    ("prefill", ("prefill",)),
    ("gemm", ("nvjet", "gemm", "cublas", "cutlass", "splitK", "scaled_mm")),
    ("kv_write", ("kv_write", "write_kv")),
    ("sampler+logits", ("gumbel", "softmax", "SoftMax", "sampl", "logprob", "argmax", "ArgMax", "topk")),
    ("norm/rope/act", ("rms_norm", "rope", "silu")),
    ("copies", ("Memcpy", "memcpy", "copy_", "CatArrayBatched", "index")),
)


def family(name: str) -> str:
    """The family of a kernel name; "other" when no fragment matches."""
    return next((fam for fam, keys in FAMILIES if any(k in name for k in keys)), "other")


def kernel_rows(prof) -> list[dict]:
    """GPU kernels and copies only (device events), by GPU time: the aten ops that launch them are left
    out, or every kernel's time would be counted twice. Raises when the trace holds none (no CUDA)."""
    from torch.autograd import DeviceType

    rows = [{"name": e.key[:90], "calls": e.count, "gpu_ms": e.self_device_time_total / 1e3,
             "family": family(e.key)}
            for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    if not rows:
        raise RuntimeError("the profile holds no GPU kernel events")
    return sorted(rows, key=lambda r: -r["gpu_ms"])


def kernel_intervals(prof) -> list[tuple[float, float]]:
    """(start, end) in us of every GPU kernel and copy of a trace, for `busy_ms`."""
    from torch.autograd import DeviceType

    return [(e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Time (ms) the GPU runs at least one kernel: the union of the intervals (us). Unlike a sum of kernel
    times it does not count twice the time of kernels that overlap, such as KV4's INT8 item launched
    beside the INT4 body, whose own time includes its wait for the body."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total / 1e3


def runtime_events(prof) -> list[tuple[str, float]]:
    """(name, host us) of every CUDA runtime or driver API call of a trace, for `runtime_calls`."""
    from torch.autograd import DeviceType

    return [(e.name, e.time_range.end - e.time_range.start) for e in prof.events()
            if e.device_type == DeviceType.CPU and _RUNTIME_CALL.match(e.name)]


def runtime_calls(events: list[tuple[str, float]], per: float = 1.0) -> list[dict]:
    """Host time in CUDA API calls by name: calls and ms (divided by `per`, e.g. steps), the mean and the
    longest call (us), most time first. A call that waits for the device (a pageable copy that the driver
    stages behind the stream's work, a synchronize) shows as a long mean beside the few-us launches."""
    grouped: dict[str, list[float]] = {}
    for name, us in events:
        grouped.setdefault(name, []).append(us)
    rows = [{"name": name, "calls": len(t) / per, "ms": sum(t) / 1e3 / per, "mean_us": sum(t) / len(t),
             "longest_us": max(t)} for name, t in grouped.items()]
    return sorted(rows, key=lambda r: (-r["ms"], r["name"]))


def by_family(rows: list[dict], per: float = 1.0) -> dict[str, float]:
    """GPU ms per family, divided by `per` (e.g. the steps the trace holds)."""
    out: dict[str, float] = {}
    for r in rows:
        out[r["family"]] = out.get(r["family"], 0.0) + r["gpu_ms"] / per
    return out


def side_by_side(engine: dict[str, float], pure: dict[str, float]) -> list[dict]:
    """One row per family in either: the engine's ms per step, the pure step's, and the difference,
    largest difference first (equal ones by name), then a total row."""
    rows = [{"family": f, "engine_ms": engine.get(f, 0.0), "pure_ms": pure.get(f, 0.0),
             "extra_ms": engine.get(f, 0.0) - pure.get(f, 0.0)} for f in set(engine) | set(pure)]
    rows.sort(key=lambda r: (-round(r["extra_ms"], 6), r["family"]))  # ties to the nanosecond: by name
    total = {"family": "total", "engine_ms": sum(engine.values()), "pure_ms": sum(pure.values())}
    total["extra_ms"] = total["engine_ms"] - total["pure_ms"]
    return rows + [total]
