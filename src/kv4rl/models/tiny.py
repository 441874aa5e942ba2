"""The tiny Qwen3 that `kv4rl train` uses by default: built once on the CPU, then cached.

Why build instead of download: the default demo must run offline on a 2-core laptop. A randomly
initialised model never answers correctly, so RL would see zero reward; a fully trained one leaves
nothing to learn. The build therefore stops a short supervised warm-up early, at a point where
sampling at temperature 1 is right a fraction of the time and greedy decoding noticeably more often.
RL can close that gap quickly by sharpening the policy, which is what the demo shows.

The checkpoint is an ordinary HF folder (`Qwen3ForCausalLM` + the char tokenizer) plus
`kv4rl_tiny.json` with the settings and measured accuracies. It is written into a temporary folder
next to its final place and renamed into place, so an interrupted build never looks complete.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

from kv4rl.data.char_tokenizer import build_char_tokenizer
from kv4rl.data.synthetic import PROMPT_TEMPLATE, ArithmeticTask, target_text, verify
from kv4rl.data.types import Problem
from kv4rl.models.cache_install import cached_build
from kv4rl.models.fingerprint import build_matches_record, files_sha256, weights_sha256

VERSION_TAG = "tiny-arith-v2"
METADATA_FILE = "kv4rl_tiny.json"
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    METADATA_FILE,
)

TASK = ArithmeticTask()
SEED = 0
WARMUP_STEPS = 300
BATCH_SIZE = 64
LEARNING_RATE = 3e-3
LR_WARMUP_STEPS = 30
EVAL_PROBLEMS = 512
EVAL_SEED = 10_001  # other draws than training (random.Random(SEED)); not disjoint on a small space
MAX_NEW_TOKENS = 12
# Measured on 2 cores: one thread costs ~40% on an idle machine (~18 s vs ~12 s) but is 4-10x faster
# when other processes compete for the cores, where two OpenMP threads stall on each other (build 27 s
# vs 200-370 s). The result is the same either way; one thread also keeps it the same on many-core hosts.
BUILD_THREADS = 1
_WELL_FORMED = re.compile(r"\\boxed\{-?\d+\}")
MODEL_SHAPE = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "max_position_embeddings": 64,
}


def default_cache_dir() -> Path:
    """`$KV4RL_CACHE` if set, else `~/.cache/kv4rl`."""
    env = os.environ.get("KV4RL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kv4rl"


# Half of the warm-up answers are written bare ("16") and half boxed ("\\boxed{16}"), as a base model
# might; the verifier only credits boxed answers, so RL has two things to learn quickly and visibly:
# to box every answer, and to sharpen its arithmetic (greedy is far more accurate than sampling).
BOXED_FRACTION = 0.5


def build_recipe() -> dict:
    """Every setting that shapes the built model, as it round-trips through JSON.

    The cache is keyed on this as well as on `VERSION_TAG`, so editing a setting without bumping the
    tag still triggers a rebuild instead of silently serving a stale model.
    """
    recipe = {
        "task": asdict(TASK),
        "prompt_template": PROMPT_TEMPLATE,
        "model_shape": MODEL_SHAPE,
        "seed": SEED,
        "boxed_fraction": BOXED_FRACTION,
        "warmup": {
            "steps": WARMUP_STEPS,
            "batch_size": BATCH_SIZE,
            "learning_rate": LEARNING_RATE,
            "lr_warmup_steps": LR_WARMUP_STEPS,
        },
        "eval": {"problems": EVAL_PROBLEMS, "seed": EVAL_SEED, "max_new_tokens": MAX_NEW_TOKENS},
    }
    return json.loads(json.dumps(recipe))


def is_complete(model_dir: str | Path) -> bool:
    """True when `model_dir` holds every file of a finished build of this version and recipe."""
    model_dir = Path(model_dir)
    if not all((model_dir / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        metadata = json.loads((model_dir / METADATA_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(metadata, dict) or metadata.get("version") != VERSION_TAG:
        return False
    return all(metadata.get(key) == value for key, value in build_recipe().items()) and build_matches_record(model_dir)


def tiny_model_dir(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Folder of the cached tiny model, building it first if needed (~20 s on 2 cores)."""
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cached_build(parent, VERSION_TAG, lambda staging: _write_model(staging, progress), is_complete,
                        "building the tiny model")


def tiny_config(tokenizer: PreTrainedTokenizerBase) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **MODEL_SHAPE,
    )


def _write_model(out_dir: Path, progress: bool) -> None:
    started = time.perf_counter()
    tokenizer = build_char_tokenizer()
    eval_problems = TASK.problems(EVAL_PROBLEMS, seed=EVAL_SEED)
    with _progress_bar(progress) as bar, torch.random.fork_rng(), _torch_threads(BUILD_THREADS):
        torch.manual_seed(SEED)
        model = Qwen3ForCausalLM(tiny_config(tokenizer)).to(torch.float32)
        _warm_up(model, tokenizer, bar)
        model.eval()
        measured = bar.add_task("measuring accuracy", total=2)
        sampled = evaluate_samples(model, tokenizer, eval_problems, temperature=1.0, seed=EVAL_SEED)
        bar.advance(measured)
        greedy = evaluate_samples(model, tokenizer, eval_problems, temperature=0.0, seed=EVAL_SEED)
        bar.advance(measured)
    with _transformers_progress_off():
        model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    metadata = {
        "version": VERSION_TAG,
        **build_recipe(),
        "weights_sha256": weights_sha256(out_dir),
        "files_sha256": files_sha256(out_dir),  # config and tokenizer: an edited one is no longer this build  # which build a run starts from (`kv4rl.models.fingerprint`)
        "sampled_accuracy": sampled["accuracy"],
        "greedy_accuracy": greedy["accuracy"],
        "sampled_format_error_rate": sampled["format_error_rate"],
        "greedy_format_error_rate": greedy["format_error_rate"],
        "build_seconds": round(time.perf_counter() - started, 1),
    }
    # Written last: its presence is what marks the folder complete.
    (out_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    if progress:
        Console(stderr=True).print(
            f"tiny model built in {metadata['build_seconds']} s: accuracy {sampled['accuracy']:.2f} "
            f"sampled at temperature 1, {greedy['accuracy']:.2f} greedy", soft_wrap=True
        )


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def _transformers_progress_off() -> Iterator[None]:
    """Silence transformers' own tqdm bar while saving; our rich bar already reports the build."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _progress_bar(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )


def _learning_rate_factor(step: int) -> float:
    # Linear ramp, then linear decay to 10%: the decayed end point moves little from step to step, so
    # the accuracies the build lands on are less sensitive to the exact step count and the hardware.
    return min(1.0, (step + 1) / LR_WARMUP_STEPS) * max(0.1, 1.0 - step / WARMUP_STEPS)


def _warm_up(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, bar: Progress) -> None:
    """Supervised steps on freshly drawn problems; loss on the response tokens only."""
    rng = random.Random(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _learning_rate_factor)
    task_id = bar.add_task(f"building {VERSION_TAG}: warm-up", total=WARMUP_STEPS)
    model.train()
    for _ in range(WARMUP_STEPS):
        batch = [TASK.sample(rng) for _ in range(BATCH_SIZE)]
        boxed = [rng.random() < BOXED_FRACTION for _ in batch]
        input_ids, labels = supervised_batch(tokenizer, batch, boxed)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        bar.advance(task_id)


def supervised_batch(
    tokenizer: PreTrainedTokenizerBase, problems: list[Problem], boxed: list[bool] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + response + EOS` ids, and labels that mask out prompt and padding.

    `boxed[i]` False writes problem i's answer bare instead of in `\\boxed{}` (default: all boxed).
    """
    rows = []
    for i, problem in enumerate(problems):
        prompt = tokenizer.encode(PROMPT_TEMPLATE.format(problem=problem.problem))
        text = target_text(problem.answer) if boxed is None or boxed[i] else problem.answer
        response = tokenizer.encode(text) + [tokenizer.eos_token_id]
        rows.append((prompt, response))
    width = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for row, (prompt, response) in enumerate(rows):
        end = len(prompt) + len(response)
        input_ids[row, :end] = torch.tensor(prompt + response)
        labels[row, len(prompt) : end] = torch.tensor(response)
    # Padding sits after every real token, so causal attention never lets it influence them: no mask.
    return input_ids, labels


class SampledResponse(NamedTuple):
    text: str  # decoded tokens before EOS
    stopped: bool  # EOS was produced within the token budget


@torch.no_grad()
def sample_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    temperature: float,
    seed: int,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[SampledResponse]:
    """One completion per prompt; `temperature=0` means greedy.

    Prompts are batched by token length, so no padding or attention mask is needed.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    encoded = [tokenizer.encode(p) for p in prompts]
    buckets: dict[int, list[int]] = {}
    for index, ids in enumerate(encoded):
        buckets.setdefault(len(ids), []).append(index)
    responses: list[SampledResponse] = [SampledResponse("", False)] * len(prompts)
    for length in sorted(buckets):
        indices = buckets[length]
        prompt_ids = torch.tensor([encoded[i] for i in indices], device=device)
        generated = _generate(
            model, prompt_ids, temperature, generator, max_new_tokens, tokenizer.eos_token_id
        )
        for index, (tokens, stopped) in zip(indices, generated):
            responses[index] = SampledResponse(tokenizer.decode(tokens), stopped)
    return responses


def _cache_argument(model: PreTrainedModel) -> str:
    """The forward argument (and output key) that carries the KV cache in this transformers version.

    transformers renamed `past_key_values` to `cache` (5.17 has only the old name; later versions
    accept both but warn on the old one), so ask the signature instead of pinning a version.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _generate(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    temperature: float,
    generator: torch.Generator,
    max_new_tokens: int,
    eos_id: int,
) -> list[tuple[list[int], bool]]:
    outputs: list[list[int]] = [[] for _ in range(prompt_ids.shape[0])]
    finished = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    step_input, cache = prompt_ids, None
    cache_name = _cache_argument(model)
    for _ in range(max_new_tokens):
        result = model(input_ids=step_input, **{cache_name: cache}, use_cache=True, logits_to_keep=1)
        cache = result[cache_name]
        logits = result.logits[:, -1, :].float()
        if temperature == 0:
            tokens = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        token_list = tokens.tolist()
        for row in (~finished).nonzero().flatten().tolist():
            if token_list[row] != eos_id:
                outputs[row].append(token_list[row])
        finished |= tokens == eos_id
        if finished.all():
            break
        step_input = tokens.unsqueeze(1)
    return list(zip(outputs, finished.tolist()))


def measure_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: list[Problem],
    temperature: float,
    seed: int,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> float:
    """Fraction of `problems` answered correctly (per `verify`), one sample each."""
    return evaluate_samples(model, tokenizer, problems, temperature, seed, max_new_tokens)["accuracy"]


def evaluate_samples(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: list[Problem],
    temperature: float,
    seed: int,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> dict[str, float]:
    """Accuracy and format-error rate (anything but exactly `\\boxed{<integer>}` then EOS)."""
    if not problems:
        raise ValueError("need at least one problem to evaluate")
    prompts = [PROMPT_TEMPLATE.format(problem=p.problem) for p in problems]
    responses = sample_responses(model, tokenizer, prompts, temperature, seed, max_new_tokens)
    correct = sum(verify(r.text, p.answer) for r, p in zip(responses, problems))
    well_formed = sum(r.stopped and _WELL_FORMED.fullmatch(r.text) is not None for r in responses)
    return {"accuracy": correct / len(problems), "format_error_rate": 1 - well_formed / len(problems)}
