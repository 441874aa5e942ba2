"""What a rollout engine step runs on the GPU beside a pure decode step of the same rows.

`kv4rl bench rollout` reports `step / same rows`: an engine step (partial rollout, say) against a
CUDA-graph replay of the bare model at the rows and contexts the engine ran. This says where the
difference goes. It runs one corner of the bench (same workload flags and `engine.*` overrides) on a
random-init Qwen3 shape, lets a warm-up batch pass, then puts `--steps` consecutive engine steps
under the torch profiler (the up to `--steps` steps before them are timed without it: the profiler
slows every graph launch). It then replays the pure step of the rows the window started, middled and
ended with, also under the profiler. Per kernel family (`kv4rl.bench.kernel_profile`) it prints the
GPU ms per step of both and their difference, and the window's wall time per step against its GPU
busy time (the union of kernel intervals; the rest is the device waiting on the host). Family times
are sums of kernel times: a kernel that runs beside another (KV4's INT8 item beside the INT4 body,
waiting for it) counts whole, so they can add up to more than the busy time. Last, the host's time in
CUDA API calls a step (a call that waits for the device, such as a pageable copy staged behind the
stream's work, shows as a long mean). The profiler itself makes a graph launch cost ~1.4 us a kernel
node (a 400-kernel graph: 550 us a replay under it, 6 us without; `tools/graph_launch_time.py`), so
`cudaGraphLaunch`'s time here is mostly the profiler's:

    python tools/profile_rollout_step.py --shape qwen3-1.7b --format kv4 engine.gpu_memory_fraction=0.6 \\
        --json profile_rollout_kv4.json

The engine's kernels are those that ran while the window was open. With `engine.async_scheduling` a
step's kernels overlap the next step's host work, so the window's edges hold about one step more or
less; over 200 steps that is within 1%. The profiler records the host's ops too, which slows the
host: the window's wall time per step is an upper bound, `bench rollout`'s `decode step ms` the
number to compare with.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kv4rl.bench.decode_forward import time_step
from kv4rl.bench.kernel_profile import (busy_ms, by_family, kernel_intervals, kernel_rows, runtime_calls, runtime_events,
                                       side_by_side)
from kv4rl.bench.rollout import corner_collector, decoder_of
from kv4rl.bench.rollout_plan import RolloutBench, Workload, prepare
from kv4rl.cli_common import engine_config
from kv4rl.config_loader import parse_override
from kv4rl.engine.llm import Engine


class StepWindow:
    """Wraps `engine.step`: opens the profiler before step `skip`, closes it after `steps` more, and
    keeps those steps' records and the running rows' contexts at the window's start, middle and end."""

    def __init__(self, engine: Engine, skip: int, steps: int):
        self.engine, self.step, self.skip, self.steps = engine, engine.step, skip, steps
        self.count, self.records, self.contexts = 0, [], []
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self.wall_s = None
        self.plain_start = max(0, skip - steps)  # the steps before the window, timed without the profiler
        self.plain_steps, self.plain_wall_s, self.t_plain = skip - self.plain_start, None, None
        self.own = vars(engine).get("step")  # a wrapper set on the instance before this one
        engine.step = self._step

    @property
    def done(self) -> bool:
        return self.wall_s is not None

    def _step(self):
        inside = self.skip <= self.count < self.skip + self.steps
        if self.count == self.plain_start and self.plain_steps:
            torch.cuda.synchronize()
            self.t_plain = time.perf_counter()
        if self.count == self.skip:
            torch.cuda.synchronize()
            if self.t_plain is not None:
                self.plain_wall_s = time.perf_counter() - self.t_plain
            self.prof.start()
            self.t0 = time.perf_counter()
        if inside and (self.count - self.skip) in (0, self.steps // 2, self.steps - 1):
            self.contexts.append([len(s) for s in self.engine.scheduler.running])
        out = self.step()
        if inside:
            self.records.append(dict(self.engine.last_step))
        self.count += 1
        if self.count == self.skip + self.steps:
            torch.cuda.synchronize()
            self.wall_s = time.perf_counter() - self.t0
            self.prof.stop()
            if self.own is None:
                del self.engine.step  # the class's method again
            else:
                self.engine.step = self.own
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-1.7b")
    p.add_argument("--format", default="kv4", help="one `bench rollout --formats` entry, e.g. kv4 or kv4@256")
    p.add_argument("--mode", default="partial", choices=("sync", "partial"))
    p.add_argument("--quota-groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--median-len", type=int, default=512)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--max-slots", type=int, default=128)
    p.add_argument("--skip", type=int, default=300, help="engine steps after the warm-up batch before the window")
    p.add_argument("--steps", type=int, default=200, help="engine steps under the profiler")
    p.add_argument("--reps", type=int, default=50, help="pure-step replays profiled per snapshot of the rows")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--item-after-body", action="store_true",
                   help="KV4: launch the INT8 item after the INT4 body, not beside it (its graph then has no "
                        "programmatic edges), to compare the host's time in the graph launch")
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*", help="engine.* settings, as for `kv4rl bench rollout`")
    a = p.parse_intermixed_args()
    if a.item_after_body:
        from kv4rl.kernels import decode_attention

        decode_attention.INT8_ITEM_BESIDE_BODY = False
    if not torch.cuda.is_available():
        raise SystemExit("profile_rollout_step needs a CUDA device (it profiles GPU kernels)")
    if a.steps < 3 or a.skip < 0 or a.reps < 1:
        raise SystemExit(f"--steps must be >= 3, --skip >= 0 and --reps >= 1 (got {a.steps}, {a.skip}, {a.reps})")
    bench = RolloutBench(
        formats=(a.format,), modes=(a.mode,), repeats=1, shape=a.shape, device="cuda",
        workload=Workload(quota_groups=a.quota_groups, group_size=a.group_size, max_slots=a.max_slots,
                          prompt_len=a.prompt_len, median_len=a.median_len, sigma=a.sigma, max_len=a.max_len,
                          seed=a.seed),
        engine=engine_config(a.overrides), engine_keys=frozenset(".".join(parse_override(o)[0]) for o in a.overrides))
    try:
        plan = prepare(bench)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    decoder = decoder_of(plan)
    engine = Engine.from_model(decoder, copy.deepcopy(plan.configs[a.format]), max_num_seqs=plan.slots[a.format],
                               seed=a.seed)
    print(engine.summary)
    collector = corner_collector(engine, plan, a.format, a.mode)
    collector.collect()  # warm-up: graphs captured, kernels compiled
    window = StepWindow(engine, a.skip, a.steps)
    while not window.done:
        collector.collect()
    kv_format, block_size = engine.kv_format, plan.configs[a.format].kv.block_size
    del collector, engine
    torch.cuda.empty_cache()

    engine_kernels = kernel_rows(window.prof)
    engine_fam = by_family(engine_kernels, per=a.steps)
    mixed = sum(r["prefill_tokens"] > 0 for r in window.records)
    wall_ms = 1e3 * window.wall_s / a.steps
    plain_ms = 1e3 * window.plain_wall_s / window.plain_steps if window.plain_wall_s is not None else None
    pure_fams, pure_ms = [], []
    for contexts in window.contexts:
        def profiled(replay):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(a.reps):
                    replay()
                torch.cuda.synchronize()
            pure_fams.append(by_family(kernel_rows(prof), per=a.reps))
        pure_ms.append(time_step(decoder, kv_format, len(contexts), contexts, block_size=block_size,
                                 on_graph=profiled)["ms"])
    pure_fam = {f: statistics.fmean(fam.get(f, 0.0) for fam in pure_fams) for f in set().union(*pure_fams)}
    table = side_by_side(engine_fam, pure_fam)

    busy = busy_ms(kernel_intervals(window.prof)) / a.steps  # kernels that overlap count once
    print(f"\n{a.shape} {a.format} {a.mode}: {a.steps} steps profiled ({mixed} mixed), rows "
          f"{', '.join(str(len(c)) for c in window.contexts)}; wall {wall_ms:.2f} ms a step, GPU busy {busy:.2f} "
          f"({100 * busy / wall_ms:.0f}%); pure step of the same rows {statistics.fmean(pure_ms):.2f} ms "
          f"(timed), {sum(pure_fam.values()):.2f} ms of kernels (profiled)")
    if plain_ms is not None:
        print(f"without the profiler, the {window.plain_steps} steps before the window: {plain_ms:.2f} ms a step "
              f"(the profiler adds host time to each graph launch); GPU busy of the window over it: "
              f"{100 * busy / plain_ms:.0f}%")
    print(f"{'family':16s} {'engine ms':>10s} {'pure ms':>10s} {'extra ms':>10s}")
    for r in table:
        print(f"{r['family']:16s} {r['engine_ms']:10.3f} {r['pure_ms']:10.3f} {r['extra_ms']:10.3f}")
    print("engine's top kernels (ms a step, calls a step):")
    for k in engine_kernels[: a.top]:
        print(f"  {k['gpu_ms'] / a.steps:8.3f} {k['calls'] / a.steps:7.1f}  [{k['family']}] {k['name']}")
    api = runtime_calls(runtime_events(window.prof), per=a.steps)
    print("host time in CUDA API calls (ms a step, calls a step, mean us, longest us):")
    for r in api[:8]:
        print(f"  {r['ms']:8.3f} {r['calls']:7.1f} {r['mean_us']:8.1f} {r['longest_us']:9.1f}  {r['name']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "format": a.format, "mode": a.mode, "gpu": torch.cuda.get_device_name(),
                       "summary": plan.pool_line(a.format), "steps": a.steps, "mixed_steps": mixed,
                       "wall_ms_per_step": wall_ms, "gpu_busy_ms_per_step": busy,
                       "unprofiled_steps": window.plain_steps, "unprofiled_wall_ms_per_step": plain_ms,
                       "pure_rows_ms": statistics.fmean(pure_ms), "row_counts": [len(c) for c in window.contexts],
                       "families": table, "runtime_calls": api[:16], "engine_kernels": [dict(k, gpu_ms_per_step=k["gpu_ms"] / a.steps)
                                                               for k in engine_kernels[: 4 * a.top]]},
                      f, indent=2)


if __name__ == "__main__":
    main()
