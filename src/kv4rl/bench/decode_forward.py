"""`kv4rl bench decode-forward`: one whole-model decode step (all layers, LM head) at Qwen3 shapes, for
BF16 or FP8 weights and a BF16 or KV4 cache (figure B-9 of the method).

The model is random-init on the device (no download), every sequence of the batch sits at the same
context with its cache filled with random codes, and the step is the engine's own CUDA-graph decode
step (`DecodeGraphs`: embeddings, projections, fused KV write, split-KV attention, LM head; sampling
excluded, as it is the same for every variant). Times are medians of graph replays.

With `tp` (under torchrun) every rank builds its tensor-parallel shard (`kv4rl.models.tensor_parallel`)
and its share of the KV heads; the graphs hold the two all-reduces per layer, and the replays of all
ranks are started together (a barrier before each), so a step's time includes waiting for the slowest.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np
import torch

from kv4rl.bench.roofline import copy_bandwidth, roofline_ms, weight_bytes_per_step

# "short" (not in the default list): few rows at a short context, where the weights are most of the bytes
WORKLOADS = {"early": (256, 1024), "mid": (128, 4096), "late": (64, 8192), "short": (64, 1024)}
VARIANTS = (("bf16", "bf16"), ("fp8", "bf16"), ("bf16", "kv4"), ("fp8", "kv4"))


def time_step(model, kv, batch: int, context: int | Sequence[int], block_size: int = 16, reps: int = 20,
              seed: int = 0, barrier=None, on_graph=None) -> dict:
    """Build a full cache for `batch` sequences at `context` tokens (one number, or one per sequence) and
    time one graph-replayed step. `kv`: a format name (KV4 / INT4 with one scale group per head) or a
    `KVFormat` as an engine built it. `on_graph(replay)`, after the timing, may replay the step again
    (e.g. under the profiler)."""
    from kv4rl.bench.decode_attn import fill_random
    from kv4rl.engine.cuda_graphs import DecodeGraphs
    from kv4rl.engine.fast_path import FastAttention
    from kv4rl.engine.kv_formats import get_kv_format

    args = model.args
    device = next(model.parameters()).device
    if isinstance(kv, str):
        fmt = get_kv_format(kv, **({"group_size": args.head_dim} if kv in ("int4", "kv4") else {}))
    else:
        fmt = kv
    layout = step_layout(batch, context, block_size, args.vocab_size, seed)
    blocks_per_seq = layout["block_tables"].shape[1]
    num_slots = layout["num_blocks"] * block_size
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    caches = []
    for _ in range(args.num_layers):
        cache = fmt.allocate(num_slots, args.num_kv_heads, args.head_dim, device, num_seq_slots=batch)
        fill_random(cache, gen)
        caches.append(cache)
    fast = FastAttention(fmt, args.num_kv_heads, args.head_dim, block_size, device, num_q_heads=args.num_heads)
    graphs = DecodeGraphs(model, caches, fast, batch, blocks_per_seq)  # `batch` is its largest bucket
    host = {k: v for k, v in layout.items() if k != "num_blocks"}
    host["protect_rows"] = fast.protect_rows(host["positions"], host["seq_slots"].astype(np.int64))
    logits = graphs.run(host)  # captures
    finite = bool(torch.isfinite(logits).all())
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if barrier is not None:
            barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.graphs[batch].replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    if on_graph is not None:
        on_graph(graphs.graphs[batch].replay)
    kv_bytes = sum(t.numel() * t.element_size() for c in caches for t in c.values())
    del graphs, caches
    torch.cuda.empty_cache()
    ms = statistics.median(times)
    return {"ms": ms, "tokens_per_s": batch / ms * 1e3, "finite": finite, "kv_gib": kv_bytes / 2**30}


def step_layout(batch: int, context: int | Sequence[int], block_size: int, vocab_size: int, seed: int = 0) -> dict:
    """A decode step's host inputs (`FastAttention.host_inputs`' arrays but KV4's protected rows) for
    `batch` sequences at `context` tokens each (one number, or one per sequence), their blocks a random
    permutation of a pool of `num_blocks` laid out row by row, as many per sequence as the engine holds
    when it writes the next token."""
    contexts = np.full(batch, context, dtype=np.int64) if np.ndim(context) == 0 else np.asarray(context, np.int64)
    if contexts.shape != (batch,) or contexts.min() < 1:
        raise ValueError(f"time_step: {batch} contexts of at least 1 token expected, got {context!r}")
    blocks = -(-(contexts + 1) // block_size)
    order = np.random.default_rng(seed).permutation(int(blocks.sum())).astype(np.int32)
    tables = np.zeros((batch, int(blocks.max())), dtype=np.int32)
    for row, (start, n) in enumerate(zip(np.cumsum(blocks) - blocks, blocks)):
        tables[row, :n] = order[start:start + n]  # equal contexts: the permutation row by row
    pos = contexts - 1
    return {
        "ids": np.random.default_rng(seed).integers(0, vocab_size, batch),
        "positions": pos,
        "slots": tables[np.arange(batch), pos // block_size].astype(np.int64) * block_size + pos % block_size,
        "context_lens": contexts.astype(np.int32),
        "seq_slots": np.arange(batch, dtype=np.int32),
        "block_tables": tables,
        "num_blocks": int(blocks.sum()),
    }


def step_roofline(model, kv: str, batch: int, context: int, ms: float, bandwidth: float | None) -> dict:
    """The step's byte roofline (`kv4rl.bench.roofline`: the weights it reads, plus the K and V of `batch`
    sequences at `context` tokens in every layer, scales included) and the fraction of it `ms` reaches;
    None without a measured bandwidth."""
    from kv4rl.bench.decode_attn import kv_bytes_read

    if bandwidth is None:
        return {"roofline_ms": None, "of_roofline": None}
    args = model.args
    kv_bytes = args.num_layers * kv_bytes_read(kv, batch, context, args.num_kv_heads, args.head_dim)
    roof = roofline_ms(weight_bytes_per_step(model), kv_bytes, bandwidth)
    return {"roofline_ms": roof, "of_roofline": roof / ms}


def fp8_gemm_problem(fp8_gemm: str, fused_ops: bool, option: str = "fp8_gemm", fused: str = "fused_ops") -> str | None:
    """Why `fp8_gemm` (as `engine.fp8_gemm`) cannot be timed with these fused ops (None: it can);
    `option` and `fused` are the names the caller's user knows them by."""
    if fp8_gemm not in ("auto", "triton", "scaled_mm"):
        return f"{option}: {fp8_gemm!r} is not one of auto, triton, scaled_mm"
    if fp8_gemm == "triton" and not fused_ops:
        return f"{option} triton needs {fused} (as engine.fp8_gemm does)"
    return None


def run_decode_forward(shapes: list[str], workloads: list[str], variants=VARIANTS, device="cuda",
                       progress=None, fused_ops: bool = False, tp=None, merge_projections: bool = True,
                       fp8_gemm: str = "auto", fp8_inputs: bool = True) -> dict:
    """`fused_ops` runs the step as `engine.fused_ops=true` would (fused norms/RoPE/SwiGLU, one-launch
    FP8 activation quantization), `merge_projections` as `engine.merge_projections=true` (one GEMM for
    q|k|v, one for gate|up), `fp8_gemm` as `engine.fp8_gemm` (auto: the Triton e4m3 GEMM with fused ops);
    `fp8_inputs` off makes every FP8 linear quantize its own input (with fused ops the norms and SwiGLU
    before them do, as the engine runs).
    `tp`: this rank's `TensorParallel` (every rank calls this)."""
    problem = fp8_gemm_problem(fp8_gemm, fused_ops)
    if problem:
        raise ValueError(problem)
    decode_gemm = fused_ops and fp8_gemm != "scaled_mm"
    from kv4rl.bench.random_model import random_decoder
    from kv4rl.engine.fp8_weights import apply_fp8_weights, set_fused_quant
    from kv4rl.engine.merged_linears import merge_projections as merge

    results = []
    bandwidth = copy_bandwidth(torch.device(device))
    for shape in shapes:
        model = random_decoder(shape, device, tp=tp)
        if fused_ops:
            model.enable_fused_ops()
        if merge_projections:  # FP8 later swaps the merged linears themselves: the same codes per row
            merge(model)
        weights_now = "bf16"
        for weights in ("bf16", "fp8"):
            for w, kv in variants:
                if w != weights:
                    continue
                if weights == "fp8" and weights_now != "fp8":
                    apply_fp8_weights(model)
                    set_fused_quant(model, fused_ops, decode_gemm, fp8_inputs)
                    torch.cuda.empty_cache()
                    weights_now = "fp8"
                for name in workloads:
                    batch, context = WORKLOADS[name]
                    barrier = None if tp is None or tp.size == 1 else _barrier(tp)
                    row = {"shape": shape, "workload": name, "batch": batch, "context": context, "weights": w,
                           "kv": kv, "fused_ops": fused_ops, "merge_projections": merge_projections,
                           "fp8_gemm": None if w != "fp8" else "triton" if decode_gemm else "scaled_mm",
                           "fp8_inputs": w == "fp8" and fused_ops and fp8_inputs,
                           "tensor_parallel": 1 if tp is None else tp.size}
                    try:
                        row.update(time_step(model, kv, batch, context, barrier=barrier))
                    except torch.cuda.OutOfMemoryError:  # a BF16 cache of 64 x 8,192 at 8B is 72 GiB: an H100's
                        torch.cuda.empty_cache()         # whole memory; the other workloads still run
                        row.update(ms=None, tokens_per_s=None, finite=None, kv_gib=None,
                                   does_not_fit=f"{kv} KV of {batch} x {context} tokens does not fit beside the "
                                                f"weights in {torch.cuda.mem_get_info()[1] / 2**30:.1f} GiB")
                    if row["ms"] is not None:
                        row.update(step_roofline(model, kv, batch, context, row["ms"], bandwidth))
                    else:
                        row.update(roofline_ms=None, of_roofline=None)
                    results.append(row)
                    if progress:
                        progress(row)
        del model
        torch.cuda.empty_cache()
    for row in results:
        base = next(r for r in results if r["shape"] == row["shape"] and r["workload"] == row["workload"]
                    and r["weights"] == "bf16" and r["kv"] == "bf16")
        row["speedup_vs_bf16"] = base["ms"] / row["ms"] if base["ms"] is not None and row["ms"] is not None else None
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}


def run_decode_forward_tp(shapes: list[str], workloads: list[str], size: int, fused_ops: bool,
                          merge_projections: bool = True, fp8_gemm: str = "auto",
                          fp8_inputs: bool = True) -> dict | None:
    """Under torchrun: every rank times its shard's step; rank 0 then times one GPU in the same job and
    returns the rows with `speedup_vs_tp1` (the other ranks return None)."""
    from kv4rl import distributed
    from kv4rl.models.tensor_parallel import tensor_parallel_group

    distributed.init_from_torchrun("cuda")
    tp = tensor_parallel_group(size)
    res = run_decode_forward(shapes, workloads, fused_ops=fused_ops, tp=tp, merge_projections=merge_projections,
                             fp8_gemm=fp8_gemm, fp8_inputs=fp8_inputs)
    distributed.barrier()
    if tp.rank != 0:
        return None
    add_tp1_ratio(res, run_decode_forward(shapes, workloads, fused_ops=fused_ops, merge_projections=merge_projections,
                                          fp8_gemm=fp8_gemm, fp8_inputs=fp8_inputs))
    return res


def _barrier(tp):
    import torch.distributed as dist

    return lambda: dist.barrier(group=tp.group, device_ids=[torch.cuda.current_device()])


def add_tp1_ratio(tp_result: dict, tp1_result: dict) -> None:
    """`speedup_vs_tp1` per row of a tensor-parallel run, from one-GPU rows of the same job."""
    for row in tp_result["results"]:
        base = next(r for r in tp1_result["results"] if all(
            r[k] == row[k] for k in ("shape", "workload", "weights", "kv")))
        row["tp1_ms"] = base["ms"]
        row["speedup_vs_tp1"] = base["ms"] / row["ms"] if base["ms"] is not None and row["ms"] is not None else None
