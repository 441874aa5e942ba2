"""Output paths a command must not write: a model's own files and a run's records (its log, config, checkpoints).

A typo in `--json` or `--samples` used to replace them without a word; these checks run before any work."""

from __future__ import annotations

from pathlib import Path

from kv4rl.cli_common import fail

MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json", "vocab.json",
               "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt", "tokenizer.model",
               "chat_template.jinja", "chat_template.json", "kv4rl_testbed.json", "kv4rl_tiny.json"}


def check_spares_models_and_runs(outputs: dict[str, Path | None], models: dict[str, Path | None]) -> None:
    """Refuse an output path that is a model folder's own file (`models`: what -> folder; `--json <model>/config.json`
    replaced its config), lies in a run's checkpoints/ (`--samples <run>/checkpoints/latest` replaced its pointer) or
    is a run's own file (`--json <run>/metrics.jsonl` replaced its log): writing there destroys what they hold."""
    from kv4rl.run_folder import enclosing_run

    for option, path in ((o, p) for o, p in outputs.items() if p is not None):
        where = path.resolve()
        for what, folder in ((w, f.resolve()) for w, f in models.items() if f is not None):
            if where == folder or (where.parent == folder and (where.name in MODEL_FILES or where.suffix in (
                    ".safetensors", ".bin", ".pt", ".gguf"))):
                fail(f"{option} {path} is a file of {what} {folder}; writing it would change that model, give another path")
        if enclosing_run(path) is not None:
            fail(f"{option} {path} is inside the checkpoints/ of run {enclosing_run(path)}; give a path outside them")
        run = where.parent
        if is_run_record(where.name) and (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file():
            fail(f"{option} {path} is the {where.name} of the run in {run}; give another path")


def is_run_record(name: str) -> bool:
    """Whether a file of this name in a run folder is one of the run's records: its config, logs (`train.log` of
    --seeds) and TensorBoard events (`plot curves --json <run>/train.log` replaced the log)."""
    from kv4rl.multi_seed import LOG_NAME
    from kv4rl.run_folder import RUN_FILES

    return name in RUN_FILES or name == LOG_NAME or "tfevents" in name or "superseded" in name
