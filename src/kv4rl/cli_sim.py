"""`kv4rl sim …`: the simulations behind the method's arguments, as commands that print, save and plot.

- `clip-bias` (docs/simulations.md, figure A-2): Monte-Carlo of the PPO-clip gradient coefficient under ±σ
  advantage noise, against its closed form, plus a sweep over ρ.
- `correction-variance` (docs/simulations.md, figure A-9c): the variance of the future-KL credit `F_t^H` for
  a fixed pair (π, μ), per horizon H, on responses sampled by the engine.

The commands only parse, print and write files; the numbers come from `kv4rl.sim`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kv4rl.cli_common import (
    check_device,
    check_figure_path,
    check_not_an_input,
    check_output_path,
    console,
    fail,
    finite_float,
    option_list,
    write_json,
    wrote,
)
from kv4rl.data.prompts import check_template
from kv4rl.telemetry.progress import StageProgress
from kv4rl.telemetry.tables import ResultTable, print_table

sim_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Simulations that reproduce the method's arguments (clip bias A-2, correction variance A-9c).",
)

DEFAULT_SWEEP = ",".join(f"{0.5 + 0.1 * i:.1f}" for i in range(16))  # 0.5 … 2.0


def _signed(x: float) -> str:
    """+0.0000 for a zero of either sign (a closed form at σ = 0 gives -0.0, printed as -0.0000)."""
    return f"{x + 0.0:+.4f}"


def _clip_bias_table(result: dict) -> ResultTable:
    exact = result["closed_form"]
    inputs = f"ρ={result['rho']:g}, ε={result['eps']:g}, σ={result['sigma']:g}"
    table = ResultTable(f"PPO-clip coefficient at {inputs} ({result['n_samples']} samples, "
                        f"regime: {exact['regime']})",
                        ["branch", "mean (MC ± se)", "mean (exact)", "var (MC ± se)", "var (exact)"])
    for branch in ("clip", "noclip"):
        mc, se = result[branch], result["stderr"][branch]
        table.add_row(branch, f"{_signed(mc['mean'])} ± {se['mean']:.4f}", _signed(exact[branch]['mean']),
                      f"{mc['var']:.4f} ± {se['var']:.4f}", f"{exact[branch]['var']:.4f}")
    return table


@sim_app.command("clip-bias")
def clip_bias_cmd(
    rho: Annotated[float, typer.Option("--rho", parser=finite_float,
        help="importance ratio ρ = π/π_old of the token")] = 1.5,
    eps: Annotated[float, typer.Option("--eps", parser=finite_float,
        help="symmetric clip width ε, in [0, 1) (the lower bound 1-ε stays positive)")] = 0.2,
    sigma: Annotated[float, typer.Option("--sigma", parser=finite_float,
        help="advantage noise: A = ±σ, true advantage 0")] = 1.0,
    samples: Annotated[int, typer.Option("--samples", help="Monte-Carlo samples per ρ")] = 200_000,
    seed: Annotated[int, typer.Option("--seed", help="random seed of the Monte-Carlo draws (the advantage signs)")] = 0,
    sweep_rho: Annotated[str, typer.Option(
        "--sweep-rho", help="comma-separated ρ values to sweep")] = DEFAULT_SWEEP,
    sweep_eps: Annotated[str | None, typer.Option(
        "--sweep-eps", help="comma-separated ε values: the sweep runs over every ε, σ and ρ (default: --eps)")] = None,
    sweep_sigma: Annotated[str | None, typer.Option(
        "--sweep-sigma", help="comma-separated σ values (default: --sigma); one curve per ε, σ pair")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the numbers here")] = None,
    png_out: Annotated[Path | None, typer.Option(
        "--png", help="plot mean and variance against ρ here")] = None,
) -> None:
    """Mean and variance of the PPO-clip gradient coefficient with and without clipping (figure A-2)."""
    from kv4rl.sim.clip_bias import check_log_ratio, clip_bias, plot, sweep

    try:
        rhos = option_list(sweep_rho, "--sweep-rho", finite_float)
        if min(rhos) <= 0:
            raise ValueError(f"--sweep-rho: every ρ must be > 0, got {min(rhos):g}")
        for value in rhos:
            check_log_ratio(value, "--sweep-rho")
        epses = [eps] if sweep_eps is None else option_list(sweep_eps, "--sweep-eps", finite_float)
        sigmas = [sigma] if sweep_sigma is None else option_list(sweep_sigma, "--sweep-sigma", finite_float)
        if sweep_eps is not None and not all(0 <= e < 1 for e in epses):  # --eps itself is checked below
            raise ValueError(f"--sweep-eps: every ε must be in [0, 1), got {[e for e in epses if not 0 <= e < 1][0]:g}")
        if sweep_sigma is not None and min(sigmas) < 0:
            raise ValueError(f"--sweep-sigma: every σ must be >= 0, got {min(sigmas):g}")
        if rho > 0:
            check_log_ratio(rho, "--rho")
        points = 1 + len(rhos) * len(epses) * len(sigmas)  # seeds seed .. seed + points - 1 (`sweep`)
        for ok, message in [(rho > 0, f"--rho must be > 0, got {rho:g}"),
                            (0 <= eps < 1, f"--eps must be in [0, 1), got {eps:g}"),
                            (sigma >= 0, f"--sigma must be >= 0, got {sigma:g}"),
                            (samples >= 2, f"--samples must be >= 2, got {samples}"),
                            (-(2**63) <= seed < 2**64 - points, f"--seed must be in [-2**63, 2**64 - {points}) "
                             f"(torch's seed range; the sweep's {points - 1} points take seed + 1 ...), got {seed}")]:
            if not ok:
                raise ValueError(message)
    except ValueError as exc:
        fail(str(exc))
    # folders made only by the writers, after the work: an input the work refuses leaves nothing behind
    check_output_path(json_out, "--json", create=False)
    png_out = check_figure_path(png_out, "--png", create=False)
    check_not_an_input({"--json": json_out, "--png": png_out}, {})
    try:
        result = clip_bias(rho, eps, sigma, samples, seed)
        swept = sweep(rhos, epses, sigmas, samples, seed + 1)
    except ValueError as exc:
        fail(str(exc))
    except (MemoryError, RuntimeError) as exc:  # the allocator's traceback named no option
        if not isinstance(exc, MemoryError) and "allocate" not in str(exc):
            raise
        fail(f"--samples {samples}: the draws do not fit in this machine's memory; give fewer")
    print_table(console, _clip_bias_table(result))
    shift = result["clip"]["mean"] / rho
    console.print(f"clipped mean shift per unit ratio: {_signed(shift)} (exact "
                  f"{_signed(result['closed_form']['clip_mean_per_unit_ratio'])}); unclipped mean "
                  f"{_signed(result['noclip']['mean'])}", soft_wrap=True)
    if json_out is not None:
        write_json({**result, "sweep": swept}, json_out)
        wrote(json_out)
    if png_out is not None:
        # the --rho point joins its ε, σ curve where the sweep has one (alone it would draw no line)
        curve = [r for r in swept if (r["eps"], r["sigma"]) == (eps, sigma)]
        points = swept + ([result] if curve and all(r["rho"] != rho for r in curve) else [])
        plot(points, png_out)
        wrote(png_out)


def _variance_table(summary: dict) -> ResultTable:
    table = ResultTable(f"future-KL credit F_t^H, μ = {summary['behavior']}: {summary['n_responses']} "
                        f"responses, {summary['n_tokens']} tokens (mean length "
                        f"{summary['mean_response_len']:.1f})", ["H", "var", "std", "mean", "|F| max"])
    for row in summary["horizons"]:
        table.add_row(str(row["horizon"]), f"{row['var']:.4e}", f"{row['std']:.4e}", f"{row['mean']:+.4e}",
                      f"{row['absmax']:.4e}")
    return table


@sim_app.command("correction-variance")
def correction_variance_cmd(
    model: Annotated[Path | None, typer.Option(
        "--model", help="HF checkpoint folder (default: the embedded tiny model)")] = None,
    behavior: Annotated[str, typer.Option("--behavior", help="μ: fp8, kv4 or stale:K")] = "stale:4",
    horizons: Annotated[str, typer.Option(
        "--horizons", help="comma-separated H values or 'full'")] = "1,4,16,64,full",
    data: Annotated[Path | None, typer.Option(
        "--data", help="JSONL problems (default: the embedded task)")] = None,
    template: Annotated[str | None, typer.Option("--template", help="prompt template with {problem}")] = None,
    n_prompts: Annotated[int, typer.Option("--n-prompts", help="prompts measured")] = 16,
    samples_per_prompt: Annotated[int, typer.Option("--samples-per-prompt", "-G", help="responses sampled per prompt")] = 4,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="response tokens at most")] = 16,
    temperature: Annotated[float, typer.Option("--temperature", parser=finite_float, help="sampling temperature of π and μ")] = 1.0,
    stale_lr: Annotated[float, typer.Option(
        "--stale-lr", parser=finite_float,
        help="stale:K: AdamW learning rate of each step (use the run's trainer.lr)")] = 1e-4,
    stale_batch_size: Annotated[int, typer.Option(
        "--stale-batch-size", help="stale:K: problems per step")] = 16,
    engine: Annotated[list[str] | None, typer.Option(
        "--engine", help="engine key for μ, repeatable (KV4 on the embedded model: kv.n_sink=4, kv.n_recent=4, "
                         "kv.group_size=32, as its context is ~20 tokens and head_dim 32)")] = None,
    device: Annotated[str, typer.Option("--device", help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")] = "auto",
    seed: Annotated[int, typer.Option("--seed", help="random seed (weights, prompts and sampling are a function of it)")] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the numbers here")] = None,
    png_out: Annotated[Path | None, typer.Option("--png", help="plot variance against H here")] = None,
) -> None:
    """Variance of the future-KL credit F_t^H per horizon for a fixed (π, μ) (figure A-9c)."""
    from transformers.utils import logging as hf_logging

    from kv4rl.sim.correction_variance import (
        Settings,
        check_engine_overrides,
        measure,
        parse_behavior,
        parse_horizons,
        plot,
    )

    hf_logging.disable_progress_bar()  # weight-loading bars would bury the table
    try:  # every option, before anything is made or loaded
        if template is not None:
            check_template(template, "--template")
        check_engine_overrides(engine)
        check_device(device)
        settings = Settings(
            model_dir=model, behavior=parse_behavior(behavior), horizons=parse_horizons(horizons),
            data=str(data) if data else None, template=template, n_prompts=n_prompts,
            samples_per_prompt=samples_per_prompt, max_new_tokens=max_new_tokens, temperature=temperature,
            seed=seed, device=device, stale_lr=stale_lr, stale_batch_size=stale_batch_size,
            engine_overrides=list(engine or []),
        )
        settings.validate()
    except ValueError as exc:
        fail(str(exc))
    check_output_path(json_out, "--json", create=False)  # as clip-bias: the writers make the folders
    png_out = check_figure_path(png_out, "--png", create=False)
    check_not_an_input({"--json": json_out, "--png": png_out}, {"--data": data})
    try:
        if settings.model_dir is None:
            from kv4rl.models.tiny import tiny_model_dir

            settings.model_dir = tiny_model_dir()
        with StageProgress(console, "correction-variance") as stages:
            summary = measure(settings, progress=stages).summary
    except ValueError as exc:
        fail(str(exc))
    print_table(console, _variance_table(summary))
    ratio = summary["log_ratio"]
    console.print(f"c_t = log π − log μ: mean {ratio['mean']:+.4e}, var {ratio['var']:.4e}, "
                  f"KL(μ‖π) (k3) {ratio['kl_mu_pi_k3']:.4e}", soft_wrap=True)
    if json_out is not None:
        write_json(summary, json_out)
        wrote(json_out)
    if png_out is not None:
        plot(summary, png_out)
        wrote(png_out)
