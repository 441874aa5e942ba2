"""Which weights a run started from: a sha256 fingerprint of a model folder's weight files.

Why: the testbeds are trained on whatever machine first needs them, and GPU training is not
bit-reproducible, so two machines build different starting models under the same name and recipe.
Runs record the fingerprint of their starting model (`model_sha256` in every metrics row) so that
`kv4rl plot curves` can tell when a figure compares runs of different builds.

Definition: sha256 over the folder's weight files sorted by name, feeding each file's name (UTF-8) and
then its bytes; hex. The weight files are those its `model.safetensors.index.json` names, as the loader
reads them, else every `*.safetensors` (a stray file beside the shards changes nothing loaded, nor this). Built models store it in their build record (`weights_sha256`);
other folders are hashed when a run starts, unless their weights exceed `MAX_HASHED_BYTES`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# The build records of `kv4rl.models.testbed` and `kv4rl.models.tiny` (named here, not imported: those
# modules load transformers' modeling code, which `import kv4rl.loop` must not).
BUILD_RECORDS = ("kv4rl_testbed.json", "kv4rl_tiny.json")
# Hashing a multi-GB checkpoint at every start costs seconds; such (pretrained) checkpoints are
# identified by their path, so above this they get no fingerprint (null).
MAX_HASHED_BYTES = 2 << 30
ROW_CHARS = 16  # what a metrics row keeps: plenty to tell builds apart


def weight_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    try:
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        shards = {model_dir / name for name in index["weight_map"].values()}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        shards = set(model_dir.glob("*.safetensors"))
    return sorted(shards, key=lambda p: p.name)


def weights_sha256(model_dir: str | Path) -> str:
    """The fingerprint (hex) of `model_dir`'s weight files, computed now; an error if it has none."""
    files = weight_files(model_dir)
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weight files to fingerprint")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def recorded_sha256(model_dir: str | Path) -> str | None:
    """The fingerprint a kv4rl build stored in its record (None: no record, or an older one without it)."""
    return _record(model_dir).get("weights_sha256")


def model_fingerprint(model_dir: str | Path) -> str | None:
    """The fingerprint of a run's starting model: the build record's, else computed on the spot; None
    for a folder without weight files or over `MAX_HASHED_BYTES` of them."""
    recorded = recorded_sha256(model_dir)
    if recorded is not None:
        return recorded
    files = weight_files(model_dir)
    size = sum(p.stat().st_size for p in files)
    if not files or size > MAX_HASHED_BYTES:
        log.info("model %s: no weights fingerprint (%s)", model_dir,
                 "no *.safetensors files" if not files else f"{size / 2**30:.1f} GiB of weights, not hashed")
        return None
    return weights_sha256(model_dir)


def row_fingerprint(model_dir: str | Path) -> str | None:
    """`model_fingerprint` as a metrics row records it (`model_sha256`: its first `ROW_CHARS` hex digits)."""
    found = model_fingerprint(model_dir)
    return None if found is None else found[:ROW_CHARS]


def files_sha256(model_dir: str | Path) -> dict[str, str]:
    """sha256 of each file of a build beside its weights and record (config, tokenizer), by name: a build record
    keeps them, so a cached build whose config.json was edited is not taken for the build (its runs recorded the
    build's fingerprint for another architecture)."""
    model_dir = Path(model_dir)
    skip = {p.name for p in weight_files(model_dir)} | set(BUILD_RECORDS)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(model_dir.iterdir()) if p.is_file() and p.name not in skip}


def build_matches_record(model_dir: str | Path) -> bool:
    """False when a kv4rl build's weights no longer hash to the fingerprint its record stored (a file cut short by a
    crash or a full disk, or edited), one of its other files no longer hashes to the record's `files_sha256` (edited,
    emptied, removed), or they cannot be read; True for a folder whose record stored none of them."""
    recorded = recorded_sha256(model_dir)
    if recorded is None:
        return True
    try:
        if weights_sha256(model_dir) != recorded:
            return False
        files = _record(model_dir).get("files_sha256")
        return not isinstance(files, dict) or all(
            hashlib.sha256((Path(model_dir) / name).read_bytes()).hexdigest() == digest for name, digest in files.items())
    except (OSError, ValueError):
        return False


def _record(model_dir: str | Path) -> dict:
    """The first build record of `model_dir` that stores a weights fingerprint ({} when it has none)."""
    for name in BUILD_RECORDS:
        try:
            record = json.loads((Path(model_dir) / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and isinstance(record.get("weights_sha256"), str):
            return record
    return {}
