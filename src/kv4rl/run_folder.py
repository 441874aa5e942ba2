"""A run folder holds exactly one run, and a failed start never changes it.

`runs/<name>/` holds one run's `config.yaml`, `metrics.jsonl`, `rollout_trace.jsonl` and
`checkpoints/`. Training into a folder that already holds a run stops before any work (continue it
with `--resume`, pick another `name=`, or `--overwrite`, which renames the old folder to a sibling
and never deletes it). Nothing is written until the run's first iteration has succeeded: every
start-up check (model, data, engine, learner, the first rollout and update) runs first, so a start
that fails leaves an existing folder byte for byte as it was.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from kv4rl.config import RunConfig, load_config, save_config
from kv4rl.config_loader import ConfigError, apply_overrides
from kv4rl.paths import file_in_path, free_sibling
from kv4rl.telemetry.metrics import JsonlWriter
from kv4rl.trainer.checkpoint import clear_stale_temps, set_aside_newer

log = logging.getLogger(__name__)

RUN_FILES = ("config.yaml", "metrics.jsonl", "rollout_trace.jsonl", "checkpoints")


class RunFolderError(ValueError):
    """The run folder cannot be used as asked (it holds another run, or has nothing to resume)."""


def run_contents(run_dir: Path) -> list[str]:
    """Which of a run's files `run_dir` holds (empty: it holds no run and may be trained into)."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def check_new_run(run_dir: Path, overwrite: bool) -> None:
    """Refuse, before any work, to train into a folder holding a run unless `overwrite`."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"{run_dir} is a file, not a run folder")
    blocking = file_in_path(run_dir.parent)
    if blocking is not None:
        raise RunFolderError(f"{run_dir}: cannot create the run folder, {blocking} is a file "
                             f"(out_dir={run_dir.parent})")
    held = run_contents(run_dir)
    if held and not overwrite:
        raise RunFolderError(
            f"{run_dir} already holds a run ({', '.join(held)}); continue it with `--resume {run_dir}`, "
            f"train into another folder with name=..., or start over with --overwrite (the old run is "
            f"moved aside, not deleted)")


def set_aside(run_dir: Path) -> Path:
    """Rename `run_dir` to a new sibling `<name>.old-<time>[-k]`; returns the new path."""
    target = free_sibling(run_dir, f".old-{time.strftime('%Y%m%d-%H%M%S')}")
    os.rename(run_dir, target)
    return target


def config_for_resume(folder: Path, overrides: list[str]) -> RunConfig:
    """The config saved in `folder`, with `overrides`, placed in `folder` itself.

    The folder given is the run: a copied or moved run folder resumes where it is, whatever
    `name`/`out_dir` its config.yaml recorded (they are rewritten at the first iteration).
    """
    saved = folder / "config.yaml"
    if not folder.exists():
        raise RunFolderError(f"--resume {folder}: no such folder")
    if not folder.is_dir():
        raise RunFolderError(f"--resume {folder}: is a file, not a run folder")
    if not saved.is_file():
        raise RunFolderError(f"--resume {folder}: no config.yaml there (is it a run folder?)")
    moved = sorted(set(apply_overrides({}, overrides)) & {"name", "out_dir"})
    if moved:
        raise ConfigError(f"--resume {folder}: {' and '.join(moved)} {'come' if len(moved) > 1 else 'comes'} "
                          f"from the folder resumed; leave {'them' if len(moved) > 1 else 'it'} out (copy the "
                          f"folder to resume it elsewhere)")
    place = folder if folder.name not in ("", ".", "..") else folder.resolve()
    cfg = load_config(saved, overrides)
    _check_kept_on_resume(folder, load_config(saved), cfg)
    cfg.name, cfg.out_dir = place.name, str(place.parent)
    return cfg.validate()


def _check_kept_on_resume(folder: Path, saved: RunConfig, cfg: RunConfig) -> None:
    """Refuse overrides a run cannot take midway: another starting model (the reference of kl_ref and the
    fingerprint in every row would change under it), or a partial run continued as sync (its checkpoints
    hold responses in flight that a sync collection does not carry)."""
    swapped = [f"model.{key}" for key in ("path", "testbed") if getattr(cfg.model, key) != getattr(saved.model, key)]
    if swapped:
        raise ConfigError(
            f"--resume {folder}: {' and '.join(swapped)} cannot change on resume: the run's starting model is its "
            f"reference (kl_ref) and its fingerprint in every row. To train this run's checkpoint under another "
            f"setup, start a new run with model.path={folder / 'checkpoints' / '<iter_N>'}; if the model folder "
            f"only moved, change model.path in {folder / 'config.yaml'}")
    if saved.rollout.mode == "partial" and cfg.rollout.mode == "sync":
        raise ConfigError(f"--resume {folder}: rollout.mode=sync cannot take over a partial run: its checkpoints "
                          f"hold responses in flight that a sync collection does not carry; resume it as partial "
                          f"(switching sync -> partial works)")


class RunFolder:
    """Writes one run's files; the first write creates (fresh) or reopens (resume) the folder."""

    def __init__(self, cfg: RunConfig, run_id: str | None, resume_from: int | None, overwrite: bool,
                 model_sha256: str | None = None):
        """`run_id` None starts a new run; `resume_from` is the checkpoint's iteration on resume;
        `model_sha256`: the starting model's fingerprint (`kv4rl.models.fingerprint`), in every row."""
        self.cfg = cfg
        self.model_sha256 = model_sha256
        self.path = cfg.run_dir
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.resume_from = resume_from
        self.overwrite = overwrite
        self.opened = False
        self.moved_to: Path | None = None
        self.metrics = JsonlWriter(self.path / "metrics.jsonl", resume_from=resume_from)
        self.trace = JsonlWriter(self.path / "rollout_trace.jsonl", resume_from=resume_from)

    def open(self) -> None:
        """Make the folder this run's: set an old run aside (--overwrite), clear temporary folders
        an interrupted save left, and write config.yaml. Runs once, at the first write."""
        if self.opened:
            return
        if self.resume_from is None:
            check_new_run(self.path, self.overwrite)  # again: another process may have started meanwhile
            if run_contents(self.path):
                self.moved_to = set_aside(self.path)
                log.warning("moved the previous run in %s to %s", self.path, self.moved_to)
        self.path.mkdir(parents=True, exist_ok=True)
        stale = clear_stale_temps(self.path)
        if stale:
            log.warning("removed unfinished checkpoint saves in %s: %s", self.path / "checkpoints",
                        ", ".join(stale))
        if self.resume_from is not None:
            damaged = set_aside_newer(self.path, self.resume_from)
            if damaged:
                log.warning("set aside the damaged checkpoints newer than the one resumed from, as %s",
                            ", ".join(damaged))
        save_config(self.cfg, self.path / "config.yaml")
        self.opened = True

    def write(self, row: dict, trace: list[dict]) -> None:
        """One iteration's engine trace and metrics row (stamped with the starting model's fingerprint, so
        `kv4rl plot curves` can tell runs of different model builds apart)."""
        self.open()
        self.trace.write_many(trace)
        self.metrics.write({**row, "model_sha256": self.model_sha256})

    def close(self) -> None:
        self.metrics.close()
        self.trace.close()
