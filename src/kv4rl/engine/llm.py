"""The engine facade: requests in, completions with behaviour log-probs and versions out.

`Engine.generate(prompts, params)` runs to completion; `add_request` / `step` expose the
continuous-batching loop for orchestration that keeps requests alive across weight updates.
`load_weights(state_dict, version)` copies learner weights in place and tags later tokens.
`score_tokens(prompts, forced)` teacher-forces given responses through the same cache path and
returns full-vocabulary logits (the fidelity bench compares KV formats with it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from kv4rl.engine import memory
from kv4rl.engine.block_manager import BlockManager, blocks_needed
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.kv_formats import kv_format_from_config
from kv4rl.engine.runner import ModelRunner
from kv4rl.engine.sampler import sample
from kv4rl.engine.scheduler import Scheduler
from kv4rl.engine.sequence import Completion, SamplingParams, Sequence
from kv4rl.models.decoder import Decoder

log = logging.getLogger(__name__)


def request_seed(seed: int, index: int) -> int:
    """A well-mixed 62-bit sampling seed for request `index` of a call seeded with `seed`."""
    from kv4rl.engine.sampler import splitmix64

    mixed = splitmix64(torch.tensor([seed * 1_000_003 + index], dtype=torch.long))
    return int(mixed) & (2**62 - 1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' requested but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"model.dtype: unknown dtype '{name}' (known: auto, {', '.join(table)})")
    return table[name]


class Engine:
    def __init__(
        self,
        model_dir: str | Path | None,
        config: EngineConfig | None = None,
        *,
        max_num_seqs: int = 256,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        seed: int = 0,
        tokenizer: Any = None,
        model: Decoder | None = None,
    ):
        """Load the checkpoint in `model_dir`, or take an in-memory `model` (see `from_model`)."""
        from kv4rl.models.hf_weights import load_model

        config = config or EngineConfig()
        config.validate()
        self.config = config
        if (model is None) == (model_dir is None):
            raise ValueError("Engine needs exactly one of a model folder and an in-memory model")
        if model is not None:  # it is already placed: its device and dtype are the engine's
            if (device, dtype) != ("auto", "auto"):
                raise ValueError("an in-memory model fixes the engine's device and dtype; leave them 'auto'")
            device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, self.device)
        if model is None:
            self.model, self.args = load_model(model_dir, self.device, self.dtype)
        else:
            self.model, self.args = model, model.args
        self.model.requires_grad_(False)  # the engine only samples; weights arrive via load_weights
        self.weights_desc = self._apply_weight_format()
        from kv4rl.kernels import kernels_compiled

        compiled = kernels_compiled(self.device)  # what the `auto` settings take
        self.fused_ops = compiled if config.fused_ops == "auto" else config.fused_ops
        self.sampler = ("triton" if compiled else "torch") if config.sampler == "auto" else config.sampler
        if self.fused_ops:  # before the pool's profiling step and any graph capture
            self._require_kernels("engine.fused_ops=true")
            self.model.enable_fused_ops()
            if config.weight_format == "fp8":  # FP8 linears quantize their inputs in one kernel too
                from kv4rl.engine.fp8_weights import set_fused_quant

                set_fused_quant(self.model)
        self.tokenizer = tokenizer
        fmt_name = config.kv.format
        if fmt_name == "auto":
            fmt_name = "bf16" if self.dtype == torch.bfloat16 else "fp32"
        self.kv_format = kv_format_from_config(config.kv, fmt_name)
        block_size = config.kv.block_size
        self.max_model_len = config.max_model_len or self.args.max_position_embeddings
        self.kv_format.check(self.args.head_dim, self.max_model_len)
        self.fast = self._choose_attention()
        if self.sampler == "triton":
            self._require_kernels("engine.sampler=triton")
        num_blocks, self.pool_sizing = self._num_kv_blocks(max_num_seqs)
        self.runner = self._make_runner(num_blocks, max_num_seqs, graphs=True)
        self.scheduler = Scheduler(
            BlockManager(num_blocks, block_size), max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
            prefix_sharing=config.prefix_sharing,
        )
        eos = self.args.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.generator = torch.Generator()  # only draws per-request seeds; sampling noise is counter-based
        self.generator.manual_seed(seed)
        self.version = 0
        self.last_step: dict = {}
        # all layers, scales and KV4's reserved INT8 rows (spread over max_model_len) included
        self.bytes_per_token = self.kv_bytes_per_token(self.max_model_len)
        self.pool_tokens = num_blocks * block_size
        self.pool_bytes = self.runner.cache_bytes
        self.summary = (
            f"engine: kv format {fmt_name} (rotate {self.kv_format.rotate}), {self.bytes_per_token:.1f} "
            f"bytes/token at context {self.max_model_len}, pool {self.pool_tokens} tokens ({num_blocks} "
            f"blocks x {block_size}) for up to {max_num_seqs} sequences, {memory.format_bytes(self.pool_bytes)} "
            f"(sized by {self.pool_sizing}), {self.weights_desc}, {self.attention_desc}, sampler {self.sampler}"
            f"{', fused ops' if self.fused_ops else ''}"
        )
        log.info(self.summary)

    @classmethod
    def from_model(cls, model: Decoder, config: EngineConfig | None = None, **kwargs) -> Engine:
        """An engine around a decoder already in memory (e.g. random-init for a benchmark), on its device
        and in its dtype. The engine owns it from then on (weight formats transform it in place)."""
        return cls(None, config, model=model, **kwargs)

    def _make_runner(self, num_blocks: int, max_num_seqs: int, graphs: bool = False) -> ModelRunner:
        graph_max_batch = max_num_seqs if graphs and self.config.cuda_graphs else 0
        return ModelRunner(
            self.model, self.args.num_layers, self.args.num_kv_heads, self.args.head_dim,
            self.kv_format, num_blocks, self.config.kv.block_size, self.device, max_num_seqs=max_num_seqs,
            fast=self.fast, graph_max_batch=graph_max_batch, max_model_len=self.max_model_len,
        )

    def _require_kernels(self, setting: str) -> None:
        from kv4rl.kernels import kernels_usable

        if not kernels_usable(self.device):
            raise ValueError(f"{setting} cannot run here: it needs Triton and a CUDA device")

    def _choose_attention(self):
        """The Triton decode path when `engine.attention_backend` and the hardware allow it; logged."""
        from kv4rl.engine.fast_path import FastAttention, fast_path_problem

        backend = self.config.attention_backend
        problem = "engine.attention_backend=torch" if backend == "torch" else fast_path_problem(
            self.kv_format, self.dtype, self.args.head_dim, self.device)
        if problem is not None:
            if backend == "triton":
                raise ValueError(f"engine.attention_backend=triton cannot run here: {problem}")
            self.attention_desc = f"attention: torch reference ({problem})"
            return None
        graphs = "CUDA graphs" if self.config.cuda_graphs and self.device.type == "cuda" else "eager"
        fast = FastAttention(self.kv_format, self.args.num_kv_heads, self.args.head_dim,
                             self.config.kv.block_size, self.device, num_q_heads=self.args.num_heads)
        kernels = "CUDA INT4 + Triton decode kernels" if fast.int4_kernel == "cuda" else "Triton decode kernels"
        self.attention_desc = f"attention: {kernels} ({graphs}) + reference prefill"
        return fast

    def _num_kv_blocks(self, max_num_seqs: int) -> tuple[int, str]:
        """The pool's blocks and how they were chosen: `engine.num_kv_blocks`, every slot at
        `max_model_len` (CPU), or what fits in device memory (CUDA, see `kv4rl.engine.memory`)."""
        cfg, block_size = self.config, self.config.kv.block_size
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks, "engine.num_kv_blocks"
        if self.device.type != "cuda":
            return max_num_seqs * blocks_needed(self.max_model_len, block_size), "max_num_seqs x max_model_len"
        footprint = memory.kv_footprint(
            self.kv_format, self.args.num_layers, self.args.num_kv_heads, self.args.head_dim, block_size)
        activation = memory.measure_step_peak(lambda: self._profile_step(max_num_seqs), self.device)
        total, used = memory.in_use_bytes(self.device)
        blocks = memory.pool_blocks(
            total_bytes=total, fraction=cfg.gpu_memory_fraction, used_bytes=used, activation_bytes=activation,
            footprint=footprint, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
        capped = " (capped at max_num_seqs x max_model_len)" if blocks == max_num_seqs * blocks_needed(
            self.max_model_len, block_size) else ""
        return blocks, (
            f"engine.gpu_memory_fraction={cfg.gpu_memory_fraction:g} of {memory.format_bytes(total)}: "
            f"{memory.format_bytes(used)} in use, {memory.format_bytes(activation)} step peak{capped}"
        )

    @torch.inference_mode()
    def _profile_step(self, max_num_seqs: int) -> None:
        """The largest step's work on dummy tokens and a one-block cache: its prefill, then sampling
        for `max_num_seqs` rows with top-k and top-p on (their sorts are the sampler's peak)."""
        seqs = memory.profile_batch(self.config.max_num_batched_tokens, self.max_model_len, max_num_seqs,
                                    self.config.kv.block_size)
        self._make_runner(1, 1).forward(seqs)
        rows = {"size": (max_num_seqs,), "device": self.device}
        sample(torch.zeros(max_num_seqs, self.args.vocab_size, device=self.device),
               torch.ones(**rows), torch.ones(**rows, dtype=torch.long), torch.full(fill_value=0.5, **rows),
               torch.zeros(**rows, dtype=torch.long), torch.zeros(**rows, dtype=torch.long))

    def kv_bytes_per_token(self, context_len: int) -> float:
        """KV storage per token over all layers, K and V, scales and protected copies at `context_len`."""
        per_layer = self.kv_format.bytes_per_token(self.args.num_kv_heads, self.args.head_dim, context_len)
        return per_layer * self.args.num_layers

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, tag: Any = None,
                    sample_seed: int | None = None, resume_from: Completion | None = None) -> Sequence:
        """Queue one request. `sample_seed` fixes its random stream (default: drawn from the engine's).

        `resume_from` continues a partially generated response (tokens, log-probs and versions kept);
        its KV is recomputed by the prefill.
        """
        params.validate()
        if not prompt_ids:
            raise ValueError("empty prompt")
        if sample_seed is None:
            sample_seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        seq = Sequence(list(prompt_ids), params, tag=tag, sample_seed=sample_seed)
        if resume_from is not None:
            seq.output_ids = list(resume_from.token_ids)
            seq.output_logprobs = list(resume_from.logprobs)
            seq.output_versions = list(resume_from.versions)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Remove an unfinished request (its blocks are freed); it is never returned by `step`."""
        self.scheduler.abort(seq)

    def recompute_all(self) -> None:
        """Drop every running sequence's KV so it is re-prefilled under the current weights."""
        self.scheduler.preempt_all()

    def unfinished(self) -> list[Sequence]:
        return list(self.scheduler.running) + list(self.scheduler.waiting)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """Advance every scheduled sequence by one token; return the ones that finished.

        `last_step` afterwards describes the step for rollout traces: batch size, prefill or decode,
        new (prefill + decode) tokens, mean context length, nominal resident KV bytes, KV blocks in
        use and how many of them are shared, prompt tokens whose prefill sharing saved, and latency.
        """
        t0 = time.perf_counter()
        saved_before = self.scheduler.prefill_tokens_saved
        seqs = self.scheduler.schedule()
        if not seqs:
            raise RuntimeError("scheduler produced an empty batch with requests pending")
        blocks = self.scheduler.blocks
        kv_blocks, shared_blocks = blocks.num_blocks - blocks.num_free_blocks, blocks.num_shared_blocks
        new_tokens = sum(s.num_new_tokens for s in seqs)
        logits = self.runner.forward(seqs)
        params = [s.params for s in seqs]
        to = {"device": self.device}
        tokens, logprobs = sample(
            logits,
            torch.tensor([p.temperature for p in params], dtype=torch.float32, **to),
            torch.tensor([p.top_k for p in params], dtype=torch.long, **to),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, **to),
            torch.tensor([s.sample_seed for s in seqs], dtype=torch.long, **to),
            torch.tensor([len(s.output_ids) for s in seqs], dtype=torch.long, **to),
            fused=self.sampler == "triton",
        )
        finished = []
        for seq, tok, lp in zip(seqs, tokens.tolist(), logprobs.tolist()):
            seq.append(tok, lp, self.version)
            stop_ids = self.eos_ids if seq.params.stop_token_ids is None else frozenset(seq.params.stop_token_ids)
            reason = self.scheduler.stop_reason(seq, stop_ids)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                finished.append(seq)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        resident = sum(len(s) for s in self.scheduler.running) + sum(len(s) for s in finished)
        self.last_step = {
            "batch_size": len(seqs),
            "new_tokens": new_tokens,
            "context_mean": sum(len(s) for s in seqs) / len(seqs),
            "kv_bytes": resident * self.bytes_per_token,
            "kv_blocks": kv_blocks,
            "shared_blocks": shared_blocks,
            "prefill_tokens_saved": self.scheduler.prefill_tokens_saved - saved_before,
            "latency_s": time.perf_counter() - t0,
        }
        return finished

    def generate(
        self,
        prompts: Iterable[list[int] | str],
        params: SamplingParams | None = None,
        tags: Iterable[Any] | None = None,
        progress: Any = None,
    ) -> list[Completion]:
        """Run prompts to completion; results in input order. `progress(n_done)` is called per finish."""
        params = params or SamplingParams()
        prompts = list(prompts)
        tags = list(tags) if tags is not None else [None] * len(prompts)
        seeds = [None] * len(prompts) if params.seed is None else [request_seed(params.seed, i)
                                                                   for i in range(len(prompts))]
        seqs = [self.add_request(self._encode(p), params, t, s) for p, t, s in zip(prompts, tags, seeds)]
        done = 0
        while self.has_unfinished():
            done += len(self.step())
            if progress is not None:
                progress(done)
        out = [Completion.from_sequence(s) for s in seqs]
        if self.tokenizer is not None:
            for c in out:
                c.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return out

    @torch.inference_mode()
    def score_tokens(self, prompts: list[list[int]], forced: list[list[int]]) -> list[torch.Tensor]:
        """Teacher forcing: for each prompt, float32 logits[T, V] of its forced tokens, row t given
        `prompt + forced[:t]`.

        Each sequence is prefilled with its prompt, then decodes its forced tokens one at a time from
        the engine's own KV cache, exactly as sampling would (a quantized cache attends over its
        quantized history). Sequences are batched and may be preempted and recomputed like any other.
        """
        if self.has_unfinished():
            raise RuntimeError("score_tokens needs an idle engine (finish or abort pending requests first)")
        if len(prompts) != len(forced):
            raise ValueError(f"score_tokens: {len(prompts)} prompts but {len(forced)} forced sequences")
        for prompt, tokens in zip(prompts, forced):
            if not tokens:
                raise ValueError("score_tokens: every forced sequence needs at least one token")
            if len(prompt) + len(tokens) > self.max_model_len:
                raise ValueError(
                    f"score_tokens: {len(prompt)} prompt + {len(tokens)} forced tokens exceed "
                    f"max_model_len={self.max_model_len}"
                )
        seqs = [
            self.add_request(p, SamplingParams(temperature=0.0, max_tokens=len(f), ignore_eos=True), sample_seed=0)
            for p, f in zip(prompts, forced)
        ]
        forced_by_id = {s.seq_id: f for s, f in zip(seqs, forced)}
        rows: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        while self.has_unfinished():
            batch = self.scheduler.schedule()
            logits = self.runner.forward(batch)
            logprobs = logits.log_softmax(-1)
            for i, seq in enumerate(batch):
                t = len(seq.output_ids)
                assert len(rows[seq.seq_id]) == t, "a forced position was scored twice or skipped"
                rows[seq.seq_id].append(logits[i].clone())  # graph outputs are reused
                token = forced_by_id[seq.seq_id][t]
                seq.append(token, float(logprobs[i, token]), self.version)
                if self.scheduler.stop_reason(seq, frozenset()) is not None:
                    self.scheduler.finish(seq, "length")
        return [torch.stack(rows[s.seq_id]) for s in seqs]

    def _encode(self, prompt: list[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need an Engine built with a tokenizer")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy learner weights (HF names) in place; tokens sampled afterwards carry `version`.
        FP8 linears re-quantize from the incoming tensors as they are copied."""
        self.model.load_hf_state_dict(state_dict)
        self.version = version
        self.scheduler.forget_prefixes()  # later requests must not reuse prompt KV of the old weights

    def _apply_weight_format(self) -> str:
        """Transform the loaded model for `weight_format`; returns the summary's description."""
        if self.config.weight_format != "fp8":
            return f"weights {self.config.weight_format}"
        from kv4rl.engine.fp8_weights import apply_fp8_weights, fp8_path

        apply_fp8_weights(self.model)
        return f"fp8 weights: {fp8_path(self.model, self.dtype, self.device)}"

    def weights_state(self) -> dict[str, torch.Tensor]:
        """The engine's weights under its own names, on CPU (FP8 codes and scales stay exact)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def load_weights_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Restore weights saved by `weights_state`; tokens sampled afterwards carry `version`."""
        self.model.load_state_dict(state)
        self.version = version
        self.scheduler.forget_prefixes()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_shared_blocks(self) -> int:
        """KV blocks held by more than one running sequence right now (prefix sharing)."""
        return self.scheduler.blocks.num_shared_blocks

    @property
    def num_prefill_tokens_saved(self) -> int:
        """Prompt tokens, over the engine's life, that forked requests did not prefill."""
        return self.scheduler.prefill_tokens_saved
