"""Testbed models: a task and a size, warmed up by supervised steps, then cached (`kv4rl build-model`).

Why: the default tiny model answers in ~5 tokens, so KV quantization behind the protected positions
and a finite future-KL window never matter on it. A testbed pairs a synthetic task with exact answers
(`arith`: the tiny model's task; `longmul`: worked long multiplication, hundreds of tokens) with a
model size (`tiny`: the default demo model, `test`: a CPU model built in seconds for tests, `gpu`: a
~25M-parameter Qwen3 with head_dim 128, as on real models, built in minutes on one GPU). The warm-up
is stopped early, where sampled accuracy leaves room for RL to learn.

The folder is an ordinary HF checkpoint plus `kv4rl_testbed.json`, which records the testbed (task,
size, task settings), the recipe and the accuracies measured after the build through the rollout
engine itself (the starting point RL sees). `kv4rl.data.source` reads the task back from that file,
so `model.path=<folder>` or `model.testbed=<name>` trains on the task's own problems and verifier.
The build is atomic (`cache_install`): a second call reloads the finished folder.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from typing import TYPE_CHECKING

import torch
from rich.console import Console

from kv4rl.data.char_tokenizer import build_char_tokenizer
from kv4rl.data.longmul import LongMulTask
from kv4rl.data.synthetic import ArithmeticTask
from kv4rl.models.cache_install import cached_build
from kv4rl.models.fingerprint import build_matches_record, files_sha256, weights_sha256
from kv4rl.models.testbed_spec import TASK_TYPES, TestbedSpec
from kv4rl.models.tiny import _progress_bar, _torch_threads, _transformers_progress_off, default_cache_dir
from kv4rl.models.warmup import measure, warm_up

if TYPE_CHECKING:  # the modeling module loads triton.language at import: kept out of `import kv4rl.loop`,
    # so kernel tests can still switch Triton to its interpreter before it loads (tests/conftest.py)
    from transformers import PreTrainedTokenizerBase, Qwen3Config

VERSION_TAG = "testbed-v1"
METADATA_FILE = "kv4rl_testbed.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", METADATA_FILE)


_GPU_SHAPE = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 128, "intermediate_size": 1536, "max_position_embeddings": 4096}
_TEST_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 32, "intermediate_size": 128, "max_position_embeddings": 512}

SPECS = {
    spec.name: spec
    for spec in (
        TestbedSpec(task="longmul", size="test",
                    task_settings={"min_digits_a": 2, "max_digits_a": 2, "min_digits_b": 1, "max_digits_b": 2},
                    model_shape=_TEST_SHAPE, steps=40, batch_size=16, learning_rate=3e-3, lr_warmup_steps=5,
                    eval_problems=16),
        TestbedSpec(task="longmul", size="gpu",
                    task_settings={"min_digits_a": 4, "max_digits_a": 7, "min_digits_b": 3, "max_digits_b": 6},
                    model_shape=_GPU_SHAPE, steps=1200, batch_size=64, learning_rate=1e-3, lr_warmup_steps=100,
                    eval_problems=512, target_accuracy=0.25, cpu_threads=None),
        TestbedSpec(task="arith", size="test", task_settings=asdict(ArithmeticTask()), model_shape=_TEST_SHAPE,
                    steps=40, batch_size=32, learning_rate=3e-3, lr_warmup_steps=5, eval_problems=32),
    )
}
# `arith-tiny` is the default demo model, built by `kv4rl.models.tiny` (its own cache folder and tests).
TESTBEDS = sorted([*SPECS, "arith-tiny"])


def check_testbed(name: str, option: str = "model.testbed") -> None:
    """Refuse an unknown testbed name, listing the known ones."""
    if name not in TESTBEDS:
        raise ValueError(f"{option}: unknown testbed '{name}' (known: {', '.join(TESTBEDS)})")


def testbed_model_dir(name: str, cache_dir: str | Path | None = None, progress: bool = True,
                      device: str = "auto") -> Path:
    """Folder of the cached testbed `name` (`<task>-<size>`), building it on `device` first if needed."""
    check_testbed(name, "testbed")
    if name == "arith-tiny":
        from kv4rl.models.tiny import tiny_model_dir

        return tiny_model_dir(cache_dir, progress)
    spec = SPECS[name]
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cached_build(parent, f"{VERSION_TAG}-{name}", lambda staging: _write_model(spec, staging, progress, device),
                        lambda path: is_complete(path, spec), f"building the {name} testbed")


def testbed_folder(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where the cached testbed `name` lives (built or not): what `testbed_model_dir` returns."""
    from kv4rl.models.tiny import VERSION_TAG as TINY_TAG

    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return parent / (TINY_TAG if name == "arith-tiny" else f"{VERSION_TAG}-{name}")


def is_complete(model_dir: str | Path, spec: TestbedSpec) -> bool:
    """True when `model_dir` holds every file of a finished build of `spec` at this version."""
    model_dir = Path(model_dir)
    if not all((model_dir / name).is_file() for name in REQUIRED_FILES):
        return False
    metadata = read_metadata(model_dir)
    if metadata is None or metadata.get("version") != VERSION_TAG or metadata.get("recipe") != spec.recipe():
        return False
    return build_matches_record(model_dir)  # a weights file cut short is rebuilt, not reported as the build


def read_metadata(model_dir: str | Path) -> dict | None:
    """The testbed record of a model folder (None when it has none or it does not parse)."""
    try:
        metadata = json.loads((Path(model_dir) / METADATA_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return metadata if isinstance(metadata, dict) else None


def carry_record(base_dir: str | Path, checkpoint_dir: str | Path) -> None:
    """Copy a testbed's record into a checkpoint of a run that started from it, so the checkpoint keeps its
    task (prompts, verifier, eval length) when evaluated or trained from. The build statistics in it are the
    starting model's; `checkpoint_of` says which that was. Its `weights_sha256` is left out: it names the
    starting weights, and a run from the checkpoint recorded it as its own fingerprint (the checkpoint's is
    computed from its files when it is used). Nothing for a model that is not a testbed."""
    metadata = read_metadata(base_dir)
    if metadata is not None:
        metadata.pop("weights_sha256", None)
        metadata.pop("files_sha256", None)  # a checkpoint's config and tokenizer are saved anew
        metadata.setdefault("checkpoint_of", str(base_dir))
        (Path(checkpoint_dir) / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")


def task_of(model_dir: str | Path) -> ArithmeticTask | LongMulTask | None:
    """The task a testbed folder was built for (None for a folder that is not a testbed)."""
    metadata = read_metadata(model_dir)
    if metadata is None or metadata.get("task") not in TASK_TYPES:
        return None
    return TASK_TYPES[metadata["task"]](**metadata["task_settings"])


def model_config(spec: TestbedSpec, tokenizer: PreTrainedTokenizerBase) -> Qwen3Config:
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=len(tokenizer), tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **spec.model_shape)


def _resolve_device(device: str) -> torch.device:
    from kv4rl.engine.placement import resolve_device

    return resolve_device(device)


def _write_model(spec: TestbedSpec, out_dir: Path, progress: bool, device: str) -> None:
    started = time.perf_counter()
    target = _resolve_device(device)
    tokenizer = build_char_tokenizer()
    console = Console(stderr=True)
    threads = _torch_threads(spec.cpu_threads) if spec.cpu_threads and target.type == "cpu" else _no_change()
    with _progress_bar(progress) as bar, torch.random.fork_rng(devices=_rng_devices(target)), threads:
        torch.manual_seed(spec.seed)
        from transformers import Qwen3ForCausalLM

        model = Qwen3ForCausalLM(model_config(spec, tokenizer)).to(device=target, dtype=torch.float32)
        warm = warm_up(spec, model, tokenizer, bar, target)
    train_seconds = time.perf_counter() - started
    model.eval()
    with _transformers_progress_off():
        model.cpu().save_pretrained(out_dir)
    tokenizer.model_max_length = spec.model_shape["max_position_embeddings"]
    tokenizer.save_pretrained(out_dir)
    del model
    measured = measure(out_dir, spec, target)
    metadata = {
        "version": VERSION_TAG,
        "testbed": spec.name,
        "task": spec.task,
        "size": spec.size,
        "task_settings": spec.task_settings,
        "recipe": spec.recipe(),
        "parameters": _parameter_count(out_dir),
        "weights_sha256": weights_sha256(out_dir),
        "files_sha256": files_sha256(out_dir),  # config and tokenizer: an edited one is no longer this build  # which build a run starts from (builds differ by machine)
        "final_loss": warm["losses"][-1],
        "warmup_steps_taken": warm["steps"],
        "exact_solution_probability": warm["estimate"],
        "device": str(target),
        "warmup_seconds": round(train_seconds, 1),
        **measured,
        "build_seconds": round(time.perf_counter() - started, 1),
    }
    # Written last: its presence is what marks the folder complete.
    (out_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    if progress:
        console.print(f"{spec.name} built in {metadata['build_seconds']} s on {target}: accuracy "
                      f"{measured['sampled_accuracy']:.3f} sampled at temperature 1, {measured['greedy_accuracy']:.3f} "
                      f"greedy; mean response {measured['sampled_response_len']:.0f} tokens (worked solutions: "
                      f"{measured['solution_len_mean']:.0f})", highlight=False, soft_wrap=True)


class _no_change:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def _parameter_count(out_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(out_dir / "model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


