"""Atomic checkpoints: an HF folder (loadable by transformers) plus the trainer's own state.

A checkpoint is written into a temporary sibling folder and renamed into place, and the pointer
file `latest` is replaced atomically afterwards, so a crash at any moment leaves the previous
checkpoint intact and never a half-written one that looks complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

STATE_FILE = "trainer_state.pt"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(run_dir: Path, iteration: int, model, tokenizer, optimizer, extra: dict,
                    keep_last: int) -> Path:
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter_{iteration:06d}"
    tmp = root / f".tmp_iter_{iteration:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save({"iteration": iteration, "optimizer": optimizer.state_dict(), **extra}, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / "latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    for old in sorted(root.glob("iter_*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = checkpoint_root(run_dir) / "latest"
    if not pointer.is_file():
        return None
    path = checkpoint_root(run_dir) / pointer.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"checkpoint pointer {pointer} names {path}, which is incomplete")
    return path


def load_trainer_state(path: Path) -> dict:
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
