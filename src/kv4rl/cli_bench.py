"""`kv4rl bench …`: measurements of the rollout engine, printed as a table and written as JSON.

- `fidelity` (docs/kv-cache.md): shared-prefix conditional KL of each KV-cache format against a reference
  cache, top-1 agreement and bytes per token. The numbers come from `kv4rl.bench.fidelity`.
- `pool`: tokens the KV pool holds in a memory budget per format (`kv4rl.bench.pool`).
- `generate`: engine tokens/s against transformers' `generate` on one random-init model
  (`kv4rl.bench.generate`).
- `rollout`: rollout collection per KV format x rollout mode at one memory budget.
`decode-attn` and `decode-forward` (the GPU kernels) live in `kv4rl.cli_bench_kernels`, `iteration`
and `learner` (the training side) in `kv4rl.cli_bench_learner`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from typer import Option

from kv4rl.cli_common import (
    setup_logging,
    check_at_least,
    check_device,
    check_temperature,
    check_figure_path,
    check_kv_formats,
    check_not_an_input,
    check_output_path,
    console,
    engine_config,
    fail,
    finite_float,
    option_list,
    shape_args,
    warn_real_shape_off_cuda,
    warn,
    write_json,
    wrote,
)
from kv4rl.cli_bench_kernels import register_kernel_benches
from kv4rl.cli_bench_learner import register_learner_benches
from kv4rl.telemetry.progress import StageProgress
from kv4rl.bench.tables import (
    fidelity_table,
    generate_table,
    pool_table,
    rollout_table,
)
from kv4rl.telemetry.tables import print_table

bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks of the rollout engine.")

ALL_FORMATS = "bf16,fp8,int4,kv4,nvfp4,mxfp4"


def _check_fidelity_options(formats: str, allocations: str | None, reference: str, n: int,
                            max_new_tokens: int | None, batch_size: int, context: int, template: str | None,
                            random_layers: int | None, group_size: int | None) -> list[str]:
    """The --formats list, after refusing any bad option before a model is built or loaded."""
    from kv4rl.bench.fidelity import parse_allocations
    from kv4rl.data.prompts import check_template

    check_at_least(1, ("--n", n), ("--batch-size", batch_size), ("--context", context),
                   ("--max-new-tokens", max_new_tokens), ("--random-layers", random_layers),
                   ("--group-size", group_size))
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
    temperature: Annotated[float, Option("--temperature", parser=finite_float, help="sampling temperature; 0: greedy")] = 1.0,
    ignore_eos: Annotated[bool, Option(
        "--ignore-eos/--stop-at-eos", help="sample every response to its full length, or stop at EOS",
    )] = True,
    group_size: Annotated[int | None, Option(
        "--group-size", help="int4/kv4 group (default: 128, or head_dim if smaller)")] = None,
    rotate: Annotated[str, Option("--rotate", help="auto (k for kv4, none otherwise), none, k, kv")] = "auto",
    block_size: Annotated[int, Option("--block-size", help="tokens per KV block")] = 16,
    context: Annotated[int, Option(
        "--context", help="context length at which bytes/token are stated")] = 8192,
    batch_size: Annotated[int, Option("--batch-size", help="sequences teacher-forced together")] = 16,
    template: Annotated[str | None, Option("--template", help="prompt template with {problem}")] = None,
    device: Annotated[str, Option("--device", help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")] = "auto",
    dtype: Annotated[str, Option("--dtype", help="model dtype (auto: bf16 on CUDA, fp32 on CPU)")] = "auto",
    seed: Annotated[int, Option("--seed", help="random seed (weights, prompts and sampling are a function of it)")] = 0,
    json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
    verbose: Annotated[bool, Option("--verbose", "-v", help="also print the library's info lines")] = False,
) -> None:
    """Shared-prefix conditional KL of each KV format against the reference cache (docs/kv-cache.md)."""
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

    setup_logging(verbose)
    try:
        if model is not None and random_init is not None:
            raise ValueError("pass either --model or --random-init, not both")
        if random_layers is not None and random_init is None:
            raise ValueError("--random-layers sets the layers of a --random-init model; give --random-init too")
        format_list = _check_fidelity_options(formats, allocations, reference, n, max_new_tokens, batch_size,
                                              context, template, random_layers, group_size)
        check_temperature("--temperature", temperature)
        check_device(device)
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype: '{dtype}' is not auto, float32, bfloat16 or float16")
        # the cache options (the group's default comes from the model's head_dim, checked once it is loaded)
        KVConfig(block_size=block_size, group_size=group_size or 128, rotate=rotate).validate()
        if group_size is not None:
            from kv4rl.engine.kv_formats.int4 import check_group_size

            check_group_size(group_size)
    except ValueError as exc:  # named by this command's options, not the engine keys they set
        fail(str(exc).replace("engine.kv.block_size", "--block-size").replace("engine.kv.group_size", "--group-size")
             .replace("engine.kv.rotate", "--rotate"))
    if allocations is not None and "kv4" not in format_list:
        warn("--allocations sets KV4's sink + recent rows; no kv4 in --formats, so it changes nothing")
    check_output_path(json_out)
    check_not_an_input({"--json": json_out}, {"--data": data})
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
    wrote(json_out)


@bench_app.command()
def pool(
    engine_overrides: Annotated[list[str] | None, typer.Argument(
        help="engine.kv settings, e.g. engine.kv.group_size=64 engine.kv.n_recent=256")] = None,
    shape: Annotated[str, Option("--shape", help="model shape (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b)")]
    = "qwen3-8b",
    memory_gib: Annotated[float, Option("--memory-gib", parser=finite_float,
        help="memory given to the KV pool")] = 40.0,
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
        for override in engine_overrides or []:  # the pool is sized from engine.kv alone; others would be ignored
            key = override.split("=", 1)[0].strip()
            if key == "engine.kv.format":
                raise ValueError("engine.kv.format is set by --formats here")
            if not key.startswith("engine.kv."):
                raise ValueError(f"{key}: only engine.kv.* settings shape the pool here (memory by --memory-gib, "
                                 f"sequences by --max-num-seqs, context by --context)")
        check_kv_formats(format_list, "--formats", engine_cfg, head_dim=shape_args(shape, qwen3_args).head_dim,
                         max_model_len=context)
    except ValueError as exc:
        fail(str(exc).replace("the context limit engine.max_model_len=", "--context "))
    check_output_path(json_out)
    try:
        res = bench_pool(shape, memory_gib=memory_gib, formats=format_list, max_num_seqs=max_num_seqs,
                         context=context, kv=engine_cfg.kv)
    except ValueError as exc:
        fail(str(exc))
    print_table(console, pool_table(res, shape, memory_gib, max_num_seqs, context))
    write_json(res, json_out)
    wrote(json_out)


def engine_cfg_sets_context(overrides: list[str] | None) -> bool:
    """Whether `engine.max_model_len` is among the engine overrides (else a bench derives the context)."""
    return any(o.split("=", 1)[0].strip() == "engine.max_model_len" for o in overrides or [])


@bench_app.command()
def generate(
    engine_overrides: Annotated[list[str] | None, typer.Argument(
        help="engine settings, e.g. engine.kv.group_size=64 engine.max_num_batched_tokens=32768")] = None,
    shape: Annotated[str, Option("--shape", help="model shape (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b)")]
    = "qwen3-1.7b",
    batch_sizes: Annotated[str, Option("--batch-sizes", help="comma-separated batch sizes")] = "64,256",
    prompt_len: Annotated[int, Option("--prompt-len", help="prompt tokens per request")] = 128,
    new_tokens: Annotated[int, Option("--new-tokens", help="tokens generated by every sequence")] = 256,
    kv_format: Annotated[str, Option("--kv-format", help="comma-separated engine KV formats")] = "bf16",
    weight_format: Annotated[str, Option(
        "--weight-format", help="comma-separated engine weights: auto (the model's dtype), fp8; with both, fp8 "
                                "rows get their ratio to auto")] = "auto",
    hf: Annotated[bool, Option("--hf/--no-hf", help="also time transformers' generate")] = True,
    hf_repeats: Annotated[int, Option(
        "--hf-repeats", help="time transformers this many times per batch size (odd); the ratio is over the "
                           "median run")] = 1,
    scheduling: Annotated[str, Option(
        "--scheduling", help="comma-separated engine schedulings: sync, async (engine.async_scheduling), or "
                             "auto alone (the engine's default: async on CUDA); async rows get their ratio to sync")] = "auto",
    device: Annotated[str, Option("--device", help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")] = "auto",
    seed: Annotated[int, Option("--seed", help="random seed (weights, prompts and sampling are a function of it)")] = 0,
    json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
) -> None:
    """Engine tokens/s vs transformers' generate on one random-init model, same weights and prompts."""
    from kv4rl.bench.generate import bench_generate, check_hf_repeats, check_variants
    from kv4rl.bench.random_model import qwen3_args

    try:
        weight_formats = option_list(weight_format, "--weight-format", known=("auto", "fp8"))
        sizes = option_list(batch_sizes, "--batch-sizes", int, minimum=1)
        formats = option_list(kv_format, "--kv-format")
        schedulings = option_list(scheduling, "--scheduling", known=("sync", "async", "auto"))
        check_variants(schedulings, weight_formats)
        for key, option in (("engine.async_scheduling", "--scheduling"), ("engine.kv.format", "--kv-format"),
                            ("engine.weight_format", "--weight-format")):
            if any(o.split("=", 1)[0].strip() == key for o in engine_overrides or []):
                raise ValueError(f"{key} is set by {option} here")
        check_at_least(1, ("--prompt-len", prompt_len), ("--new-tokens", new_tokens), ("--hf-repeats", hf_repeats))
        check_hf_repeats(hf, hf_repeats)
        shape_cfg = shape_args(shape, qwen3_args)
        head_dim = shape_cfg.head_dim
        if prompt_len + new_tokens > shape_cfg.max_position_embeddings:
            raise ValueError(f"--prompt-len + --new-tokens = {prompt_len + new_tokens} exceeds the model's context "
                             f"of {shape_cfg.max_position_embeddings} tokens")
        check_device(device)
        engine_cfg = engine_config(engine_overrides)
        if engine_cfg.max_model_len and engine_cfg.max_model_len < prompt_len + new_tokens:  # the engine stops early
            raise ValueError(f"engine.max_model_len={engine_cfg.max_model_len} is below --prompt-len + --new-tokens = "
                             f"{prompt_len + new_tokens}: the engine would stop its sequences early while "
                             f"transformers generates all {new_tokens} tokens, so the rows would time different work")
        for weights in weight_formats:
            engine_cfg.weight_format = weights
            check_kv_formats(formats, "--kv-format", engine_cfg, head_dim=head_dim,
                             max_model_len=engine_cfg.max_model_len or prompt_len + new_tokens, allow_auto=True)
    except ValueError as exc:
        text = str(exc)
        if not engine_cfg_sets_context(engine_overrides):  # the limit came from the options, not engine.max_model_len
            text = text.replace("the context limit engine.max_model_len=", "--prompt-len + --new-tokens = ")
        fail(text)
    check_output_path(json_out, create=False)  # its folders once the bench has run (write_json makes them)
    warn_real_shape_off_cuda(shape, device)
    try:
        # bench_generate says one line as transformers starts, one per built engine, one per timed batch
        engines = len(weight_formats) * len(formats) * len(schedulings)
        messages = int(hf) + engines * (1 + len(sizes))
        with StageProgress(console, "generate") as stages:
            stages(f"{shape}: {len(weight_formats)} weight formats x {len(formats)} KV formats x {len(schedulings)} "
                   f"schedulings x {len(sizes)} batch sizes", 0, messages)
            res = bench_generate(shape, batch_sizes=sizes, prompt_len=prompt_len, new_tokens=new_tokens,
                                 kv_formats=formats, weight_formats=weight_formats, hf=hf, device=device,
                                 engine_config=engine_cfg, seed=seed, schedulings=schedulings,
                                 progress=stages.advance, hf_repeats=hf_repeats)
    except ValueError as exc:
        fail(str(exc))
    print_table(console, generate_table(res))
    write_json(res, json_out)
    wrote(json_out)


@bench_app.command("rollout")
def bench_rollout_cmd(
    engine_overrides: Annotated[list[str] | None, typer.Argument(
        help="engine settings, e.g. engine.gpu_memory_fraction=0.6 engine.kv.group_size=64")] = None,
    shape: Annotated[str | None, Option(
        "--shape", help="random-init model of this shape (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, "
                        "qwen3-tiny for tests)")] = None,
    model: Annotated[Path | None, Option(
        "--model", help="HF checkpoint folder (default without --shape: embedded tiny model)")] = None,
    formats: Annotated[str, Option(
        "--formats", help="comma-separated KV formats, each optionally with its own decode slots "
                          "(kv4@256; default --max-slots)")] = "bf16,kv4",
    modes: Annotated[str, Option("--modes", help="comma-separated rollout modes: sync, partial")] = "sync,partial",
    repeats: Annotated[int, Option("--repeats", help="timed repeats per format and mode, after a warm-up")] = 3,
    batches: Annotated[int, Option("--batches", help="learner batches timed in each repeat")] = 1,
    kv_budget_gib: Annotated[float | None, Option(
        "--kv-budget-gib", parser=finite_float,
        help="KV pool of every format in GiB (default: engine.gpu_memory_fraction on CUDA, every slot at full length "
             "elsewhere)")] = None,
    quota: Annotated[int, Option("--quota-groups", help="prompt groups per learner batch")] = 8,
    group: Annotated[int, Option("--group-size", help="responses per prompt")] = 4,
    slots: Annotated[int, Option("--max-slots", help="decode slots (engine max_num_seqs)")] = 16,
    prompt_len: Annotated[int, Option("--prompt-len", help="prompt tokens per request")] = 16,
    median_len: Annotated[int, Option("--median-len", help="median response length")] = 8,
    sigma: Annotated[float, Option("--sigma", parser=finite_float,
        help="log-normal tail of response lengths")] = 1.0,
    max_len: Annotated[int, Option("--max-len", help="longest response")] = 40,
    device: Annotated[str, Option("--device", help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")] = "auto",
    seed: Annotated[int, Option("--seed", help="random seed (weights, prompts and sampling are a function of it)")] = 0,
    json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
    png: Annotated[Path | None, Option(
        "--png", help="figure: active sequences and KV in use over time, per format and mode")] = None,
    validate_only: Annotated[bool, Option(
        "--validate-only", help="check the options and print each pool, then stop before any work")] = False,
) -> None:
    """Seconds per learner batch for each KV format x rollout mode at one KV memory budget."""
    from kv4rl.bench.rollout import bench_rollout
    from kv4rl.bench.rollout_plan import RolloutBench, Workload, prepare
    from kv4rl.config_loader import parse_override

    try:
        overrides = engine_overrides or []
        check_device(device)
        bench = RolloutBench(
            formats=tuple(option_list(formats, "--formats")), modes=tuple(option_list(modes, "--modes")), repeats=repeats, batches=batches,
            workload=Workload(quota_groups=quota, group_size=group, max_slots=slots, prompt_len=prompt_len,
                              median_len=median_len, sigma=sigma, max_len=max_len, seed=seed),
            shape=shape, model_dir=model, kv_budget_gib=kv_budget_gib, device=device,
            engine=engine_config(overrides), engine_keys=frozenset(".".join(parse_override(o)[0]) for o in overrides))
        plan = prepare(bench)
    except ValueError as exc:
        fail(str(exc))
    png = check_figure_path(png, "--png", create=not validate_only)
    check_output_path(json_out, "--json", create=not validate_only)
    check_not_an_input({"--json": json_out, "--png": png}, {})  # the figure was written over the JSON
    for fmt in bench.formats:
        console.print(f"[dim]{plan.pool_line(fmt)}[/]", highlight=False, soft_wrap=True)
    if validate_only:
        console.print("options valid; stopping before any work (--validate-only)")
        return
    warn_real_shape_off_cuda(shape, device)

    def finished(partial: dict) -> None:  # each corner as it ends: a time limit keeps what ran
        r = partial["results"][-1]
        console.print(f"[dim]{len(partial['results'])}/{len(bench.formats) * len(bench.modes)} {r['format']} "
                      f"{r['mode']}: {r['rollout_s']:.2f} s per batch[/]", highlight=False)
        write_json(partial, json_out)

    with StageProgress(console, "rollout") as stages:  # a stage per warm-up and timed repeat of each corner
        res, traces = bench_rollout(plan, progress=lambda what, done: stages(what, done, 1), on_result=finished)
    print_table(console, rollout_table(res))
    write_json(res, json_out)
    wrote(json_out)
    if png is not None:
        from kv4rl.telemetry.plots import plot_rollout_corners

        pools = {r["format"]: r["pool_bytes"] for r in res["results"]}
        wrote(plot_rollout_corners(traces, pools, png))


register_kernel_benches(bench_app)
register_learner_benches(bench_app)
