"""`kv4rl bench iteration` and `kv4rl bench learner`: the training side of the system, measured the way
the rollout benches measure the engine (a table, `--json`, options checked before any work)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from typer import Option

from kv4rl.bench.tables import iteration_table, learner_table
from kv4rl.cli_common import (
    PARTIAL_JSON,
    check_at_least,
    check_device,
    check_figure_path,
    check_not_an_input,
    check_output_path,
    console,
    engine_config,
    fail,
    finite_float,
    option_list,
    shape_args,
    warn_real_shape_off_cuda,
    write_json,
    wrote,
)
from kv4rl.telemetry.progress import StageProgress
from kv4rl.telemetry.tables import print_table


# `bench learner`'s workload options and their defaults: each applies to one workload only
WORKLOAD_DEFAULTS = {"--seq-len": 4096, "--median-len": 1024, "--sigma": 1.0, "--max-len": 8192}
WORKLOAD_OPTIONS = {"uniform": ("--seq-len",), "lognormal": ("--median-len", "--sigma", "--max-len")}
# ... and its micro-batch sizes, each of one layout: (default, layout)
LAYOUT_OPTIONS = {"--micro-batch-size": (4, "padded"), "--max-tokens": (16384, "packed")}


def check_workload_options(workload: str, values: dict) -> None:
    """Refuse an option of the other workload set away from its default (`--sigma 2` under `--workload uniform`
    would otherwise be ignored without a word)."""
    stray = [name for name, value in values.items()
             if name not in WORKLOAD_OPTIONS.get(workload, values) and value != WORKLOAD_DEFAULTS[name]]
    if stray:
        other = next(kind for kind, names in WORKLOAD_OPTIONS.items() if kind != workload)
        raise ValueError(f"{', '.join(stray)} {'applies' if len(stray) == 1 else 'apply'} to --workload {other} only, "
                         f"not to --workload {workload}")


def register_learner_benches(app: typer.Typer) -> None:
    """Add the two commands to `kv4rl bench`."""

    @app.command("iteration")
    def bench_iteration_cmd(
        engine_overrides: Annotated[list[str] | None, typer.Argument(
            help="engine settings, e.g. engine.gpu_memory_fraction=0.8 engine.max_num_batched_tokens=32768")] = None,
        shape: Annotated[str, Option(
            "--shape", help="random-init model of this shape (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, "
                            "qwen3-tiny for tests)")] = "qwen3-1.7b",
        arms: Annotated[str, Option(
            "--arms", help="comma-separated arms, each KV format + rollout mode [+ fp8w for FP8 engine weights] "
                           "[+ awake: the engine does not sleep and carried responses keep their KV] "
                           "\\[@slots: that arm's decode slots], e.g. bf16+sync,kv4+partial@256,kv4+partial+awake; "
                           "speedups are against the first")]
        = "bf16+sync,kv4+partial",
        iterations: Annotated[int, Option("--iterations", help="timed iterations per arm, after the warm-up")] = 2,
        warmup: Annotated[int, Option(
            "--warmup-iterations", help="untimed iterations per arm before the timed ones (2 on a fresh machine: "
                                        "partial rollout's carried prefill shapes first come in the second)")] = 1,
        quota: Annotated[int, Option("--quota-groups", help="prompt groups per learner batch")] = 16,
        group: Annotated[int, Option("--group-size", help="responses per prompt")] = 8,
        slots: Annotated[int | None, Option(
            "--max-slots", help="decode slots of every arm without its own @slots "
                                "(default: quota-groups x group-size)")] = None,
        prompt_len: Annotated[int, Option("--prompt-len", help="prompt tokens per request")] = 128,
        median_len: Annotated[int, Option("--median-len", help="median response length")] = 1024,
        sigma: Annotated[float, Option("--sigma", parser=finite_float,
            help="log-normal tail of response lengths")] = 1.0,
        max_len: Annotated[int, Option("--max-len", help="longest response")] = 8192,
        micro_batch_size: Annotated[int, Option(
            "--micro-batch-size", help="learner sequences per forward/backward")] = 1,
        max_tokens: Annotated[int | None, Option(
            "--max-tokens-per-micro-batch", help="pack responses into micro-batches of this many tokens "
                                                 "(trainer.max_tokens_per_micro_batch; default: padded)")] = None,
        attention: Annotated[str, Option(
            "--attention", help="learner attention: auto (flex on CUDA when packing), sdpa, flex")] = "auto",
        grad_checkpointing: Annotated[bool, Option("--grad-checkpointing/--no-grad-checkpointing",
                                                    help="recompute activations in the backward pass")] = False,
        offload: Annotated[bool, Option(
            "--offload/--no-offload", help="trainer.offload: the learner's parameters, gradients and AdamW state "
                                           "in CPU memory (FSDP2 CPUOffloadPolicy; CUDA only), for shapes whose "
                                           "learner does not fit beside the engine")] = False,
        offload_optimizer: Annotated[bool, Option(
            "--offload-optimizer/--no-offload-optimizer",
            help="trainer.offload_optimizer: only AdamW's two moments in pinned CPU memory, streamed through the "
                 "GPU each update; parameters and gradients stay on the GPU (8 bytes per parameter on the host "
                 "instead of --offload's 16; CUDA only, not with --offload)")] = False,
        fuse_elementwise: Annotated[bool | None, Option(
            "--fuse-elementwise/--no-fuse-elementwise", help="trainer.fuse_elementwise: the learner's RMSNorms "
                                                             "and SwiGLU through compiled functions (default: on "
                                                             "for CUDA)")] = None,
        compile_layers: Annotated[bool | None, Option(
            "--compile-layers/--no-compile-layers", help="trainer.compile_layers: every learner decoder layer "
                                                         "as one torch.compile region (default: on for CUDA)")]
        = None,
        fused_logprobs: Annotated[bool | None, Option(
            "--fused-logprobs/--no-fused-logprobs", help="trainer.fused_logprobs: the log-prob head in two Triton "
                                                         "passes over the logits (default: on for CUDA)")] = None,
        lr: Annotated[float, Option("--lr", parser=finite_float, help="learner learning rate")] = 1e-6,
        sleep: Annotated[bool, Option(
            "--sleep/--no-sleep", help="engine frees its KV pool during the update (engine.sleep_between_rollouts)")]
        = True,
        device: Annotated[str, Option("--device", help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")] = "auto",
        seed: Annotated[int, Option("--seed", help="random seed (weights, prompts and sampling are a function of it)")] = 0,
        json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
        png: Annotated[Path | None, Option(
            "--png", help="stacked bars of the phases per arm; the CSV behind it goes beside it")] = None,
        validate_only: Annotated[bool, Option(
            "--validate-only", help="check the options, then stop before any work")] = False,
    ) -> None:
        """Seconds per RL iteration (rollout / reward / update / weight sync / sleep-wake) for each arm."""
        from kv4rl.bench.iteration import IterationBench, bench_iteration, parse_arms, prepare
        from kv4rl.bench.rollout_plan import Workload
        from kv4rl.config_loader import parse_override

        try:
            overrides = engine_overrides or []
            check_at_least(1, ("--max-slots", slots))
            check_device(device)
            bench = IterationBench(
                arms=tuple(parse_arms(arms)), shape=shape, iterations=iterations, warmup_iterations=warmup,
                workload=Workload(quota_groups=quota, group_size=group, max_slots=slots or quota * group,
                                  prompt_len=prompt_len, median_len=median_len, sigma=sigma, max_len=max_len, seed=seed),
                micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens, attention=attention,
                grad_checkpointing=grad_checkpointing, offload=offload, offload_optimizer=offload_optimizer,
                fuse_elementwise=fuse_elementwise,
                compile_layers=compile_layers, fused_logprobs=fused_logprobs, lr=lr, sleep=sleep,
                device=device, engine=engine_config(overrides),
                engine_keys=frozenset(".".join(parse_override(o)[0]) for o in overrides))
            configs = prepare(bench)
        except ValueError as exc:
            fail(str(exc))
        png = check_figure_path(png, "--png", csv_beside=True, create=not validate_only)
        check_output_path(json_out, "--json", create=not validate_only)
        # the figure or its CSV was written over the JSON
        check_not_an_input({"--json": json_out, "--png": png,
                            "the CSV beside --png": None if png is None else png.with_suffix(".csv")}, {})
        if validate_only:
            console.print("options valid; stopping before any work (--validate-only)")
            return
        warn_real_shape_off_cuda(shape, device)

        kept: list[dict] = []  # the arms done so far, for the table if a later arm is refused

        def finished(partial: dict) -> None:  # each arm as it ends: a time limit keeps what ran
            r = partial["results"][-1]
            console.print(f"[dim]{len(partial['results'])}/{len(bench.arms)} {r['arm']}: "
                          f"{r['seconds_per_iteration']:.2f} s per iteration[/]", highlight=False)
            write_json(partial, json_out)
            kept[:] = [partial]

        # the model folder, then each arm's two builds, its warm-up iterations and its timed ones
        try:
            with StageProgress(console, "iteration") as stages:
                res = bench_iteration(bench, configs, on_result=finished,
                                      progress=stages.counted(
                                          1 + len(bench.arms) * (2 + bench.warmup_iterations + bench.iterations)))
        except ValueError as exc:  # an arm the device cannot hold (its pool refused by name): one line, after
            if kept:  # the table of the arms that ran, which the JSON keeps ("complete": false)
                print_table(console, iteration_table(kept[0]))
            PARTIAL_JSON.discard(json_out)  # said here, not again by an interrupt message
            held = f' ({json_out} holds the arms that finished, "complete": false)' if kept and json_out else ""
            fail(str(exc) + held)
        for r in res["results"]:
            console.print(f"[dim]{r['arm']}: {r['engine_summary']}[/]", highlight=False, soft_wrap=True)
        print_table(console, iteration_table(res))
        write_json(res, json_out)
        wrote(json_out)
        if png is not None:
            from kv4rl.bench.iteration import figure_rows
            from kv4rl.telemetry.plots import plot_iteration_time, write_csv

            rows, w = figure_rows(res), res["workload"]
            title = (f"{res['model']} on {res['gpu'] or res['device']}: seconds per RL iteration by phase\n"
                     f"{w['quota_groups']}x{w['group_size']} responses, lengths median {w['median_len']} max "
                     f"{w['max_len']}, {'sleep/wake' if res['sleep'] else 'no sleep'}")
            wrote(plot_iteration_time(rows, png, title), write_csv(rows, png.with_suffix(".csv")))


    @app.command("learner")
    def bench_learner_cmd(
        shape: Annotated[str, Option(
            "--shape", help="model shape (qwen3-1.7b, qwen3-4b, qwen3-8b; qwen3-tiny for tests)")] = "qwen3-1.7b",
        workload: Annotated[str, Option("--workload", help="uniform (N x L) or lognormal response lengths")]
        = "uniform",
        num_seqs: Annotated[int | None, Option(
            "--num-seqs", help="sequences per step (default: 16 uniform, 32 lognormal)")] = None,
        prompt_len: Annotated[int, Option("--prompt-len", help="prompt tokens of every row")] = 256,
        seq_len: Annotated[int, Option(
            "--seq-len", help="uniform: tokens of every row, prompt included")] = WORKLOAD_DEFAULTS["--seq-len"],
        median_len: Annotated[int, Option(
            "--median-len", help="lognormal: median response length")] = WORKLOAD_DEFAULTS["--median-len"],
        sigma: Annotated[float, Option("--sigma", parser=finite_float,
            help="lognormal: shape of the length tail")] = WORKLOAD_DEFAULTS["--sigma"],
        max_len: Annotated[int, Option("--max-len", help="lognormal: longest response")] = WORKLOAD_DEFAULTS["--max-len"],
        micro_batch_size: Annotated[int, Option(
            "--micro-batch-size", help="rows per padded micro-batch")] = LAYOUT_OPTIONS["--micro-batch-size"][0],
        max_tokens: Annotated[int, Option(
            "--max-tokens", help="tokens per packed micro-batch")] = LAYOUT_OPTIONS["--max-tokens"][0],
        layouts: Annotated[str, Option("--layouts", help="comma-separated: padded, packed")] = "padded,packed",
        attention: Annotated[str | None, Option(
            "--attention", help="comma-separated attention kernels for the packed layout: sdpa (dense block-diagonal "
                                "mask), flex (FlexAttention block mask, CUDA only); padded rows run sdpa "
                                "(default: sdpa,flex on CUDA, sdpa on the CPU)")] = None,
        checkpointing: Annotated[str, Option(
            "--checkpointing", help="comma-separated activation checkpointing settings: off, on")] = "off,on",
        reference: Annotated[str, Option(
            "--reference", help="comma-separated reference-forward settings: off, on")] = "off,on",
        fuse: Annotated[str, Option(
            "--fuse-elementwise", help="comma-separated trainer.fuse_elementwise settings: off, on (RMSNorms and "
                                       "SwiGLU through compiled functions; default: on for CUDA, off on the "
                                       "CPU, as trainer.fuse_elementwise)")] = "",
        compile_layers: Annotated[str, Option(
            "--compile-layers", help="comma-separated trainer.compile_layers settings: off, on (every decoder "
                                     "layer as one torch.compile region; default: on for CUDA, off on the "
                                     "CPU, as trainer.compile_layers)")] = "",
        fused_logprobs: Annotated[str, Option(
            "--fused-logprobs", help="comma-separated trainer.fused_logprobs settings: off, on (log-probs, entropy "
                                     "and their gradient in two Triton passes over the logits; on needs CUDA; "
                                     "default: on for CUDA, off on the CPU)")] = "",
        entropy_coeff: Annotated[float, Option("--entropy-coeff", parser=finite_float,
            help="algo.entropy_coeff of every variant (the entropy's gradient through the log-prob head)")] = 0.0,
        top_entropy_quantile: Annotated[float, Option("--top-entropy-quantile", parser=finite_float,
            help="algo.top_entropy_quantile of every variant (the loss on each pass's highest-entropy tokens)")] = 1.0,
        steps: Annotated[int, Option("--steps", help="timed steps per variant, after one warm-up step")] = 2,
        device: Annotated[str, Option("--device", help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")] = "auto",
        seed: Annotated[int, Option("--seed", help="random seed (weights, prompts and sampling are a function of it)")] = 0,
        json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
    ) -> None:
        """Learner step throughput (real tokens/s, MFU, peak memory) on a random-init model."""
        from kv4rl.algo.config import AlgoConfig
        from kv4rl.bench.learner import LearnerWorkload, bench_learner
        from kv4rl.bench.random_model import qwen3_args
        from kv4rl.engine.placement import resolve_device
        from kv4rl.trainer.fused_elementwise import fuses_by_default
        from kv4rl.kernels import kernels_usable

        switch = {"off": False, "on": True}
        try:
            shape_args(shape, qwen3_args)
            check_at_least(1, ("--num-seqs", num_seqs))  # None: the workload's default
            check_workload_options(workload, {"--seq-len": seq_len, "--median-len": median_len, "--sigma": sigma,
                                              "--max-len": max_len})
            work = LearnerWorkload(kind=workload, num_seqs=num_seqs or (32 if workload == "lognormal" else 16),
                                   prompt_len=prompt_len, seq_len=seq_len, median_len=median_len, sigma=sigma,
                                   max_len=max_len, seed=seed)
            work.validate(shape_args(shape, qwen3_args).max_position_embeddings)
            check_at_least(1, ("--micro-batch-size", micro_batch_size), ("--max-tokens", max_tokens), ("--steps", steps))
            layout_list = option_list(layouts, "--layouts", known=["padded", "packed"])
            for option, value in (("--micro-batch-size", micro_batch_size), ("--max-tokens", max_tokens)):
                default, layout = LAYOUT_OPTIONS[option]
                if layout not in layout_list and value != default:  # it would size micro-batches no variant has
                    raise ValueError(f"{option} {value} sizes {layout} micro-batches, and --layouts {layouts} times none")
            ckpt_list = [switch[v] for v in option_list(checkpointing, "--checkpointing", known=list(switch))]
            ref_list = [switch[v] for v in option_list(reference, "--reference", known=list(switch))]
            algo = AlgoConfig(entropy_coeff=entropy_coeff, top_entropy_quantile=top_entropy_quantile)
            algo.validate()
            check_device(device)
            dev = resolve_device(device)
            fuse_list = [switch[v] for v in option_list(fuse or ("on" if fuses_by_default(dev) else "off"),
                                                        "--fuse-elementwise", known=list(switch))]
            cuda_default = "on" if dev.type == "cuda" else "off"  # trainer.compile_layers / fused_logprobs: null
            compile_list = [switch[v] for v in option_list(compile_layers or cuda_default, "--compile-layers",
                                                           known=list(switch))]
            head_list = [switch[v] for v in option_list(fused_logprobs or cuda_default, "--fused-logprobs",
                                                        known=list(switch))]
            if True in head_list and not kernels_usable(dev):
                raise ValueError(f"--fused-logprobs on runs Triton kernels, which need a CUDA device (and Triton); "
                                 f"on device {dev} use --fused-logprobs off")
            attention_list = option_list(attention or ("sdpa,flex" if dev.type == "cuda" else "sdpa"), "--attention",
                                         known=["sdpa", "flex"])
            if "flex" in attention_list and dev.type != "cuda":
                raise ValueError(f"--attention flex needs a CUDA device (FlexAttention has no backward pass on "
                                 f"{dev}); use --attention sdpa")
        except ValueError as exc:
            fail(str(exc))
        check_output_path(json_out)
        warn_real_shape_off_cuda(shape, device)
        rows = sum(len(attention_list) if lay == "packed" else 1 for lay in layout_list)
        variants = rows * len(ckpt_list) * len(ref_list) * len(fuse_list) * len(compile_list) * len(head_list)
        def finished(partial: dict) -> None:  # each variant as it is timed: a time limit keeps what ran
            r = partial["results"][-1]
            mfu = f", MFU {r['mfu']:.1%}" if dev.type == "cuda" else ""  # against a GPU's peak, as the table
            timed = (f"{r['step_s']:.3f} s/step, {r['tokens_per_s']:,.0f} tokens/s{mfu}"
                     if "step_s" in r else r["error"])
            console.print(f"[dim]{len(partial['results'])}/{variants} {r['layout']} {r['attention']} ckpt="
                          f"{'on' if r['checkpointing'] else 'off'} ref={'on' if r['reference'] else 'off'}"
                          f"{' fused' if r['fuse_elementwise'] else ''}"
                          f"{' compiled' if r['compile_layers'] else ''}"
                          f"{' fused-logprobs' if r['fused_logprobs'] else ''}: "
                          f"{timed}[/]", highlight=False)
            write_json(partial, json_out)

        with StageProgress(console, "learner") as stages:
            res = bench_learner(shape, work, device=dev, steps=steps,
                                micro_batch_size=micro_batch_size, max_tokens=max_tokens, layouts=layout_list,
                                attentions=attention_list, checkpointing=ckpt_list, reference=ref_list, fuse=fuse_list,
                                compile=compile_list, fused_logprobs=head_list, algo=algo,
                                progress=lambda what: stages(f"{shape} {workload}: {what} ({variants} variants)"),
                                on_result=finished)
        print_table(console, learner_table(res))
        write_json(res, json_out)
        wrote(json_out)
