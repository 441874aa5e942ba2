"""Mismatch attribution: split the learner-vs-engine log-ratio of sampled tokens by source.

Every `telemetry.attribution_every` iterations, before the learner's update, a few responses of the
batch are re-scored along a chain of levels that change one thing at a time, from the learner's
log-prob under its current weights down to the log-prob the engine recorded when it sampled:

    L    learner (HF model, its dtype / autocast), current weights θ_now
    E0   engine reference path, θ_now, linears in the compute dtype, KV in the compute dtype
    E1   ... weights θ_v of the version that sampled the response
    E2   ... KV cache in the run's format (engine.kv)
    E3   ... linears in the run's weight format (engine.weight_format: the engine's own FP8 codes of θ_v)
    E4   ... under the sampler's top-k / top-p truncation
    r    the recorded behaviour log-prob (fast path: kernels, fused ops, CUDA graphs, decode steps)

Each source is one step: learner = L - E0, staleness = E0 - E1, kv_cache = E1 - E2,
weights = E2 - E3, truncation = E3 - E4, kernels = E4 - r, so per token the terms add up to
L - r exactly (float64 differences). A step whose two levels are the same computation (no fp8, a
plain KV format, no truncation, a response of the current version) is reused, so its term is 0.

Which responses: only those whose tokens all carry one version v (a response continued across a
weight update attended over KV of two versions, which no single re-scoring reproduces), and whose
θ_v is at hand: the current weights (v = the iteration) or a CPU copy. The copies: at iteration v,
when the engine holds the learner's current weights (it was refreshed to version v), they are kept
if an attribution iteration falls within the staleness horizon after v (`staleness.max_versions`,
else lag + refresh_every - 1), and dropped once they are older than that horizon. Tokens older than
the horizon (partial rollout without max_versions) and versions from before a resume are skipped.
With FP8 weights the engine's own state of that version is copied too: its codes were quantized
from what the engine was given (the checkpoint cast to the compute dtype at start, the learner's
fp32 tensors at a refresh), and re-quantizing the learner's weights would not reproduce them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kv4rl.engine.kv_formats import get_kv_format
from kv4rl.engine.merged_linears import unmerged_state_dict
from kv4rl.engine.scoring import Sampling, reference_logprobs, scoring_model
from kv4rl.telemetry.mismatch_curves import SOURCES, TOKENS_KEY, metric_key

SKIPPED_KEY = "mismatch/skipped_responses"


def decompose(levels: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float64 per-token terms from the chain's levels [L, E0, E1, E2, E3, E4, r] (each [T]):
    each source is its level minus the next; `total` is the first minus the last."""
    if len(levels) != len(SOURCES) + 1:
        raise ValueError(f"expected {len(SOURCES) + 1} levels, got {len(levels)}")
    levels = [x.double() for x in levels]
    terms = {source: upper - lower for source, upper, lower in zip(SOURCES, levels, levels[1:])}
    terms["total"] = levels[0] - levels[-1]
    return terms


def summarize(terms: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per source over all tokens: mean |d|, mean k3 = e^d - 1 - d (the learner's mismatch_k3 for the
    total), and the signed mean (the only one of the three that adds up across sources)."""
    out = {}
    for source, d in terms.items():
        out[metric_key(source, "abs_mean")] = float(d.abs().mean())
        out[metric_key(source, "k3")] = float((torch.expm1(d) - d).mean())
        out[metric_key(source, "mean")] = float(d.mean())
    return out


@dataclass(slots=True)
class Response:
    """One attributed response: its batch row, sampling version, ids and per-token levels so far."""

    row: int
    version: int
    prompt: list[int]
    tokens: list[int]
    recorded: torch.Tensor
    levels: dict[str, torch.Tensor]


def batch_responses(batch) -> list[tuple[int, list[int], list[int], list[int], torch.Tensor]]:
    """Per row of a `TrainBatch`: (row, prompt ids, response ids, token versions, recorded log-probs). A row's
    response is where it has a sampling version, trained or not (`trainer.mask_truncated` leaves a cut response
    no token to train: its mask is empty, its versions and log-probs are there)."""
    out = []
    for i in range(len(batch)):
        cols = (batch.versions[i] >= 0).nonzero().flatten()
        first, last = int(cols[0]), int(cols[-1])
        ids = batch.input_ids[i].tolist()
        out.append((i, ids[: first + 1], ids[first + 1: last + 2], batch.versions[i, cols].tolist(),
                    batch.behavior_logprobs[i, cols].double().cpu()))
    return out


class MismatchAttribution:
    """Runs the chain above on sampled responses; `observe` is the loop's one call per iteration."""

    def __init__(self, engine, learner, *, every: int, samples: int, sampling: Sampling, horizon: int,
                 seed: int = 0):
        if every < 1 or samples < 1 or horizon < 0:
            raise ValueError(f"attribution needs every >= 1, samples >= 1, horizon >= 0; got {every}, "
                             f"{samples}, {horizon}")
        self.engine, self.learner = engine, learner
        self.every, self.samples, self.sampling, self.horizon, self.seed = every, samples, sampling, horizon, seed
        self.fp8 = engine.plan.weights.value == "fp8"
        self.weights: dict[int, dict[str, torch.Tensor]] = {}  # version -> learner weights on CPU
        self.engine_weights: dict[int, dict[str, torch.Tensor]] = {}  # version -> the engine's FP8 state

    @classmethod
    def from_config(cls, cfg, engine, learner) -> MismatchAttribution | None:
        """None when `telemetry.attribution_every` is 0 (off)."""
        t, st, r = cfg.telemetry, cfg.staleness, cfg.rollout
        if not t.attribution_every:
            return None
        horizon = st.max_versions if st.max_versions is not None else st.lag + st.refresh_every - 1
        return cls(engine, learner, every=t.attribution_every, samples=t.attribution_samples,
                   sampling=Sampling(r.temperature, r.top_k, r.top_p, r.min_p), horizon=horizon, seed=cfg.seed)

    def due(self, iteration: int) -> bool:
        return (iteration + 1) % self.every == 0

    def observe(self, iteration: int, batch) -> dict[str, float]:
        """Call once per iteration with its batch, before the learner's update: keeps the weights later
        attributions need and, when due, returns the `mismatch/*` metrics (else an empty dict)."""
        t0 = time.perf_counter()
        copied = self.keep_weights(iteration)
        if not self.due(iteration):  # the copy alone (~32 GB at 8B) was counted as update time
            return {"mismatch/time_s": time.perf_counter() - t0} if copied else {}
        out = self.attribute(iteration, batch)
        out["mismatch/time_s"] = time.perf_counter() - t0
        return out

    def keep_weights(self, iteration: int) -> bool:
        """Copy the weights of version `iteration` if a coming attribution may need them (returns whether it
        did); drop old ones.
        With FP8 weights the engine's own codes are kept too: they were quantized from whatever the
        engine was given (the checkpoint cast to its dtype at start, the learner's tensors at a refresh)."""
        self.weights = {v: w for v, w in self.weights.items() if v >= iteration - self.horizon}
        self.engine_weights = {v: w for v, w in self.engine_weights.items() if v in self.weights}
        needed = any(self.due(a) for a in range(iteration + 1, iteration + self.horizon + 1))
        if needed and self.engine.version == iteration:  # the engine holds exactly these weights
            self.weights[iteration] = {k: v.detach().to("cpu", copy=True)
                                       for k, v in self.learner.state_dict().items()}
            if self.fp8:
                self.engine_weights[iteration] = self.engine.weights_state()
            return True
        return False

    def attribute(self, iteration: int, batch) -> dict[str, float]:
        """The `mismatch/*` metrics of the chain over up to `samples` eligible responses of `batch`."""
        terms, skipped = self.token_terms(iteration, batch)
        out = {SKIPPED_KEY: skipped, TOKENS_KEY: 0}
        if terms is not None:
            out.update(summarize(terms))
            out[TOKENS_KEY] = len(terms["total"])
        return out

    def token_terms(self, iteration: int, batch) -> tuple[dict[str, torch.Tensor] | None, int]:
        """Per-token float64 terms (`decompose`) of up to `samples` eligible responses chosen at random,
        concatenated in batch-row order (None when no response is eligible), and how many rows were not
        eligible."""
        candidates = [r for r in batch_responses(batch) if len(set(r[3])) == 1
                      and (r[3][0] == iteration or r[3][0] in self.weights)]
        skipped = len(batch) - len(candidates)
        if not candidates:
            return None, skipped
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + iteration)
        picked = sorted(torch.randperm(len(candidates), generator=gen)[: self.samples].tolist())
        responses = [Response(row, versions[0], prompt, tokens, recorded, {})
                     for row, prompt, tokens, versions, recorded in (candidates[i] for i in picked)]
        self._learner_level(batch, responses)
        self._engine_levels(iteration, responses)
        order = ["L", "E0", "E1", "E2", "E3", "E4"]
        # the reference's top-k/top-p may leave out a token the engine sampled (near-tied logits at the cut,
        # ordered differently): its truncated log-prob is -inf and its terms infinite, so it is skipped
        finite = [r for r in responses if all(bool(torch.isfinite(r.levels[k]).all()) for k in order)]
        skipped += len(responses) - len(finite)
        if not finite:
            return None, skipped
        terms = [decompose([r.levels[k] for k in order] + [r.recorded]) for r in finite]
        return {k: torch.cat([t[k] for t in terms]) for k in terms[0]}, skipped

    def _learner_level(self, batch, responses: list[Response]) -> None:
        rows = torch.tensor([r.row for r in responses])
        sub = batch.select(rows)
        logp = self.learner.logprobs(sub).detach().double().cpu()
        for i, r in enumerate(responses):
            r.levels["L"] = logp[i][sub.response_mask[i].cpu() > 0]

    def _engine_levels(self, iteration: int, responses: list[Response]) -> None:
        """E0..E4, one scoring model at a time on the engine's device (the FP8 one only when the run
        uses FP8 weights); each set of weights is loaded once."""
        engine = self.engine
        compute_kv = get_kv_format("bf16" if engine.dtype == torch.bfloat16 else "fp32")  # kv.format auto
        run_kv, block_size = engine.kv_format, engine.config.kv.block_size
        same_kv = run_kv.name == compute_kv.name and run_kv.rotate == "none"

        calibration = engine.kv_calibration()  # NVFP4's scales: the run's cache, not one calibrated anew

        def score(model, kv, r):
            return reference_logprobs(model, kv, r.prompt, r.tokens, self.sampling, block_size,
                                      calibration if kv is run_kv else None)

        versions = sorted({r.version for r in responses}, key=lambda v: v != iteration)  # current first
        model = scoring_model(engine.args, engine.dtype, engine.device)
        model.load_hf_state_dict(self.learner.state_dict())
        for r in responses:
            r.levels["E0"] = score(model, compute_kv, r)[0]
        for v in versions:
            if v != iteration:
                model.load_hf_state_dict(self.weights[v])
            for r in (r for r in responses if r.version == v):
                r.levels["E1"] = r.levels["E0"] if v == iteration else score(model, compute_kv, r)[0]
                e2, truncated = (r.levels["E1"], None) if same_kv else score(model, run_kv, r)
                r.levels["E2"] = e2
                if not self.fp8:
                    r.levels["E3"] = e2
                    if self.sampling.truncates and truncated is None:  # E2 was reused: score it truncated
                        truncated = score(model, run_kv, r)[1]
                    r.levels["E4"] = truncated if truncated is not None else e2
        del model
        if self.fp8:  # the engine's own codes and scales: version `iteration` is the one it holds now
            model = scoring_model(engine.args, engine.dtype, engine.device, fp8=True)
            for v in versions:
                model.load_state_dict(unmerged_state_dict(engine.model) if v == iteration else self.engine_weights[v])
                for r in (r for r in responses if r.version == v):
                    r.levels["E3"], truncated = score(model, run_kv, r)
                    r.levels["E4"] = truncated if truncated is not None else r.levels["E3"]
            del model
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()

