"""Correction variance (docs/simulations.md, figure A-9c): how noisy the future-KL credit is for a fixed (π, μ).

The future-KL update charges token t with `F_t^H = Σ_{k=t}^{t+H−1} c_k`, `c_k = log π − log μ`. A
longer window sees more of the KL that a token leads to, but it sums more noisy per-token terms,
so the spread of `F_t^H` over sampled tokens grows with H. This module measures that spread on real
sampled batches: the rollout engine samples responses from μ (its reported log-probs are log μ), the
same tokens are teacher-forced through π, and `F_t^H` is pooled over every valid token of every
response. Variances are population variances (divided by the token count), in float64.

π is the checkpoint itself, evaluated as the learner evaluates it: transformers with fp32 weights
(bf16 autocast on CUDA), log-probs of `softmax(logits / τ)`. μ is one of:

- `stale:K` — the checkpoint after K AdamW steps (fresh optimizer state, no weight decay, learning
  rate `stale_lr`) on the supervised cross-entropy of the task's reference responses
  (`\\boxed{answer}` then EOS), one batch of `stale_batch_size` problems per step, the problems of
  the source that follow the `n_prompts` measured ones (μ is never trained on what it is measured on). AdamW moves every
  weight by about `stale_lr` per step whatever the gradient scale, so K steps at the run's
  `trainer.lr` stand for a policy K learner updates old (default 1e-4: of 1e-4, 3e-4 and 1e-3, the
  largest rate at which RL on the embedded tiny model stayed stable). Deterministic given the seed.
  K = 0 is μ = π through the engine: c_t is then only engine-vs-transformers rounding.
- `kv4` — the checkpoint in the engine with the KV4 cache (`engine.kv.format: kv4`).
- `fp8` — the checkpoint in the engine with FP8 weights (`engine.weight_format: fp8`): e4m3 weights with a
  scale per output channel, and each token's activations quantized to e4m3 too (`FP8Linear`), which is
  most of μ's distance from π on the embedded tiny model.

Engine overrides (`kv.n_sink=4`, keys under `engine.`) apply on top of the behaviour's settings, so a
KV4 allocation can be fitted to a short context, and `stale:K` composes with a quantized cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from kv4rl.algo.logprobs import k3_kl
from kv4rl.algo.losses import future_kl_credit
from kv4rl.config_loader import apply_overrides, from_dict
from kv4rl.data.prompts import PromptFormatter
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.sequence import MIN_TEMPERATURE
from kv4rl.sim.reference_policies import stale_policy, teacher_forced_logprobs
from kv4rl.telemetry.progress import StageReport

FP8_WEIGHTS_FIELD = "weight_format"  # the EngineConfig key that selects FP8 engine weights


class BehaviorUnavailableError(ValueError):
    """The requested behaviour policy needs an engine feature this installation does not have."""


@dataclass(frozen=True, slots=True)
class Behavior:
    kind: Literal["stale", "kv4", "fp8"]
    steps: int = 0  # K for `stale:K`

    def __str__(self) -> str:
        return f"stale:{self.steps}" if self.kind == "stale" else self.kind


def parse_behavior(text: str) -> Behavior:
    """`fp8`, `kv4` or `stale:K` (K a non-negative integer)."""
    text = text.strip()
    if text in ("fp8", "kv4"):
        return Behavior(kind=text)
    steps = text.removeprefix("stale:")
    if steps != text and steps.isascii() and steps.isdigit():  # not `²`, which isdigit() takes and int() not
        return Behavior(kind="stale", steps=int(steps))
    raise ValueError(f"--behavior: {text!r} is not fp8, kv4 or stale:K (K a non-negative integer)")


def parse_horizons(text: str) -> list[int | None]:
    """`1,4,16,full` -> [1, 4, 16, None] (None: the full tail)."""
    horizons: list[int | None] = []
    if not text.strip():
        raise ValueError("--horizons is empty; give e.g. 1,4,16,full")
    for raw in text.split(","):
        item = raw.strip()
        if item == "full":
            horizons.append(None)
        elif item.isascii() and item.isdigit() and int(item) >= 1:
            horizons.append(int(item))
        else:
            raise ValueError(f"--horizons: {item!r} is not an integer >= 1 or 'full'")
    if len(set(horizons)) != len(horizons):
        raise ValueError(f"--horizons: {text!r} repeats a horizon")
    return horizons


def horizon_label(horizon: int | None) -> int | str:
    return "full" if horizon is None else horizon


def variance_by_horizon(log_ratio: Tensor, mask: Tensor, horizons: list[int | None]) -> list[dict]:
    """Mean, variance and std of `F_t^H` pooled over the valid tokens of `[B, T]`, one dict per H."""
    valid = mask.bool()
    num_tokens = int(valid.sum())
    if num_tokens == 0:
        raise ValueError("no valid tokens to measure")
    rows = []
    for horizon in horizons:
        credit = future_kl_credit(log_ratio.double(), valid, horizon)[valid]
        mean = credit.mean()
        var = ((credit - mean) ** 2).mean()
        rows.append({
            "horizon": horizon_label(horizon),
            "mean": float(mean),
            "var": float(var),
            "std": float(var.sqrt()),
            "absmax": float(credit.abs().max()),
            "n_tokens": num_tokens,
        })
    return rows


def behavior_engine_config(behavior: Behavior, max_model_len: int, overrides: list[str] | None = None
                           ) -> EngineConfig:
    """The engine settings that realise μ, then `overrides` (`kv.n_recent=8`, keys of `engine.`).

    Fails naming the missing engine feature when μ needs one this installation lacks.
    """
    from kv4rl.engine.kv_formats import KV_FORMATS

    data: dict = {"max_model_len": max_model_len}
    if behavior.kind == "kv4":
        if "kv4" not in KV_FORMATS:
            raise BehaviorUnavailableError(
                "--behavior kv4 needs the KV4 cache, but 'kv4' is not in the engine's KV format registry "
                f"kv4rl.engine.kv_formats.KV_FORMATS (known: {', '.join(sorted(KV_FORMATS))})"
            )
        data["kv"] = {"format": "kv4"}
    elif behavior.kind == "fp8":
        if FP8_WEIGHTS_FIELD not in {f.name for f in dataclasses.fields(EngineConfig)}:
            raise BehaviorUnavailableError(
                "--behavior fp8 needs FP8 engine weights, but kv4rl.engine.config.EngineConfig has no "
                f"'{FP8_WEIGHTS_FIELD}' setting yet (expected engine.{FP8_WEIGHTS_FIELD}=fp8)"
            )
        data[FP8_WEIGHTS_FIELD] = "fp8"
    check_engine_overrides(overrides)
    data = apply_overrides(data, list(overrides or []))
    config = from_dict(EngineConfig, data, prefix="engine")
    config.validate()
    return config


def check_engine_overrides(overrides: list[str] | None) -> None:
    """`--engine` keys are the engine section's own: `engine.kv.format=...` would read as engine.engine.kv."""
    prefixed = [o for o in overrides or [] if o.strip().startswith("engine.")]
    if prefixed:
        raise ValueError(f"--engine {prefixed[0]!r}: give the key without 'engine.' "
                         f"(e.g. {prefixed[0].strip().removeprefix('engine.')!r})")
    # keys and values as the engine reads them, before any model is built or loaded
    from_dict(EngineConfig, apply_overrides({}, list(overrides or [])), prefix="engine").validate()


@dataclass(kw_only=True)
class Settings:
    model_dir: Path | None  # None: the embedded tiny model (the CLI fills it in after the checks)
    behavior: Behavior
    horizons: list[int | None] = field(default_factory=lambda: [1, 4, 16, 64, None])
    data: str | None = None
    template: str | None = None
    n_prompts: int = 16
    samples_per_prompt: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0
    device: str = "auto"
    stale_lr: float = 1e-4
    stale_batch_size: int = 16
    engine_overrides: list[str] = field(default_factory=list)  # e.g. ["kv.n_recent=8"]

    def validate(self) -> None:
        checks = [
            (self.n_prompts >= 1, f"--n-prompts must be >= 1, got {self.n_prompts}"),
            (self.samples_per_prompt >= 1,
             f"--samples-per-prompt must be >= 1, got {self.samples_per_prompt}"),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"),
            (self.temperature >= MIN_TEMPERATURE,
             f"--temperature must be at least {MIN_TEMPERATURE} (greedy sampling has no log μ), got {self.temperature}"),
            (self.stale_lr > 0, f"--stale-lr must be > 0, got {self.stale_lr}"),
            (self.stale_batch_size >= 1, f"--stale-batch-size must be >= 1, got {self.stale_batch_size}"),
            (-(2**63) <= self.seed < 2**64, f"--seed must be in [-2**63, 2**64) (torch's seed range), got {self.seed}"),
            (bool(self.horizons), "--horizons is empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class Measurement:
    """The JSON-ready `summary` plus the per-token data it was computed from."""

    summary: dict
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    behavior_logprobs: Tensor  # [B, T] float64, log μ from the engine
    reference_logprobs: Tensor  # [B, T] float64, log π teacher-forced
    mask: Tensor  # [B, T] bool


def _padded(rows: list[list[float]]) -> Tensor:
    out = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=torch.float64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    return out


def measure(settings: Settings, progress: StageReport | None = None) -> Measurement:
    """Sample from μ with the engine, teacher-force through π, and pool `F_t^H` per horizon.

    `progress(stage, done, total)` hears of each AdamW step, finished response and micro-batch.
    """
    from transformers import AutoModelForCausalLM

    from kv4rl.data.source import ProblemSource
    from kv4rl.engine.llm import Engine
    from kv4rl.engine.placement import resolve_device
    from kv4rl.engine.sequence import SamplingParams
    from kv4rl.models.hf_weights import check_model_folder, load_tokenizer

    settings.validate()
    check_model_folder(settings.model_dir)
    device = resolve_device(settings.device)
    tokenizer = load_tokenizer(settings.model_dir)
    source = ProblemSource(settings.data, None, settings.seed)
    trained = settings.behavior.steps * settings.stale_batch_size if settings.behavior.kind == "stale" else 0
    if settings.data is not None and len(source.train) < settings.n_prompts + trained:  # problem_at wraps around
        uses, harm, levers = f"{settings.n_prompts} measured", "prompts would repeat", "--n-prompts"
        if trained:
            uses += f", then {trained} that stale:{settings.behavior.steps} trains μ on"
            harm += ", and μ would be trained on what it is measured on"
            levers += " or --stale-batch-size"
        raise ValueError(f"--data {settings.data}: {len(source.train)} problems, fewer than the "
                         f"{settings.n_prompts + trained} distinct ones this measurement takes ({uses}): {harm}; "
                         f"lower {levers}, or give a longer file")
    formatter = PromptFormatter(tokenizer, settings.template or source.default_template)
    problems = source.batch(0, settings.n_prompts)
    prompts = [formatter.ids(p) for p in problems for _ in range(settings.samples_per_prompt)]
    try:
        max_model_len = max(map(len, prompts)) + settings.max_new_tokens
        engine_cfg = behavior_engine_config(settings.behavior, max_model_len, settings.engine_overrides)
        engine = Engine(settings.model_dir, engine_cfg, max_num_seqs=min(len(prompts), 256), device=device,
                        seed=settings.seed)
    except BehaviorUnavailableError:
        raise
    except ValueError as exc:
        raise ValueError(f"{exc} (engine keys for μ are set with --engine KEY=VALUE, keys of engine.)") from exc
    policy = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=torch.float32).to(device).eval()
    policy.requires_grad_(False)
    if settings.behavior.kind == "stale" and settings.behavior.steps > 0:
        size = settings.stale_batch_size  # after the measured problems (batch(1 + k) overlapped them past 16)
        batches = [[source.problem_at(settings.n_prompts + k * size + j) for j in range(size)]
                   for k in range(settings.behavior.steps)]
        behavior_model = stale_policy(policy, batches, formatter, settings.stale_lr, progress)
        engine.load_weights(behavior_model.state_dict(), version=settings.behavior.steps)
        del behavior_model
    params = SamplingParams(temperature=settings.temperature, max_tokens=settings.max_new_tokens,
                            seed=settings.seed)
    sampling = f"sampling {len(prompts)} responses from μ = {settings.behavior}"
    completions = engine.generate(prompts, params, progress=None if progress is None else (
        lambda done: progress(sampling, done, len(prompts))))
    del engine
    responses = [c.token_ids for c in completions]
    behavior_logp = _padded([c.logprobs for c in completions])
    reference_logp, mask = teacher_forced_logprobs(policy, prompts, responses, settings.temperature,
                                                   progress=progress)
    log_ratio = torch.where(mask, reference_logp - behavior_logp, 0.0)
    summary = _summary(settings, log_ratio, behavior_logp, reference_logp, mask)
    return Measurement(summary, prompts, responses, behavior_logp, reference_logp, mask)


def _summary(settings: Settings, log_ratio: Tensor, behavior_logp: Tensor, reference_logp: Tensor,
             mask: Tensor) -> dict:
    c = log_ratio[mask]
    k3 = k3_kl(behavior_logp, reference_logp)[mask]  # estimates KL(μ‖π) from tokens sampled from μ
    summary = {
        "model": str(settings.model_dir),
        "behavior": str(settings.behavior),
        "data": settings.data or "embedded",
        "n_prompts": settings.n_prompts,
        "samples_per_prompt": settings.samples_per_prompt,
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "seed": settings.seed,
        "engine_overrides": list(settings.engine_overrides),
        "n_responses": int(mask.shape[0]),
        "n_tokens": int(mask.sum()),
        "mean_response_len": float(mask.sum(1).double().mean()),
        "log_ratio": {"mean": float(c.mean()), "var": float(c.var(correction=0)),
                      "absmax": float(c.abs().max()), "kl_mu_pi_k3": float(k3.mean())},
        "horizons": variance_by_horizon(log_ratio, mask, settings.horizons),
    }
    if settings.behavior.kind == "stale":
        summary["stale"] = {"steps": settings.behavior.steps, "lr": settings.stale_lr,
                            "batch_size": settings.stale_batch_size, "optimizer": "AdamW (no weight decay)",
                            "loss": "cross-entropy of \\boxed{answer} + EOS"}
    return summary


def plot(summary: dict, path_png: str | Path) -> Path:
    """Variance (and std) of `F_t^H` against H, one point per measured horizon."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = summary["horizons"]
    labels = [str(r["horizon"]) for r in rows]
    fig = Figure(figsize=(9, 4))
    FigureCanvasAgg(fig)
    ax_var, ax_std = fig.subplots(1, 2)
    for ax, stat, title in ((ax_var, "var", "variance of $F_t^H$"), (ax_std, "std", "std of $F_t^H$")):
        values = [r[stat] for r in rows]
        ax.plot(range(len(rows)), values, "o-")
        ax.set_xticks(range(len(rows)), labels)
        ax.set_xlabel("horizon H (tokens)")
        ax.set_title(title)
        if all(v > 0 for v in values):
            ax.set_yscale("log")
    fig.suptitle(f"correction variance, μ = {summary['behavior']}: {summary['n_responses']} responses, "
                 f"{summary['n_tokens']} tokens, {summary['model']}", fontsize=8)
    fig.tight_layout()
    path = Path(path_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
