"""How far a quantized KV cache moves the next-token distribution: shared-prefix conditional KL (docs/kv-cache.md).

Responses are sampled once by a reference engine (a `bf16` cache by default). Then the reference
engine and one engine per quantized variant teacher-force the same prompt + response tokens, each
prefilling the prompt and decoding the response one token at a time from its own cache, so a
quantized engine attends over its own quantized history exactly as it would while sampling. At every
response position the two next-token distributions are compared over the full vocabulary:
`KL(p_ref ‖ q)` (natural log, temperature 1) and whether the two argmaxes agree. Storage is reported
in bytes per token over all layers at a stated context, scales and KV4's protected copies included.

The reference logits of every response position are kept on the host (`num_response_tokens ×
vocab` floats) while the variants run one engine at a time; KL is computed sequence by sequence.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.kv_formats import KV_FORMATS, kv_format_from_config
from kv4rl.engine.llm import Engine
from kv4rl.engine.placement import resolve_device
from kv4rl.engine.sequence import SamplingParams
from kv4rl.models.hf_weights import load_tokenizer, read_model_args

POSITION_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_CONTEXT = 8192
# KV4's protected budget is 16 + 128; on a model whose context cannot hold twice that, the default
# allocation keeps the same 1:8 sink:recent split over a quarter of the context, so most response
# positions still fall outside the protected window.
DEFAULT_ALLOCATION = (16, 128)


@dataclass(frozen=True, slots=True)
class Variant:
    """One KV representation to measure; `n_sink`/`n_recent` only for kv4."""

    format: str
    n_sink: int | None = None
    n_recent: int | None = None

    @property
    def allocation(self) -> str | None:
        return None if self.n_sink is None else f"{self.n_sink}+{self.n_recent}"

    def kv_config(self, base: KVConfig) -> KVConfig:
        fields = {f: getattr(base, f) for f in KVConfig.__slots__}
        fields["format"] = self.format
        if self.n_sink is not None:
            fields.update(n_sink=self.n_sink, n_recent=self.n_recent)
        return KVConfig(**fields)


def parse_allocations(text: str) -> list[tuple[int, int]]:
    """`"16+128,0+144"` -> [(16, 128), (0, 144)]."""
    out = []
    for item in (part.strip() for part in text.split(",")):
        sink, plus, recent = item.partition("+")
        if not plus or not sink.strip().isdigit() or not recent.strip().isdigit():
            raise ValueError(f"--allocations: {item!r} is not SINK+RECENT (e.g. 16+128)")
        if (int(sink), int(recent)) in out:
            raise ValueError(f"--allocations: {item!r} is given twice")
        out.append((int(sink), int(recent)))
    if not out:
        raise ValueError("--allocations is empty")
    return out


def default_allocation(context_len: int) -> tuple[int, int]:
    """16+128, or the same split over a quarter of a context too short to hold it twice."""
    if context_len >= 2 * sum(DEFAULT_ALLOCATION):
        return DEFAULT_ALLOCATION
    budget = max(2, context_len // 4)
    sink = max(1, round(budget * DEFAULT_ALLOCATION[0] / sum(DEFAULT_ALLOCATION)))
    return sink, budget - sink


def build_variants(formats: list[str], allocations: list[tuple[int, int]]) -> list[Variant]:
    unknown = [f for f in formats if f not in KV_FORMATS]
    if unknown:
        raise ValueError(
            f"--formats: unknown KV format(s) {', '.join(unknown)} (known: {', '.join(sorted(KV_FORMATS))})"
        )
    variants = []
    for name in formats:
        if name == "kv4":
            variants += [Variant(name, sink, recent) for sink, recent in allocations]
        else:
            variants.append(Variant(name))
    return variants


def kl_and_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of [T, V] logits: KL(softmax(ref) ‖ softmax(logits)) in float64, and argmax agreement."""
    log_p = ref_logits.double().log_softmax(-1)
    log_q = logits.double().log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl, ref_logits.argmax(-1) == logits.argmax(-1)


def bucket_label(position: int) -> str:
    """Response-position bucket: "0-15", "16-31", …, "2048+"."""
    for lo, hi in itertools.pairwise(POSITION_BUCKETS):
        if position < hi:
            return f"{lo}-{hi - 1}"
    return f"{POSITION_BUCKETS[-1]}+"


def summarize(variant: Variant, kl: torch.Tensor, agree: torch.Tensor, positions: torch.Tensor,
              bytes_per_token: float, bf16_bytes: float) -> dict:
    by_position: dict[str, list[float]] = {}
    for value, position in zip(kl.tolist(), positions.tolist()):
        by_position.setdefault(bucket_label(position), []).append(value)
    return {
        "format": variant.format,
        "allocation": variant.allocation,
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "kl_by_position": {k: sum(v) / len(v) for k, v in by_position.items()},
        "top1_agree": float(agree.double().mean()),
        "bytes_per_token": bytes_per_token,
        "bytes_vs_bf16": bytes_per_token / bf16_bytes,
        "num_positions": int(kl.numel()),
    }


def _score_in_chunks(engine: Engine, prompts, responses, batch_size: int):
    """Yield each sequence's teacher-forced logits[T, V], `batch_size` sequences per engine pass."""
    for start in range(0, len(prompts), batch_size):
        chunk = slice(start, start + batch_size)
        yield from engine.score_tokens(prompts[chunk], responses[chunk])


def reference_variant(reference: str, max_model_len: int) -> Variant:
    """The reference cache; a kv4 reference keeps the default sink + recent rows for this context (the engine's
    16 + 128 do not fit a short one, and nothing else sets them for the reference)."""
    return Variant(reference, *default_allocation(max_model_len)) if reference == "kv4" else Variant(reference)


def _check_settings(prompts, variants, reference, kv, args, max_model_len: int) -> None:
    """Fail on a bad option before any model work."""
    if not prompts:
        raise ValueError("fidelity needs at least one prompt")
    if reference not in KV_FORMATS:
        raise ValueError(
            f"--reference: unknown KV format '{reference}' (known: {', '.join(sorted(KV_FORMATS))})"
        )
    if max_model_len > args.max_position_embeddings:
        raise ValueError(
            f"longest prompt + --max-new-tokens = {max_model_len} tokens exceed the model's context of "
            f"{args.max_position_embeddings} positions"
        )
    for variant in [reference_variant(reference, max_model_len), *variants]:
        EngineConfig(kv=variant.kv_config(kv), max_model_len=max_model_len).validate()
        kv_format_from_config(variant.kv_config(kv)).check(args.head_dim, max_model_len)


def run_fidelity(
    model_dir: str | Path,
    prompts: list[list[int]],
    variants: list[Variant],
    *,
    reference: str = "bf16",
    kv: KVConfig | None = None,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    ignore_eos: bool = True,
    seed: int = 0,
    context_len: int = DEFAULT_CONTEXT,
    device: str = "auto",
    dtype: str = "auto",
    batch_size: int = 16,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Sample with the `reference` cache, teacher-force through each variant; one result per variant.

    `kv` supplies the shared `engine.kv` keys (block size, group size, rotation, default budget).
    """
    kv = kv or KVConfig()
    args = read_model_args(model_dir)
    max_model_len = max(len(p) for p in prompts) + max_new_tokens if prompts else 0
    _check_settings(prompts, variants, reference, kv, args, max_model_len)
    say = progress or (lambda message: None)

    def engine_for(variant: Variant) -> Engine:
        config = EngineConfig(kv=variant.kv_config(kv), max_model_len=max_model_len)
        return Engine(model_dir, config, max_num_seqs=batch_size, device=device, dtype=dtype, seed=seed)

    def bytes_of(variant: Variant) -> float:
        fmt = kv_format_from_config(variant.kv_config(kv))
        return fmt.bytes_per_token(args.num_kv_heads, args.head_dim, context_len) * args.num_layers

    say(f"sampling {len(prompts)} responses with the {reference} cache")
    ref_engine = engine_for(reference_variant(reference, max_model_len))
    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, ignore_eos=ignore_eos,
                            seed=seed)
    responses = [c.token_ids for c in ref_engine.generate(prompts, params)]
    ref_logits = [t.cpu() for t in _score_in_chunks(ref_engine, prompts, responses, batch_size)]
    model_dtype = str(ref_engine.dtype).removeprefix("torch.")
    del ref_engine
    positions = torch.cat([torch.arange(len(r)) for r in responses])
    bf16_bytes = bytes_of(Variant("bf16"))
    results = []
    for variant in variants:
        say(f"teacher-forcing through {variant.format} {variant.allocation or ''}".rstrip())
        scored = _score_in_chunks(engine_for(variant), prompts, responses, batch_size)
        per_seq = [kl_and_top1(ref.to(logits.device), logits) for ref, logits in zip(ref_logits, scored)]
        kl = torch.cat([k.cpu() for k, _ in per_seq])
        agree = torch.cat([a.cpu() for _, a in per_seq])
        results.append(summarize(variant, kl, agree, positions, bytes_of(variant), bf16_bytes))
    return {
        "model": str(model_dir),
        "reference": reference,
        "reference_allocation": reference_variant(reference, max_model_len).allocation,
        "device": str(resolve_device(device)),
        "dtype": model_dtype,
        "num_prompts": len(prompts),
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "response_tokens_mean": sum(map(len, responses)) / len(responses),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "context_for_bytes": context_len,
        "kv": {"block_size": kv.block_size, "group_size": kv.group_size, "rotate": kv.rotate},
        "model_shape": {"layers": args.num_layers, "kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
                        "vocab": args.vocab_size},
        "results": results,
    }


def kl_order(results: list[dict]) -> str:
    """The variants from lowest to highest mean KL, e.g. "bf16 < fp8 < kv4(16+128) < int4"."""
    ordered = sorted(results, key=lambda r: r["kl_mean"])
    return " < ".join(r["format"] + (f"({r['allocation']})" if r["allocation"] else "") for r in ordered)


def fidelity_prompts(model_dir: Path, data: Path | None, n: int, template: str | None, seed: int,
                     model_len: int) -> tuple[list[list[int]], str]:
    """Token ids of the first `n` problems and the template used; a file gets the boxed-answer
    instruction, a testbed folder its own task, and a prompt that fills the model's context is refused
    by name."""

    from kv4rl.data.prompts import PromptFormatter, check_prompt_lengths
    from kv4rl.data.source import ProblemSource
    from kv4rl.models.testbed import task_of

    source = ProblemSource(None, str(data) if data else None, seed, task=None if data else task_of(model_dir))
    problems = source.eval_problems(n)
    formatter = PromptFormatter(load_tokenizer(model_dir), template or source.default_template)
    prompts = [formatter.ids(p) for p in problems]
    check_prompt_lengths(problems, [len(p) for p in prompts], model_len, "the model's context",
                         f"--data {data}" if data else "embedded task")
    return prompts, formatter.template
