"""`kv4rl bench …`: measurements of the rollout engine, printed as a table and written as JSON.

- `fidelity` (SPEC §6): shared-prefix conditional KL of each KV-cache format against a reference
  cache, top-1 agreement and bytes per token. The numbers come from `kv4rl.bench.fidelity`.
- `pool`: tokens the KV pool holds in a memory budget per format (`kv4rl.bench.pool`).
- `generate`: engine tokens/s against transformers' `generate` on one random-init model
  (`kv4rl.bench.generate`).
- `iteration`: seconds per RL iteration split by phase, per KV format x rollout mode x weight format,
  engine and learner on one device (`kv4rl.bench.iteration`).
- `learner`: learner step tokens/s, MFU and peak memory, padded vs packed, with/without activation
  checkpointing and the reference forward (`kv4rl.bench.learner`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from typer import Option

from kv4rl.cli_common import (
    check_at_least,
    check_device,
    check_kv_formats,
    check_output_path,
    console,
    engine_config,
    fail,
    option_list,
    write_json,
)
from kv4rl.telemetry.progress import StageProgress
from kv4rl.bench.tables import (
    decode_attn_table,
    decode_forward_table,
    fidelity_table,
    generate_table,
    iteration_table,
    learner_table,
    pool_table,
    rollout_table,
)
from kv4rl.telemetry.tables import print_table

bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks of the rollout engine.")

ALL_FORMATS = "bf16,fp8,int4,kv4,nvfp4,mxfp4"


def _check_fidelity_options(formats: str, allocations: str | None, reference: str, n: int,
                            max_new_tokens: int | None, batch_size: int, context: int, template: str | None,
                            random_layers: int | None) -> list[str]:
    """The --formats list, after refusing any bad option before a model is built or loaded."""
    from kv4rl.bench.fidelity import parse_allocations
    from kv4rl.data.prompts import check_template

    check_at_least(1, ("--n", n), ("--batch-size", batch_size), ("--context", context),
                   ("--max-new-tokens", max_new_tokens), ("--random-layers", random_layers))
    format_list = option_list(formats, "--formats")
    check_kv_formats(format_list, "--formats")
    check_kv_formats([reference], "--reference")
    if allocations is not None:
        parse_allocations(allocations)
    if template is not None:
        check_template(template, "--template")
    return format_list


@bench_app.command()
def fidelity(
    model: Annotated[Path | None, Option(
        "--model", help="HF checkpoint folder (default: embedded tiny model)")] = None,
    random_init: Annotated[str | None, Option(
        "--random-init", help="use a random-init model of this shape instead (qwen3-0.6b)")] = None,
    random_layers: Annotated[int | None, Option(
        "--random-layers", help="layers of the --random-init model (default: the shape's)")] = None,
    data: Annotated[Path | None, Option(
        "--data", help="JSONL with problem rows (default: embedded task)")] = None,
    formats: Annotated[str, Option("--formats", help="comma-separated KV formats to measure")] = ALL_FORMATS,
    allocations: Annotated[str | None, Option(
        "--allocations", help="kv4 SINK+RECENT allocations, e.g. 16+128,0+144 (default: 16+128, or the same "
                              "1:8 split over a quarter of a context too short for it)")] = None,
    reference: Annotated[str, Option(
        "--reference", help="KV format the responses are sampled with")] = "bf16",
    n: Annotated[int, Option("--n", help="number of prompts")] = 16,
    max_new_tokens: Annotated[int | None, Option(
        "--max-new-tokens", help="response length (default: 256, capped by the model's context)")] = None,
    temperature: Annotated[float, Option("--temperature")] = 1.0,
    ignore_eos: Annotated[bool, Option(
        "--ignore-eos/--stop-at-eos", help="sample every response to its full length, or stop at EOS",
    )] = True,
    group_size: Annotated[int | None, Option(
        "--group-size", help="int4/kv4 group (default: 128, or head_dim if smaller)")] = None,
    rotate: Annotated[str, Option("--rotate", help="auto (k for kv4, none otherwise), none, k, kv")] = "auto",
    block_size: Annotated[int, Option("--block-size")] = 16,
    context: Annotated[int, Option(
        "--context", help="context length at which bytes/token are stated")] = 8192,
    batch_size: Annotated[int, Option("--batch-size", help="sequences teacher-forced together")] = 16,
    template: Annotated[str | None, Option("--template", help="prompt template with {problem}")] = None,
    device: Annotated[str, Option("--device")] = "auto",
    dtype: Annotated[str, Option("--dtype", help="model dtype (auto: bf16 on CUDA, fp32 on CPU)")] = "auto",
    seed: Annotated[int, Option("--seed")] = 0,
    json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
    verbose: Annotated[bool, Option("--verbose", "-v")] = False,
) -> None:
    """Shared-prefix conditional KL of each KV format against the reference cache (SPEC §6)."""
    from kv4rl.bench.fidelity import (
        build_variants,
        default_allocation,
        fidelity_prompts,
        kl_order,
        parse_allocations,
        run_fidelity,
    )
    from kv4rl.engine.config import KVConfig
    from kv4rl.models.hf_weights import check_model_folder

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        if model is not None and random_init is not None:
            raise ValueError("pass either --model or --random-init, not both")
        format_list = _check_fidelity_options(formats, allocations, reference, n, max_new_tokens, batch_size,
                                              context, template, random_layers)
        check_at_least(0, ("--temperature", temperature))
        check_device(device)
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype: '{dtype}' is not auto, float32, bfloat16 or float16")
    except ValueError as exc:
        fail(str(exc))
    check_output_path(json_out)
    try:
        if random_init is not None:
            from kv4rl.bench.random_model import random_model_dir

            with console.status(f"building random-init {random_init}"):
                model = random_model_dir(random_init, random_layers, seed)
        elif model is None:
            from kv4rl.models.tiny import tiny_model_dir

            model = tiny_model_dir()
        args = check_model_folder(model)
        prompts, template = fidelity_prompts(model, data, n, template, seed, args.max_position_embeddings)
        room = args.max_position_embeddings - max(len(p) for p in prompts)
        max_new_tokens = max_new_tokens or min(256, room)
        kv = KVConfig(block_size=block_size, group_size=group_size or min(128, args.head_dim), rotate=rotate)
        kv.validate()
        context_len = max(len(p) for p in prompts) + max_new_tokens
        budgets = parse_allocations(allocations) if allocations else [default_allocation(context_len)]
        variants = build_variants(format_list, budgets)
        with StageProgress(console, "fidelity") as stages:  # one stage to sample, then one per variant
            res = run_fidelity(model, prompts, variants, reference=reference, kv=kv,
                               max_new_tokens=max_new_tokens,
                               temperature=temperature, ignore_eos=ignore_eos, seed=seed, context_len=context,
                               device=device, dtype=dtype, batch_size=batch_size,
                               progress=stages.counted(1 + len(variants)))
    except ValueError as exc:
        fail(str(exc))
    print_table(console, fidelity_table(res))
    console.print(f"KL order: {kl_order(res['results'])}")
    write_json({**res, "data": str(data) if data else "embedded", "template": template, "seed": seed}, json_out)


@bench_app.command()
def pool(
    engine_overrides: Annotated[list[str] | None, typer.Argument(
        help="engine.kv settings, e.g. engine.kv.group_size=64 engine.kv.n_recent=256")] = None,
    shape: Annotated[str, Option("--shape", help="model shape (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b)")]
    = "qwen3-8b",
    memory_gib: Annotated[float, Option("--memory-gib", help="memory given to the KV pool")] = 40.0,
    formats: Annotated[str, Option("--formats", help="comma-separated KV formats")] = ALL_FORMATS,
    max_num_seqs: Annotated[int, Option(
        "--max-num-seqs", help="running sequences (KV4 reserves INT8 rows for each)")] = 256,
    context: Annotated[int, Option(
        "--context", help="context over which KV4's per-sequence rows are spread in bytes/token @context")] = 8192,
    json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
) -> None:
    """Tokens the KV pool holds in a memory budget, per format, counted as the engine sizes its pool."""
    from kv4rl.bench.pool import bench_pool
    from kv4rl.bench.random_model import qwen3_args

    try:
        if memory_gib <= 0:
            raise ValueError(f"--memory-gib must be > 0, got {memory_gib}")
        check_at_least(1, ("--max-num-seqs", max_num_seqs), ("--context", context))
        format_list = option_list(formats, "--formats")
        engine_cfg = engine_config(engine_overrides)
        check_kv_formats(format_list, "--formats", engine_cfg, head_dim=_shape_args(shape, qwen3_args).head_dim,
                         max_model_len=context)
    except ValueError as exc:
        fail(str(exc))
    check_output_path(json_out)
    try:
        res = bench_pool(shape, memory_gib=memory_gib, formats=format_list, max_num_seqs=max_num_seqs,
                         context=context, kv=engine_cfg.kv)
    except ValueError as exc:
        fail(str(exc))
    print_table(console, pool_table(res, shape, memory_gib, max_num_seqs, context))
    write_json(res, json_out)


def _shape_args(shape: str, args_of):
    """`args_of(shape)`, with an unknown shape named as the --shape option's fault."""
    try:
        return args_of(shape)
    except ValueError as exc:
        raise ValueError(f"--shape: {exc}") from None


@bench_app.command()
def generate(
    engine_overrides: Annotated[list[str] | None, typer.Argument(
        help="engine settings, e.g. engine.kv.group_size=64 engine.max_num_batched_tokens=32768")] = None,
    shape: Annotated[str, Option("--shape", help="model shape (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b)")]
    = "qwen3-1.7b",
    batch_sizes: Annotated[str, Option("--batch-sizes", help="comma-separated batch sizes")] = "64,256",
    prompt_len: Annotated[int, Option("--prompt-len")] = 128,
    new_tokens: Annotated[int, Option("--new-tokens", help="tokens generated by every sequence")] = 256,
    kv_format: Annotated[str, Option("--kv-format", help="comma-separated engine KV formats")] = "bf16",
    weight_format: Annotated[str, Option("--weight-format", help="engine weights: auto or fp8")] = "auto",
    hf: Annotated[bool, Option("--hf/--no-hf", help="also time transformers' generate")] = True,
    device: Annotated[str, Option("--device")] = "auto",
    seed: Annotated[int, Option("--seed")] = 0,
    json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
) -> None:
    """Engine tokens/s vs transformers' generate on one random-init model, same weights and prompts."""
    from kv4rl.bench.generate import bench_generate
    from kv4rl.bench.random_model import qwen3_args

    try:
        if weight_format not in ("auto", "fp8"):
            raise ValueError(f"--weight-format: '{weight_format}' is not one of auto, fp8")
        sizes = option_list(batch_sizes, "--batch-sizes", int, minimum=1)
        formats = option_list(kv_format, "--kv-format")
        check_at_least(1, ("--prompt-len", prompt_len), ("--new-tokens", new_tokens))
        head_dim = _shape_args(shape, qwen3_args).head_dim
        check_device(device)
        engine_cfg = engine_config(engine_overrides)
        engine_cfg.weight_format = weight_format
        check_kv_formats(formats, "--kv-format", engine_cfg, head_dim=head_dim,
                         max_model_len=engine_cfg.max_model_len or prompt_len + new_tokens, allow_auto=True)
    except ValueError as exc:
        fail(str(exc))
    check_output_path(json_out)
    try:
        # bench_generate says one line as transformers starts, one per built engine, one per timed batch
        messages = int(hf) + len(formats) * (1 + len(sizes))
        with StageProgress(console, "generate") as stages:
            stages(f"{shape}: {len(formats)} KV formats x {len(sizes)} batch sizes", 0, messages)
            res = bench_generate(shape, batch_sizes=sizes, prompt_len=prompt_len, new_tokens=new_tokens,
                                 kv_formats=formats, weight_format=weight_format, hf=hf, device=device,
                                 engine_config=engine_cfg, seed=seed, progress=stages.advance)
    except ValueError as exc:
        fail(str(exc))
    print_table(console, generate_table(res))
    write_json(res, json_out)


def _need_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        fail("this benchmark times GPU kernels and needs a CUDA device")


@bench_app.command("decode-attn")
def decode_attn(
    shapes: Annotated[str, Option("--shapes", help="head shapes: qwen3-1.7b, qwen3-4b, qwen3-8b")] = "qwen3-8b",
    batches: Annotated[str, Option("--batches", help="comma-separated batch sizes")] = "64",
    contexts: Annotated[str, Option("--contexts", help="comma-separated context lengths")] = "2048,4096,8192,16384",
    formats: Annotated[str, Option(
        "--formats", help="KV formats: bf16, fp8, int4, kv4; int4-triton / kv4-triton run the INT4 body in the "
                          "Triton kernel instead of the CUDA one")] = "bf16,fp8,int4,kv4",
    seed: Annotated[int, Option("--seed")] = 0,
    json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
) -> None:
    """One layer's paged decode attention per KV format vs torch SDPA (cuDNN) on contiguous BF16."""
    from kv4rl.bench.decode_attn import FORMATS, HEAD_SHAPES, run_decode_attn

    try:
        shape_list = option_list(shapes, "--shapes", known=list(HEAD_SHAPES))
        fmt_list = option_list(formats, "--formats", known=FORMATS)
        batch_list = option_list(batches, "--batches", int, minimum=1)
        context_list = option_list(contexts, "--contexts", int, minimum=1)
    except ValueError as exc:
        fail(str(exc))
    check_output_path(json_out)
    _need_cuda()
    cases = len(shape_list) * len(batch_list) * len(context_list) * len(fmt_list)
    with StageProgress(console, "decode-attn") as stages:
        stages(f"timing {cases} kernel cases (each also against SDPA)", 0, cases)
        res = run_decode_attn(shape_list, batch_list, context_list, fmt_list, seed=seed, progress=lambda r: stages.advance(
            f"{r['shape']} {r['format']} B{r['batch']} L{r['context']}: {r['ms']:.4f} ms"))
    print_table(console, decode_attn_table(res))
    write_json(res, json_out)


@bench_app.command("decode-forward")
def decode_forward(
    shapes: Annotated[str, Option("--shapes", help="model shapes: qwen3-4b, qwen3-8b, ...")] = "qwen3-8b",
    workloads: Annotated[str, Option(
        "--workloads", help="early (B256 x 1024), mid (B128 x 4096), late (B64 x 8192)")] = "early,mid,late",
    fused_ops: Annotated[bool, Option(
        "--fused-ops/--no-fused-ops", help="fused norms/RoPE/SwiGLU kernels, as the engine runs on CUDA "
                                           "(engine.fused_ops=auto)")] = True,
    tensor_parallel: Annotated[int, Option(
        "--tensor-parallel", help="shard the model over N GPUs (run under torchrun --nproc-per-node N); "
                                  "rank 0 also times one GPU for the ratio")] = 1,
    json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
) -> None:
    """One whole-model decode step (CUDA graph) for BF16/FP8 weights x BF16/KV4 cache (figure B-9)."""
    from kv4rl.bench.decode_forward import VARIANTS, WORKLOADS, run_decode_forward
    from kv4rl.bench.random_model import QWEN3_SHAPES

    try:
        shape_list = option_list(shapes, "--shapes", known=list(QWEN3_SHAPES))
        work = option_list(workloads, "--workloads", known=list(WORKLOADS))
        check_at_least(1, ("--tensor-parallel", tensor_parallel))
    except ValueError as exc:
        fail(str(exc))
    check_output_path(json_out)
    _need_cuda()
    if tensor_parallel > 1:
        _decode_forward_tp(shape_list, work, fused_ops, tensor_parallel, json_out)
        return
    cases = len(shape_list) * len(VARIANTS) * len(work)
    with StageProgress(console, "decode-forward") as stages:
        stages(f"timing {cases} decode steps", 0, cases)
        res = run_decode_forward(shape_list, work, fused_ops=fused_ops, progress=lambda r: stages.advance(
            f"{r['shape']} {r['workload']} w={r['weights']} kv={r['kv']}: {r['ms']:.2f} ms"))
    print_table(console, decode_forward_table(res, fused_ops))
    write_json(res, json_out)


def _decode_forward_tp(shape_list, work, fused_ops: bool, size: int, json_out) -> None:
    """The tensor-parallel decode step on every rank; rank 0 prints, times one GPU and writes the JSON."""
    import os

    import torch
    import torch.distributed as dist

    from kv4rl.bench.decode_forward import add_tp1_ratio, run_decode_forward
    from kv4rl.models.tensor_parallel import tensor_parallel_group

    if int(os.environ.get("WORLD_SIZE", "1")) != size:
        fail(f"--tensor-parallel {size} runs under torchrun: torchrun --nproc-per-node {size} -m kv4rl.cli "
             f"bench decode-forward --tensor-parallel {size} ...")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    tp = tensor_parallel_group(size)
    res = run_decode_forward(shape_list, work, fused_ops=fused_ops, tp=tp)
    dist.barrier()
    if tp.rank == 0:
        add_tp1_ratio(res, run_decode_forward(shape_list, work, fused_ops=fused_ops))
        print_table(console, decode_forward_table(res, fused_ops))
        write_json(res, json_out)
    dist.barrier()
    dist.destroy_process_group()


@bench_app.command("rollout")
def bench_rollout_cmd(
    engine_overrides: Annotated[list[str] | None, typer.Argument(
        help="engine settings, e.g. engine.gpu_memory_fraction=0.6 engine.kv.group_size=64")] = None,
    shape: Annotated[str | None, Option(
        "--shape", help="random-init model of this shape (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, "
                        "qwen3-tiny for tests)")] = None,
    model: Annotated[Path | None, Option(
        "--model", help="HF checkpoint folder (default without --shape: embedded tiny model)")] = None,
    formats: Annotated[str, Option("--formats", help="comma-separated KV formats")] = "bf16,kv4",
    modes: Annotated[str, Option("--modes", help="comma-separated rollout modes: sync, partial")] = "sync,partial",
    repeats: Annotated[int, Option("--repeats", help="timed repeats per format and mode, after a warm-up")] = 3,
    batches: Annotated[int, Option("--batches", help="learner batches timed in each repeat")] = 1,
    kv_budget_gib: Annotated[float | None, Option(
        "--kv-budget-gib", help="KV pool of every format in GiB (default: engine.gpu_memory_fraction on CUDA, "
                                "every slot at full length elsewhere)")] = None,
    quota: Annotated[int, Option("--quota-groups", help="prompt groups per learner batch")] = 8,
    group: Annotated[int, Option("--group-size", help="responses per prompt")] = 4,
    slots: Annotated[int, Option("--max-slots", help="decode slots (engine max_num_seqs)")] = 16,
    prompt_len: Annotated[int, Option("--prompt-len")] = 16,
    median_len: Annotated[int, Option("--median-len", help="median response length")] = 8,
    sigma: Annotated[float, Option("--sigma", help="log-normal tail of response lengths")] = 1.0,
    max_len: Annotated[int, Option("--max-len", help="longest response")] = 40,
    device: Annotated[str, Option("--device")] = "auto",
    seed: Annotated[int, Option("--seed")] = 0,
    json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
    png: Annotated[Path | None, Option(
        "--png", help="figure: active sequences and KV in use over time, per format and mode")] = None,
    validate_only: Annotated[bool, Option(
        "--validate-only", help="check the options and print each pool, then stop before any work")] = False,
) -> None:
    """Seconds per learner batch for each KV format x rollout mode at one KV memory budget."""
    from kv4rl.bench.rollout import RolloutBench, Workload, bench_rollout, prepare
    from kv4rl.config_loader import parse_override

    try:
        overrides = engine_overrides or []
        bench = RolloutBench(
            formats=tuple(option_list(formats, "--formats")), modes=tuple(option_list(modes, "--modes")), repeats=repeats, batches=batches,
            workload=Workload(quota_groups=quota, group_size=group, max_slots=slots, prompt_len=prompt_len,
                              median_len=median_len, sigma=sigma, max_len=max_len, seed=seed),
            shape=shape, model_dir=model, kv_budget_gib=kv_budget_gib, device=device,
            engine=engine_config(overrides), engine_keys=frozenset(".".join(parse_override(o)[0]) for o in overrides))
        plan = prepare(bench)
    except ValueError as exc:
        fail(str(exc))
    if not validate_only:
        check_output_path(json_out, "--json")
        check_output_path(png, "--png")
    for fmt in bench.formats:
        console.print(f"[dim]{plan.pool_line(fmt)}[/]", highlight=False, soft_wrap=True)
    if validate_only:
        console.print("options valid; stopping before any work (--validate-only)")
        return
    with StageProgress(console, "rollout") as stages:  # a stage per warm-up and timed repeat of each corner
        res, traces = bench_rollout(plan, progress=lambda what, done: stages(what, done, 1))
    print_table(console, rollout_table(res))
    write_json(res, json_out)
    if png is not None:
        from kv4rl.telemetry.plots import plot_rollout_corners

        pools = {r["format"]: r["pool_bytes"] for r in res["results"]}
        console.print(f"wrote {plot_rollout_corners(traces, pools, png)}")


@bench_app.command("iteration")
def bench_iteration_cmd(
    engine_overrides: Annotated[list[str] | None, typer.Argument(
        help="engine settings, e.g. engine.gpu_memory_fraction=0.8 engine.max_num_batched_tokens=32768")] = None,
    shape: Annotated[str, Option(
        "--shape", help="random-init model of this shape (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, "
                        "qwen3-tiny for tests)")] = "qwen3-1.7b",
    arms: Annotated[str, Option(
        "--arms", help="comma-separated arms, each KV format + rollout mode [+ fp8w for FP8 engine weights], "
                       "e.g. bf16+sync,kv4+partial,fp8w+kv4+partial; speedups are against the first")]
    = "bf16+sync,kv4+partial",
    iterations: Annotated[int, Option("--iterations", help="timed iterations per arm, after one warm-up")] = 2,
    quota: Annotated[int, Option("--quota-groups", help="prompt groups per learner batch")] = 16,
    group: Annotated[int, Option("--group-size", help="responses per prompt")] = 8,
    slots: Annotated[int | None, Option(
        "--max-slots", help="decode slots (default: quota-groups x group-size)")] = None,
    prompt_len: Annotated[int, Option("--prompt-len")] = 128,
    median_len: Annotated[int, Option("--median-len", help="median response length")] = 1024,
    sigma: Annotated[float, Option("--sigma", help="log-normal tail of response lengths")] = 1.0,
    max_len: Annotated[int, Option("--max-len", help="longest response")] = 8192,
    micro_batch_size: Annotated[int, Option(
        "--micro-batch-size", help="learner sequences per forward/backward")] = 1,
    grad_checkpointing: Annotated[bool, Option("--grad-checkpointing/--no-grad-checkpointing")] = False,
    lr: Annotated[float, Option("--lr", help="learner learning rate")] = 1e-6,
    sleep: Annotated[bool, Option(
        "--sleep/--no-sleep", help="engine frees its KV pool during the update (engine.sleep_between_rollouts)")]
    = True,
    device: Annotated[str, Option("--device")] = "auto",
    seed: Annotated[int, Option("--seed")] = 0,
    json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
    png: Annotated[Path | None, Option(
        "--png", help="stacked bars of the phases per arm; the CSV behind it goes beside it")] = None,
    validate_only: Annotated[bool, Option(
        "--validate-only", help="check the options, then stop before any work")] = False,
) -> None:
    """Seconds per RL iteration (rollout / reward / update / weight sync / sleep-wake) for each arm."""
    from kv4rl.bench.iteration import IterationBench, bench_iteration, parse_arms, prepare
    from kv4rl.bench.rollout import Workload
    from kv4rl.config_loader import parse_override

    try:
        overrides = engine_overrides or []
        check_at_least(1, ("--max-slots", slots))
        check_device(device)
        bench = IterationBench(
            arms=tuple(parse_arms(arms)), shape=shape, iterations=iterations,
            workload=Workload(quota_groups=quota, group_size=group, max_slots=slots or quota * group,
                              prompt_len=prompt_len, median_len=median_len, sigma=sigma, max_len=max_len, seed=seed),
            micro_batch_size=micro_batch_size, grad_checkpointing=grad_checkpointing, lr=lr, sleep=sleep,
            device=device, engine=engine_config(overrides),
            engine_keys=frozenset(".".join(parse_override(o)[0]) for o in overrides))
        configs = prepare(bench)
    except ValueError as exc:
        fail(str(exc))
    if validate_only:
        console.print("options valid; stopping before any work (--validate-only)")
        return
    check_output_path(json_out, "--json")
    check_output_path(png, "--png")
    with StageProgress(console, "iteration") as stages:  # the model folder, then each arm's iterations
        res = bench_iteration(bench, configs, progress=stages.counted(1 + len(bench.arms) * (1 + bench.iterations)))
    for r in res["results"]:
        console.print(f"[dim]{r['arm']}: {r['engine_summary']}[/]", highlight=False, soft_wrap=True)
    print_table(console, iteration_table(res))
    write_json(res, json_out)
    if png is not None:
        from kv4rl.bench.iteration import figure_rows
        from kv4rl.telemetry.plots import plot_iteration_time, write_csv

        rows, w = figure_rows(res), res["workload"]
        title = (f"{res['model']} on {res['gpu'] or res['device']}: seconds per RL iteration by phase\n"
                 f"{w['quota_groups']}x{w['group_size']} responses, lengths median {w['median_len']} max "
                 f"{w['max_len']}, {'sleep/wake' if res['sleep'] else 'no sleep'}")
        console.print(f"wrote {plot_iteration_time(rows, png, title)} and {write_csv(rows, png.with_suffix('.csv'))}")


@bench_app.command("learner")
def bench_learner_cmd(
    shape: Annotated[str, Option(
        "--shape", help="model shape (qwen3-1.7b, qwen3-4b, qwen3-8b; qwen3-tiny for tests)")] = "qwen3-1.7b",
    workload: Annotated[str, Option("--workload", help="uniform (N x L) or lognormal response lengths")]
    = "uniform",
    num_seqs: Annotated[int | None, Option(
        "--num-seqs", help="sequences per step (default: 16 uniform, 32 lognormal)")] = None,
    prompt_len: Annotated[int, Option("--prompt-len", help="prompt tokens of every row")] = 256,
    seq_len: Annotated[int, Option("--seq-len", help="uniform: tokens of every row, prompt included")] = 4096,
    median_len: Annotated[int, Option("--median-len", help="lognormal: median response length")] = 1024,
    sigma: Annotated[float, Option("--sigma", help="lognormal: shape of the length tail")] = 1.0,
    max_len: Annotated[int, Option("--max-len", help="lognormal: longest response")] = 8192,
    micro_batch_size: Annotated[int, Option("--micro-batch-size", help="rows per padded micro-batch")] = 4,
    max_tokens: Annotated[int, Option("--max-tokens", help="tokens per packed micro-batch")] = 16384,
    layouts: Annotated[str, Option("--layouts", help="comma-separated: padded, packed")] = "padded,packed",
    checkpointing: Annotated[str, Option(
        "--checkpointing", help="comma-separated activation checkpointing settings: off, on")] = "off,on",
    reference: Annotated[str, Option(
        "--reference", help="comma-separated reference-forward settings: off, on")] = "off,on",
    steps: Annotated[int, Option("--steps", help="timed steps per variant, after one warm-up step")] = 2,
    device: Annotated[str, Option("--device")] = "auto",
    seed: Annotated[int, Option("--seed")] = 0,
    json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
) -> None:
    """Learner step throughput (real tokens/s, MFU, peak memory) on a random-init model."""
    from kv4rl.bench.learner import LearnerWorkload, bench_learner
    from kv4rl.bench.random_model import qwen3_args
    from kv4rl.engine.llm import resolve_device

    switch = {"off": False, "on": True}
    try:
        _shape_args(shape, qwen3_args)
        work = LearnerWorkload(kind=workload, num_seqs=num_seqs or (32 if workload == "lognormal" else 16),
                               prompt_len=prompt_len, seq_len=seq_len, median_len=median_len, sigma=sigma,
                               max_len=max_len, seed=seed)
        work.validate(_shape_args(shape, qwen3_args).max_position_embeddings)
        check_at_least(1, ("--micro-batch-size", micro_batch_size), ("--max-tokens", max_tokens), ("--steps", steps))
        layout_list = option_list(layouts, "--layouts", known=["padded", "packed"])
        ckpt_list = [switch[v] for v in option_list(checkpointing, "--checkpointing", known=list(switch))]
        ref_list = [switch[v] for v in option_list(reference, "--reference", known=list(switch))]
        check_device(device)
    except ValueError as exc:
        fail(str(exc))
    check_output_path(json_out)
    variants = len(layout_list) * len(ckpt_list) * len(ref_list)
    with StageProgress(console, "learner") as stages:
        res = bench_learner(shape, work, device=resolve_device(device), steps=steps,
                            micro_batch_size=micro_batch_size, max_tokens=max_tokens, layouts=layout_list,
                            checkpointing=ckpt_list, reference=ref_list,
                            progress=lambda what: stages(f"{shape} {workload}: {what} ({variants} variants)"))
    print_table(console, learner_table(res))
    write_json(res, json_out)
