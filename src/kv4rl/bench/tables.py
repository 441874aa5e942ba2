"""Result tables of the `kv4rl bench` commands: one builder per benchmark, from the JSON it writes.

Kept apart from the commands so the tables can be rendered (and tested) from saved results; every
table goes through `telemetry.tables.ResultTable`, which never cuts a number.
"""

from __future__ import annotations

from kv4rl.telemetry.tables import ResultTable


def fidelity_table(res: dict) -> ResultTable:
    shape = res["model_shape"]
    buckets = sorted({b for r in res["results"] for b in r["kl_by_position"]},
                     key=lambda b: int(b.split("-")[0].rstrip("+")))
    table = ResultTable(
        f"KV fidelity vs {res['reference']} cache — {res['num_prompts']} prompts, "
        f"{res['response_tokens_mean']:.0f} response tokens each (mean), {shape['layers']} layers x "
        f"{shape['kv_heads']} KV heads x head_dim {shape['head_dim']}, group {res['kv']['group_size']}",
        ["format", "allocation", "KL mean", *[f"KL @{b}" for b in buckets], "top-1 agree",
         f"bytes/token @{res['context_for_bytes']}", "vs bf16"], labels=2)
    for r in res["results"]:
        table.add_row(
            r["format"], r["allocation"] or "-", f"{r['kl_mean']:.3e}",
            *[f"{r['kl_by_position'][b]:.3e}" if b in r["kl_by_position"] else "-" for b in buckets],
            f"{r['top1_agree']:.4f}", f"{r['bytes_per_token']:,.0f}", f"{r['bytes_vs_bf16']:.1%}",
        )
    return table


def pool_table(res: dict, shape: str, memory_gib: float, max_num_seqs: int, context: int) -> ResultTable:
    s = res["model_shape"]
    table = ResultTable(
        f"KV pool in {memory_gib:g} GiB — {shape}: {s['layers']} layers x {s['kv_heads']} KV heads x head_dim "
        f"{s['head_dim']}, {max_num_seqs} sequences, block {res['kv']['block_size']}",
        ["format", "tokens", "vs bf16", "bytes/token", f"bytes/token @{context}", "reserve",
         f"sequences @{context}"])
    for r in res["results"]:
        vs_bf16 = "-" if r["tokens_vs_bf16"] is None else f"{r['tokens_vs_bf16']:.2f}x"
        table.add_row(r["format"], f"{r['tokens']:,}", vs_bf16, f"{r['bytes_per_token']:,.0f}",
                      f"{r['bytes_per_token_at_context']:,.0f}", f"{r['reserve_bytes'] / 2**20:,.1f} MiB",
                      f"{r['sequences_at_context']}")
    return table


def num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def generate_table(res: dict) -> ResultTable:
    s = res["model_shape"]
    weights = res.get("weight_formats") or [res.get("weight_format", "auto")]  # before: one weight format a run
    table = ResultTable(
        f"generate: {res['shape']} ({s['layers']} layers, hidden {s['hidden']}) {res['dtype']} on "
        f"{res['gpu'] or res['device']}, prompt {res['prompt_len']} + {res['new_tokens']} new tokens, "
        f"weights {', '.join(weights)}",
        (["weights"] if len(weights) > 1 else [])
        + ["kv", "batch", "engine tok/s", "HF tok/s", "speedup", "steps", "prefill s", "decode step ms",
           "of it host ms", "of byte roofline", "engine peak GiB", "HF peak GiB"]
        + (["async vs sync"] if any(r.get("scheduling") == "async" for r in res["results"]) else [])
        + (["vs auto weights"] if len(weights) > 1 else [])
        + (["vs bf16 KV"] if any(r.get("speedup_vs_bf16_kv") is not None for r in res["results"]) else []),
        labels=2 + (len(weights) > 1))
    async_rows = "async vs sync" in table.headers
    for r in res["results"]:
        roof = r.get("decode_of_roofline")
        cells = ([r.get("weight_format", "auto")] if len(weights) > 1 else []) + [
            r["kv_format"] + (f" {r['scheduling']}" if async_rows else ""), str(r["batch_size"]),
            f"{r['engine_tokens_per_s']:,.0f}", _hf_rate(r),
            f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-", str(r["engine_steps"]),
            num(r.get("prefill_s")), num(r["decode_step_ms"]), num(r.get("decode_host_ms")),
            "-" if roof is None else f"{roof:.0%} of {r['decode_roofline_ms']:.2f} ms",
            num(r["engine_peak_gib"]), num(r.get("hf_peak_gib"))]
        if async_rows:
            cells.append(f"{r['speedup_vs_sync']:.2f}x" if r.get("speedup_vs_sync") is not None else "-")
        for header, key in (("vs auto weights", "speedup_vs_auto_weights"), ("vs bf16 KV", "speedup_vs_bf16_kv")):
            if header in table.headers:
                cells.append(f"{r[key]:.2f}x" if r.get(key) is not None else "-")
        table.add_row(*cells)
    return table


def _hf_rate(row: dict) -> str:
    """transformers' tokens/s, with the range of its repeats when it ran more than once."""
    if "hf_tokens_per_s" not in row:
        return "-"
    if "hf_tokens_per_s_min" not in row:
        return f"{row['hf_tokens_per_s']:,.0f}"
    return f"{row['hf_tokens_per_s']:,.0f} [{row['hf_tokens_per_s_min']:,.0f}-{row['hf_tokens_per_s_max']:,.0f}]"


def decode_attn_table(res: dict) -> ResultTable:
    table = ResultTable(f"decode attention per layer on {res['device']} (bytes read incl. scales)",
                        ["shape", "format", "kernel", "batch", "context", "ms", "TB/s", "vs SDPA-cuDNN"], labels=3)
    for r in res["results"]:
        table.add_row(r["shape"], r["format"], r.get("kernel", r.get("int4_kernel", "")), str(r["batch"]), str(r["context"]),
                      f"{r['ms']:.4f}", f"{r['tbps']:.2f}", f"{r['speedup_vs_sdpa']:.2f}x")
    return table


def rollout_table(res: dict) -> ResultTable:
    w = res["workload"]
    budget = f"{res['kv_budget_gib']:g} GiB KV budget" if res["kv_budget_gib"] else "pool sized by the engine"
    table = ResultTable(
        f"rollout: {res['model']} on {res['gpu'] or res['device']}, {budget} — {w['quota_groups']} groups x "
        f"{w['group_size']}, {w['max_slots']} slots, prompt {w['prompt_len']}, lengths log-normal median "
        f"{w['median_len']} sigma {w['sigma']:g} max {w['max_len']}; median [min-max] of {res['repeats']} repeats",
        ["format", "mode", "s / batch", "speedup vs bf16 sync", "tokens/s", "slot util", "mean active",
         "preemptions", "pool tokens", "KV peak / pool", "steps / batch", "ms / step",
         "decode | mixed steps", "run ahead", "graph prefills", "ms decode | mixed", "host ms decode | mixed", "pure step B x ctx",
         "pure ms", "step / pure", "pure same rows ms", "step / same rows"], labels=2)
    for r in res["results"]:
        speedup = "-" if r["speedup_vs_bf16_sync"] is None else (
            f"{r['speedup_vs_bf16_sync']:.2f}x [{r['speedup_min']:.2f}-{r['speedup_max']:.2f}]")
        table.add_row(
            r["format"], r["mode"], f"{r['rollout_s']:.3f} [{r['rollout_s_min']:.3f}-{r['rollout_s_max']:.3f}]",
            speedup, f"{r['tokens_per_s']:,.0f}", f"{r['slot_util']:.3f}", f"{r['mean_active']:.1f}",
            str(r["preemptions"]), f"{r['pool_tokens']:,}", f"{r['kv_peak_bytes'] / r['pool_bytes']:.0%}",
            f"{r['steps_per_batch']:.1f}", f"{r['step_ms']:.2f}",
            " | ".join("-" if r.get(k) is None else f"{r[k]:.1f}" for k in ("decode_steps_per_batch", "mixed_steps_per_batch")),
            "-" if r.get("steps_ahead_per_batch") is None else f"{r['steps_ahead_per_batch']:.1f}",
            "-" if r.get("graph_prefills_per_batch") is None else f"{r['graph_prefills_per_batch']:.1f}",
            " | ".join("-" if r.get(k) is None else f"{r[k]:.2f}" for k in ("decode_step_ms", "mixed_step_ms")),
            " | ".join("-" if r.get(k) is None else f"{r[k]:.2f}" for k in ("decode_host_ms", "mixed_host_ms")),
            f"{r['pure_step_batch']} x {r['pure_step_context']}" if "pure_step_batch" in r else "-",
            "-" if r.get("pure_step_ms") is None else f"{r['pure_step_ms']:.2f}",
            "-" if r.get("step_vs_pure") is None else f"{r['step_vs_pure']:.2f}x",
            "-" if r.get("pure_rows_ms") is None else f"{r['pure_rows_ms']:.2f}",
            "-" if r.get("step_vs_pure_rows") is None else f"{r['step_vs_pure_rows']:.2f}x")
    return table


def iteration_table(res: dict) -> ResultTable:
    w = res["workload"]
    gib = lambda n: "-" if n is None else f"{n / 2**30:.1f}"
    table = ResultTable(
        f"RL iteration: {res['model']} (random init) on {res['gpu'] or res['device']}, engine + learner on one "
        f"device, {'sleep/wake' if res['sleep'] else 'no sleep'} — {w['quota_groups']} groups x {w['group_size']}, "
        f"{w['max_slots']} slots, prompt {w['prompt_len']}, lengths log-normal median {w['median_len']} sigma "
        f"{w['sigma']:g} max {w['max_len']}; mean seconds of {res['iterations']} iterations after a warm-up",
        ["arm", "s / iter", *res["phases"], "speedup", "tokens / iter", "trained tok/s (vs first)", "peak GiB",
         "pool GiB"], labels=1)
    rate = lambda r: r["tokens_per_iteration"] / r["seconds_per_iteration"]  # also for JSON saved before the key
    for r in res["results"]:
        table.add_row(r["arm"], f"{r['seconds_per_iteration']:.3f}", *[f"{r['phases'][p]:.3f}" for p in res["phases"]],
                      f"{r['speedup_vs_first']:.2f}x", f"{r['tokens_per_iteration']:,.0f}",
                      f"{rate(r):,.0f} ({rate(r) / rate(res['results'][0]):.2f}x)",
                      gib(r["peak_memory_bytes"]), gib(r["pool_bytes_awake"]))
    return table


def decode_forward_table(res: dict, fused_ops: bool) -> ResultTable:
    tp = max(r.get("tensor_parallel", 1) for r in res["results"]) if res["results"] else 1
    extra = ["TP1 ms", f"TP{tp} vs TP1"] if tp > 1 else []
    merged = any(r.get("merge_projections") for r in res["results"])
    from kv4rl.engine.fp8_linear import MAX_DECODE_ROWS

    fp8_names = {"triton": f"FP8 product Triton e4m3 up to {MAX_DECODE_ROWS} tokens", "scaled_mm": "FP8 product scaled_mm"}
    fp8 = "".join(f", {fp8_names[p]}" for p in sorted({r.get("fp8_gemm") for r in res["results"]} - {None}))
    fp8 += ", FP8 inputs from the norms and SwiGLU" if any(r.get("fp8_inputs") for r in res["results"]) else ""
    table = ResultTable(f"whole-model decode step on {res['device']} (random-init weights, CUDA graph"
                        f"{', fused ops' if fused_ops else ''}{', merged projections' if merged else ''}{fp8}"
                        f"{f', tensor parallel {tp}' if tp > 1 else ''})",
                        ["shape", "workload", "weights", "kv", "batch x context", "ms/step", "tokens/s",
                         "vs bf16/bf16", "of byte roofline", *extra], labels=4)
    for r in res["results"]:
        cells = ([f"{r['tp1_ms']:.2f}", f"{r['speedup_vs_tp1']:.2f}x"] if r.get("speedup_vs_tp1") is not None
                 else ["-", "-"]) if tp > 1 else []
        roof = "-" if r.get("of_roofline") is None else f"{r['of_roofline']:.0%} of {r['roofline_ms']:.2f} ms"
        if r["ms"] is None:  # out of memory: said in the row, the other workloads measured
            table.add_row(r["shape"], r["workload"], r["weights"], r["kv"], f"{r['batch']} x {r['context']}",
                          "does not fit", "-", "-", r.get("does_not_fit", "-"), *cells)
            continue
        vs = "-" if r["speedup_vs_bf16"] is None else f"{r['speedup_vs_bf16']:.2f}x"
        table.add_row(r["shape"], r["workload"], r["weights"], r["kv"], f"{r['batch']} x {r['context']}",
                      f"{r['ms']:.2f}", f"{r['tokens_per_s']:,.0f}", vs, roof, *cells)
    return table


def learner_table(res: dict) -> ResultTable:
    w = res["workload"]
    longest = max(res["sequence_lengths"], default=0)
    alone = (f", a longer row (up to {longest:,}) alone" if longest > res["max_tokens_per_micro_batch"] else "")
    work = (f"{res['num_seqs']} x {w['seq_len']} tokens" if w["kind"] == "uniform" else
            f"{res['num_seqs']} responses after {w['prompt_len']}-token prompts, log-normal median "
            f"{w['median_len']} sigma {w['sigma']:g} max {w['max_len']}")
    table = ResultTable(
        f"learner step: {res['shape']} on {res['gpu'] or res['device']} — {work}; {res['tokens']:,} real tokens, "
        f"padded width {res['padded_width']}; micro-batches of {res['micro_batch_size']} rows (padded) or "
        f"<= {res['max_tokens_per_micro_batch']:,} tokens (packed{alone}); mean of {res['steps']} steps after a "
        f"warm-up{'' if res['gpu'] else '; MFU only on a GPU (its peak is an H100/H200 figure)'}",
        ["layout", "attention", "ckpt", "ref", "fused", "compiled", "logprob head", "micro-batches", "padding", "s / step",
         "tokens/s", "MFU", "MFU vs 780T", "peak GiB"], labels=7)
    for r in res["results"]:
        timed = "step_s" in r
        table.add_row(
            r["layout"], r.get("attention", "sdpa"), "on" if r["checkpointing"] else "off", "on" if r["reference"] else "off",
            "on" if r.get("fuse_elementwise") else "off", "on" if r.get("compile_layers") else "off",
            "triton" if r.get("fused_logprobs") else "torch", str(r["micro_batches"]), f"{r['padding_fraction']:.1%}",
            f"{r['step_s']:.3f}" if timed else r["error"], f"{r['tokens_per_s']:,.0f}" if timed else "-",
            f"{r['mfu']:.1%}" if timed and res["gpu"] else "-", f"{r['mfu_780']:.1%}" if timed and res["gpu"] else "-",
            "n/a" if not timed or r["peak_gib"] is None else num(r["peak_gib"]))
    return table
