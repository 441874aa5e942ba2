"""Shared by the run-folder tests: tiny training settings and a byte-level picture of a folder."""

from __future__ import annotations

import hashlib
from pathlib import Path

from typer.testing import CliRunner

from kv4rl.cli import app

SMALL = ["rollout.quota_groups=2", "rollout.group_size=2", "device=cpu", "--no-progress"]

runner = CliRunner()


def train_cli(*args: str):
    """`kv4rl train ARGS` in this process; returns the click result."""
    return runner.invoke(app, ["train", *args])


def new_run(out_dir: Path, name: str, *extra: str) -> Path:
    """Train a small run into `out_dir/name` (must succeed); returns its folder."""
    res = train_cli(f"out_dir={out_dir}", f"name={name}", *SMALL, *extra)
    assert res.exit_code == 0, res.output
    return out_dir / name


def tree_state(root: Path) -> dict[str, str]:
    """Every file and folder under `root` (relative path -> sha256 of the bytes, or 'dir')."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def tiny_weights_sha256() -> str:
    """The embedded model's weights fingerprint, by hashlib: name then bytes of its one weight file."""
    from kv4rl.models.tiny import tiny_model_dir

    files = list(tiny_model_dir(progress=False).glob("*.safetensors"))
    assert [f.name for f in files] == ["model.safetensors"]
    return hashlib.sha256(b"model.safetensors" + files[0].read_bytes()).hexdigest()
