"""`kv4rl bench generate`: engine decode throughput against transformers' `generate`, same weights.

One random-init model of a real shape: transformers builds and initialises it on the device, and the
engine's decoder gets a copy of those very weights (HF parameter names), so both sample from the same
distribution over the same random prompts. Every sequence generates exactly `new_tokens` tokens (the
engine ignores EOS, transformers gets `min_new_tokens = max_new_tokens`; the random model has no EOS
anyway), so the two do the same work. Each system is warmed up once with a short run of the largest
batch, then every batch size is timed on its own (CUDA synchronised around it).

transformers runs first and is freed before the engines start, so each peak-memory figure holds one
system only: its weights, its KV cache and its activations. The engines of the KV formats share one
decoder, one after another.
"""

from __future__ import annotations

import copy
import gc
import time

import torch

from kv4rl.bench.random_model import decoder_from_hf, qwen3_args, random_decoder, random_hf_qwen3
from kv4rl.bench.roofline import copy_bandwidth, roofline_ms, weight_bytes_per_step
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.placement import resolve_device
from kv4rl.engine.sequence import SamplingParams

WARMUP_TOKENS = 4
PAD_TOKEN_ID = 0


def random_prompts(vocab: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + batch)
    return torch.randint(0, vocab, (batch, prompt_len), generator=generator).tolist()


class _Timer:
    """Wall time and peak allocated bytes of a block, CUDA synchronised at both ends."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self.t0
        self.peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.inference_mode()
def _hf_generate(model, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    ids = torch.tensor(prompts, device=model.device)
    return model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=PAD_TOKEN_ID,
    )


def run_hf(model, prompts_by_batch: dict[int, list[list[int]]], new_tokens: int, device: torch.device,
           repeats: int = 1) -> dict:
    """transformers `generate` per batch size: produced tokens, seconds, peak memory. With `repeats` > 1
    each batch runs that many times in turn (all batches, then again), and the row has the median rate
    with its range (`hf_tokens_per_s_min`, `_max`): transformers' rate has varied by a third between
    runs of the same command, so one timing cannot decide a ratio against it. `repeats` is odd: the row is
    the median run itself."""
    if repeats < 1 or repeats % 2 == 0:
        raise ValueError(f"repeats must be odd and >= 1 (the row is the median run), got {repeats}")
    for prompts in prompts_by_batch.values():  # every batch's shapes once (one-time per-shape library costs)
        _hf_generate(model, prompts, min(new_tokens, WARMUP_TOKENS))
    runs: dict[int, list[dict]] = {batch: [] for batch in prompts_by_batch}
    for _ in range(repeats):
        for batch, prompts in prompts_by_batch.items():
            with _Timer(device) as t:
                out = _hf_generate(model, prompts, new_tokens)
            tokens = out.shape[0] * (out.shape[1] - len(prompts[0]))
            runs[batch].append({"hf_tokens": tokens, "hf_s": t.seconds, "hf_tokens_per_s": tokens / t.seconds,
                                "hf_peak_gib": t.peak_gib})
    rows = {}
    for batch, timed in runs.items():
        by_rate = sorted(timed, key=lambda r: r["hf_tokens_per_s"])
        rows[batch] = dict(by_rate[len(by_rate) // 2])  # the median run
        if repeats > 1:
            rows[batch].update(hf_repeats=repeats, hf_tokens_per_s_min=by_rate[0]["hf_tokens_per_s"],
                               hf_tokens_per_s_max=by_rate[-1]["hf_tokens_per_s"])
    return rows


def _kv_bytes_read(engine: Engine, step: dict) -> float:
    """The KV bytes a decode step's attention reads over every layer (`KVFormat.bytes_read`): each row
    attends to its context before the token the step sampled, which the step record counts in. At the
    mean context: exact while every sequence holds at least KV4's protected rows, or all the same context
    (a benchmark's equal prompts, EOS ignored). `bench decode-forward` and `bench decode-attn` count the
    same bytes. Before 2026-12-06 this roofline took the record's `kv_bytes` (one token more per row, and
    KV4's INT8 rows spread over `max_model_len`: up to ~6% more bytes at 1.7B 256 x 256)."""
    a = engine.args
    read = engine.kv_format.bytes_read(a.num_kv_heads, a.head_dim, step["context_mean"] - 1)
    return step["batch_size"] * a.num_layers * read


def run_engine(engine: Engine, prompts_by_batch: dict[int, list[list[int]]], new_tokens: int,
               seed: int, bandwidth: float | None = None) -> dict:
    """Engine generation per batch size: produced tokens, seconds, steps, decode step time and its host
    part (latency minus the wait for the device: scheduling, inputs, launches, bookkeeping; the GPU
    idles for at least part of it), the time of the steps that carry prompt tokens (`prefill_s`,
    `prefill_steps`, `prefill_tokens`), peak memory. With `bandwidth` (bytes/s), also the decode steps'
    mean byte roofline (`kv4rl.bench.roofline`: the weights plus the KV each step's attention reads,
    `_kv_bytes_read`) and the fraction of it they reach (`decode_of_roofline`)."""
    # every batch once, so its prefill shapes and decode graph bucket pay their one-time costs (graph capture,
    # first use of a shape by the libraries) here: warming only the largest left something in the first timed
    # batch of a process (BF16's B64 prefill 0.39-0.62 s against 0.08-0.12 s for the formats timed after it,
    # 2026-12-02; which one-time cost it was is not measured)
    for prompts in prompts_by_batch.values():
        engine.generate(prompts, SamplingParams(max_tokens=min(new_tokens, WARMUP_TOKENS), ignore_eos=True, seed=seed))
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=seed)
    weights = weight_bytes_per_step(engine.model) if bandwidth is not None else None
    rows = {}
    for batch, prompts in prompts_by_batch.items():
        steps: list[dict] = []
        preempted = engine.num_preemptions
        with _Timer(engine.device) as t:
            completions = engine.generate(prompts, params, progress=lambda _, steps=steps: steps.append(dict(engine.last_step)))
        tokens = sum(len(c.token_ids) for c in completions)
        decode_steps = [s for s in steps if s["new_tokens"] == s["batch_size"]]  # no prompt token
        decode = [s["latency_s"] for s in decode_steps]
        host = [s["latency_s"] - s["wait_s"] for s in decode_steps]
        prefill = [s for s in steps if s["prefill_tokens"]]  # steps carrying prompt tokens (with decodes or not)
        decode_ms = 1e3 * sum(decode) / len(decode) if decode else None
        roof = None
        if weights is not None and decode_steps:
            roof = sum(roofline_ms(weights, _kv_bytes_read(engine, s), bandwidth) for s in decode_steps) / len(decode_steps)
        rows[batch] = {
            "engine_tokens": tokens, "engine_s": t.seconds, "engine_tokens_per_s": tokens / t.seconds,
            "engine_steps": len(steps), "decode_steps": len(decode),
            "decode_step_ms": decode_ms,
            "decode_host_ms": 1e3 * sum(host) / len(host) if host else None,
            "prefill_steps": len(prefill), "prefill_tokens": sum(s["prefill_tokens"] for s in prefill),
            "prefill_s": sum(s["latency_s"] for s in prefill),
            "preemptions": engine.num_preemptions - preempted, "engine_peak_gib": t.peak_gib,
            "decode_roofline_ms": roof,
            "decode_of_roofline": roof / decode_ms if roof is not None else None,
        }
    return rows


def check_variants(schedulings: list[str], weight_formats: list[str]) -> None:
    """Refuse scheduling and weight-format lists the bench cannot time (ValueError naming the option)."""
    unknown = sorted(set(schedulings) - {"sync", "async", "auto"})
    if not schedulings or unknown:
        raise ValueError(f"--scheduling: {', '.join(unknown) or 'nothing'} given; choose from sync, async, auto")
    if "auto" in schedulings and len(schedulings) > 1:
        raise ValueError("--scheduling: auto (the engine's own choice) goes alone; name sync,async to time both")
    unknown = sorted(set(weight_formats) - {"auto", "fp8"})
    if not weight_formats or unknown or len(set(weight_formats)) < len(weight_formats):
        raise ValueError(f"--weight-format: {', '.join(unknown) or 'nothing or a repeat'} given; choose from auto, fp8")


def check_hf_repeats(hf: bool, hf_repeats: int) -> None:
    """--hf-repeats times transformers: an odd count (the ratio is to the median run; an even count has none, and
    took the slower middle), and only where transformers runs at all (with --no-hf it applied to nothing)."""
    if hf_repeats % 2 == 0:
        raise ValueError(f"--hf-repeats {hf_repeats}: give an odd count, so that one run is the median the speedup "
                         f"is taken over")
    if hf_repeats > 1 and not hf:
        raise ValueError(f"--hf-repeats {hf_repeats} times transformers' generate, which --no-hf leaves out")


def bench_generate(shape: str, *, batch_sizes: list[int], prompt_len: int = 128, new_tokens: int = 256,
                   kv_formats: list[str] = ("bf16",), weight_formats: list[str] = ("auto",), hf: bool = True,
                   device: str = "auto", engine_config: EngineConfig | None = None, seed: int = 0,
                   schedulings: list[str] = ("auto",), bandwidth: float | None = None, progress=None,
                   hf_repeats: int = 1) -> dict:
    """Tokens/s of the engine (each KV format, each of `schedulings`: `sync`, `async` for
    `engine.async_scheduling`, or `auto` alone for the engine's own choice, named in the rows as what it
    resolved to) and of transformers on the same model and prompts; an async row also has its ratio to
    the sync row of its format and batch when both ran (`speedup_vs_sync`). With more than one of
    `weight_formats` (`auto`: the model's dtype; `fp8`: `engine.weight_format=fp8`), every engine row
    runs once per weight format on the same model and prompts, and an fp8 row has its ratio to the `auto`
    row of its KV format, scheduling and batch (`speedup_vs_auto_weights`).

    `engine_config` supplies other engine settings; unless it sets `max_model_len`, that is
    `prompt_len + new_tokens`. `hf_repeats` times transformers that many times per batch (`run_hf`), and
    `speedup` is over the median. The model is bf16 on CUDA and float32 on CPU. `bandwidth` (bytes/s) sets
    the byte roofline's rate; by default the device's measured one (`roofline.copy_bandwidth`), if any.
    """
    check_variants(schedulings, weight_formats)
    if not batch_sizes or min(batch_sizes) < 1 or prompt_len < 1 or new_tokens < 1 or hf_repeats < 1:
        raise ValueError("--batch-sizes, --prompt-len, --new-tokens and --hf-repeats must be >= 1")
    note = progress or (lambda message: None)
    dev = resolve_device(device)
    bandwidth = bandwidth or copy_bandwidth(dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    args = qwen3_args(shape)
    prompts = {b: random_prompts(args.vocab_size, b, prompt_len, seed) for b in batch_sizes}
    hf_rows: dict[int, dict] = {}
    if hf:
        import transformers

        note(f"transformers {transformers.__version__}: building {shape} on {dev}")
        hf_model = random_hf_qwen3(shape, dev, dtype=dtype, seed=seed, pad_token_id=PAD_TOKEN_ID)
        hf_rows = run_hf(hf_model, prompts, new_tokens, dev, hf_repeats)
        decoder = decoder_from_hf(hf_model)
        del hf_model
        _free(dev)
    else:
        decoder = random_decoder(shape, dev, dtype=dtype, seed=seed)
    results, summaries = [], {}
    for weights in weight_formats:
        for fmt in kv_formats:
            for scheduling in schedulings:
                engine = _engine(decoder, engine_config, weights, fmt, scheduling, prompt_len + new_tokens,
                                 max(batch_sizes), seed)
                scheduling = "async" if engine.async_scheduling else "sync"
                label = " ".join([f"{weights} weights"] * (len(weight_formats) > 1) + [fmt]
                                 + [scheduling] * (len(schedulings) > 1))
                summaries[label] = engine.summary
                note(engine.summary)
                for batch, row in run_engine(engine, prompts, new_tokens, seed, bandwidth).items():
                    results.append({"weight_format": weights, "kv_format": fmt, "scheduling": scheduling,
                                    "batch_size": batch, **row, **hf_rows.get(batch, {})})
                    note(f"{label} batch {batch}: {row['engine_tokens_per_s']:.0f} tokens/s")
                del engine
                _free(dev)
    _add_ratios(results)
    return {
        "shape": shape,
        "model_shape": {"layers": args.num_layers, "hidden": args.hidden_size, "heads": args.num_heads,
                        "kv_heads": args.num_kv_heads, "head_dim": args.head_dim, "vocab": args.vocab_size},
        "prompt_len": prompt_len, "new_tokens": new_tokens, "weight_formats": list(weight_formats),
        "device": str(dev), "dtype": str(dtype).removeprefix("torch."), "seed": seed,
        "roofline_bandwidth_bytes_per_s": bandwidth,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "engine_summaries": summaries, "results": results,
    }


def _engine(decoder, engine_config: EngineConfig | None, weights: str, fmt: str, scheduling: str,
            max_model_len: int, max_num_seqs: int, seed: int) -> Engine:
    """An engine on `decoder` with these weights, KV format and scheduling, the other settings from
    `engine_config` (its `max_model_len` if set)."""
    cfg = copy.deepcopy(engine_config) if engine_config is not None else EngineConfig()
    cfg.kv.format = fmt
    cfg.weight_format = weights
    cfg.max_model_len = cfg.max_model_len or max_model_len
    cfg.async_scheduling = {"sync": False, "async": True, "auto": "auto"}[scheduling]
    return Engine.from_model(decoder, cfg, max_num_seqs=max_num_seqs, seed=seed)


def _add_ratios(rows: list[dict]) -> None:
    """Each row's tokens/s over transformers' (`speedup`), over the sync row of its weights, KV format and
    batch (`speedup_vs_sync`), over the `auto`-weights row of its KV format, scheduling and batch
    (`speedup_vs_auto_weights`), and over the bf16-cache row of its weights, scheduling and batch
    (`speedup_vs_bf16_kv`); None where that row did not run or is the row itself."""
    rate = {(r["weight_format"], r["kv_format"], r["scheduling"], r["batch_size"]): r["engine_tokens_per_s"]
            for r in rows}
    for r in rows:
        own = r["engine_tokens_per_s"]
        r["speedup"] = own / r["hf_tokens_per_s"] if "hf_tokens_per_s" in r else None
        sync = rate.get((r["weight_format"], r["kv_format"], "sync", r["batch_size"]))
        r["speedup_vs_sync"] = own / sync if sync and r["scheduling"] != "sync" else None
        auto = rate.get(("auto", r["kv_format"], r["scheduling"], r["batch_size"]))
        r["speedup_vs_auto_weights"] = own / auto if auto and r["weight_format"] != "auto" else None
        bf16 = rate.get((r["weight_format"], "bf16", r["scheduling"], r["batch_size"]))
        r["speedup_vs_bf16_kv"] = own / bf16 if bf16 and r["kv_format"] != "bf16" else None
