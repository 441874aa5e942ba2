"""Load a local Hugging Face checkpoint folder into the engine's decoder, without ``transformers``.

Reads ``config.json`` and the ``*.safetensors`` files (one file, or shards listed by
``model.safetensors.index.json``) with the ``safetensors`` package. Every tensor name and shape is
checked from the file headers before any memory is allocated, so a wrong or incomplete folder fails
in milliseconds with a message naming the problem. ``check_model_folder`` runs the same checks plus
the tokenizer files, for use before a run starts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kv4rl.models.args import ModelArgs
from kv4rl.models.checkpoint_slots import store
from kv4rl.models.decoder import TIED_HEAD_NAME, Decoder
from kv4rl.models.tensor_parallel import TensorParallel

INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"


log = logging.getLogger(__name__)


class ModelFolderError(ValueError):
    """The checkpoint folder is missing something or does not match its config."""


def latest_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint folder a run's `checkpoints/latest` file names, when `path` is that file; else None."""
    path = Path(path)
    if path.name != "latest" or path.parent.name != "checkpoints" or not path.is_file():
        return None
    try:
        name = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return path.parent / name if name and "/" not in name else None


def read_model_args(model_dir: str | Path) -> ModelArgs:
    model_dir = Path(model_dir)
    if model_dir.is_file():
        named = latest_checkpoint(model_dir)
        if named is not None:
            raise ModelFolderError(f"{model_dir} is the file that names a run's newest checkpoint; give the "
                                   f"checkpoint: {named}")
        gguf = (" (a GGUF file is not read directly: convert it to a folder first, as the README's SmolLM2 section "
                "does with kv4rl.models.smollm2)") if model_dir.suffix.lower() == ".gguf" else ""
        raise ModelFolderError(f"model folder {model_dir} is a file; give the folder holding config.json and "
                               f"the *.safetensors weights{gguf}")
    if not model_dir.is_dir():
        raise ModelFolderError(f"model folder {model_dir} does not exist (nothing is downloaded: a Hugging Face Hub "
                               f"id such as Qwen/Qwen3-8B must be downloaded to a local folder first, e.g. with "
                               f"`hf download Qwen/Qwen3-8B --local-dir models/qwen3-8b`)")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        latest = model_dir / "checkpoints" / "latest"
        if latest.is_file():  # a kv4rl run folder: its policies are in its checkpoints
            raise ModelFolderError(f"{model_dir} is a run folder, not a model folder; give one of its checkpoints, "
                                   f"e.g. the newest: {model_dir / 'checkpoints' / latest.read_text().strip()}")
        raise ModelFolderError(f"{model_dir}: config.json is missing")
    try:
        config = json.loads(config_path.read_text())
        args = ModelArgs.from_hf_config(config)
    except (json.JSONDecodeError, ValueError) as error:
        raise ModelFolderError(f"{config_path}: {error}") from error
    return args.with_stop_ids(_generation_eos_ids(model_dir))


def _generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """The `eos_token_id` of `generation_config.json`, where there is one.

    Chat checkpoints often list their end-of-turn token only there (Qwen3's `config.json` names
    `<|im_end|>`, its `generation_config.json` adds `<|endoftext|>`); `transformers.generate` and
    vLLM stop at both, so the engine does too."""
    path = model_dir / GENERATION_CONFIG_FILE
    if not path.is_file():
        return ()
    try:
        generation = json.loads(path.read_text())
        if not isinstance(generation, dict):
            raise ValueError(f"expected a JSON object, got {type(generation).__name__}")
        return ModelArgs.parse_eos_ids(generation.get("eos_token_id"))
    except (json.JSONDecodeError, ValueError) as error:
        raise ModelFolderError(f"{path}: {error}") from error


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files holding the weights: those named by the shard index, else all of them."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as error:
            raise ModelFolderError(f"{index_path}: unreadable shard index ({error})") from error
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [path.name for path in files if not path.is_file()]
        if absent:
            raise ModelFolderError(f"{model_dir}: shards named in {INDEX_FILE} are missing: {absent}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFolderError(f"{model_dir}: no *.safetensors weight files")
    return files


def tensor_shapes(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (file, shape), read from the headers only. Opening a file also checks that its header's
    tensors cover the file's bytes exactly, so a truncated copy (an interrupted download or save) is
    named here rather than failing mid-load or loading garbage."""
    shapes: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                    shapes[name] = (path, tuple(reader.get_slice(name).get_shape()))
        except (SafetensorError, OSError) as error:
            raise ModelFolderError(
                f"{path}: not a readable safetensors file ({error}); is the copy complete?") from error
    return shapes


def _validated_names(model: Decoder, model_dir: Path, shapes: dict) -> list[str]:
    try:
        return model.check_hf_shapes({name: shape for name, (_, shape) in shapes.items()}, strict=True)
    except ValueError as error:
        raise ModelFolderError(f"{model_dir}: {error}") from error


def _check_tied_head(model_dir: Path, args: ModelArgs, shapes: dict, rows: int = 8192) -> None:
    """A config that ties the embeddings over files that also hold a different `lm_head.weight`: the engine
    uses the embedding as the head, transformers (the learner) unties them and uses the file's head, so the
    two ran different models without a word. Compared `rows` at a time (only such folders pay for it)."""
    embed = "model.embed_tokens.weight"
    if not args.tie_word_embeddings or TIED_HEAD_NAME not in shapes or embed not in shapes:
        return
    (head_file, head_shape), (embed_file, _) = shapes[TIED_HEAD_NAME], shapes[embed]
    with safe_open(head_file, framework="pt") as heads, safe_open(embed_file, framework="pt") as embeds:
        head, table = heads.get_slice(TIED_HEAD_NAME), embeds.get_slice(embed)
        for start in range(0, head_shape[0], rows):
            if not torch.equal(head[start:start + rows], table[start:start + rows]):
                raise ModelFolderError(
                    f"{model_dir}: config.json ties the embeddings (tie_word_embeddings: true), but its weights "
                    f"hold an {TIED_HEAD_NAME} that differs from {embed}; the engine would use the embedding as "
                    f"the head and transformers the file's head. Set tie_word_embeddings to false, or remove "
                    f"{TIED_HEAD_NAME}")


def _has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model")) or all(
        (model_dir / name).is_file() for name in ("vocab.json", "merges.txt")
    )


def check_model_folder(model_dir: str | Path) -> ModelArgs:
    """Validate config, weight headers (names and shapes) and tokenizer files; return the args.

    Raises ModelFolderError naming the first problem found. Allocates no weights.
    """
    model_dir = Path(model_dir)
    args = read_model_args(model_dir)
    shapes = tensor_shapes(weight_files(model_dir))
    with torch.device("meta"):
        _validated_names(Decoder(args), model_dir, shapes)
    _check_tied_head(model_dir, args, shapes)
    if not _has_tokenizer(model_dir):
        raise ModelFolderError(
            f"{model_dir}: no tokenizer files (need tokenizer.json, tokenizer.model, or vocab.json + merges.txt)"
        )
    return args


def load_tokenizer(model_dir: str | Path, vocab_size: int | None = None):
    """The folder's tokenizer (transformers' AutoTokenizer). A file that does not load (a copy cut short)
    raises ModelFolderError naming the folder: transformers' own error named no file ("Expecting property
    name ...: line 46 column 4"). With `vocab_size`, warn when the tokenizer has ids the model has no
    embedding for (a tokenizer of another model), before any of them stops a prompt late."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (ValueError, OSError, ImportError, TypeError, KeyError) as exc:  # JSONDecodeError is a ValueError
        raise ModelFolderError(f"{model_dir}: the tokenizer files do not load ({type(exc).__name__}: "
                               f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}); is the copy "
                               f"complete?") from exc
    if vocab_size is not None and len(tokenizer) > vocab_size:
        log.warning(
            "%s: the tokenizer has %d tokens but config.json's vocab_size is %d: ids %d.. have no embedding (a "
            "prompt holding one is refused); is the tokenizer the model's own?", model_dir, len(tokenizer),
            vocab_size, vocab_size)
    return tokenizer


def load_model(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
    tp: TensorParallel | None = None,
) -> tuple[Decoder, ModelArgs]:
    """Build the decoder (this rank's shard with `tp`) on ``device`` in ``dtype`` and fill it from the
    folder's safetensors; a shard reads only its slices' source tensors, whole, then keeps its slice."""
    model_dir = Path(model_dir)
    device = torch.device(device)
    args = read_model_args(model_dir)
    shapes = tensor_shapes(weight_files(model_dir))
    # Built on meta and then materialised, so no time is spent on random initialisation.
    with torch.device("meta"):
        model = Decoder(args, dtype=dtype, tp=tp)
    names = _validated_names(model, model_dir, shapes)
    model.to_empty(device=device)
    model.tie_weights()
    model.rotary.build_cache(device)
    targets = model.hf_targets()
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(shapes[name][0], []).append(name)
    with torch.no_grad():
        for path, file_names in by_file.items():
            with safe_open(path, framework="pt") as reader:
                for name in file_names:
                    store(targets[name], reader.get_tensor(name))
    return model.eval(), args
