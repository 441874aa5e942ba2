"""A run folder holds exactly one run, and a failed start never changes it.

`runs/<name>/` holds one run's `config.yaml`, `metrics.jsonl`, `rollout_trace.jsonl` and
`checkpoints/`. Training into a folder that already holds a run stops before any work (continue it
with `--resume`, pick another `name=`, or `--overwrite`, which renames the old folder to a sibling
and never deletes it). Nothing is written until the run's first iteration has succeeded: every
start-up check (model, data, engine, learner, the first rollout and update) runs first, so a start
that fails leaves an existing folder byte for byte as it was.

One process at a time: the writing process holds an exclusive lock on the folder itself (`flock` on
its descriptor, so no file is written and the lock ends with the process). A second `train` or
`--resume` into a folder in use stops before any work and names the holder's pid; without the lock,
two processes would set each other's checkpoints aside as damaged and interleave their metrics.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
import uuid
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: folders are not locked
    fcntl = None

from kv4rl.closing import close_all
from kv4rl.config import RunConfig, load_config, save_config
from kv4rl.config_loader import ConfigError, apply_overrides, to_dict
from kv4rl.paths import file_in_path, free_sibling
from kv4rl.telemetry.metrics import JsonlWriter
from kv4rl.trainer.checkpoint import clear_stale_temps, set_aside_newer

log = logging.getLogger(__name__)

RUN_FILES = ("config.yaml", "metrics.jsonl", "rollout_trace.jsonl", "checkpoints")


class RunFolderError(ValueError):
    """The run folder cannot be used as asked (it holds another run, or has nothing to resume)."""


class FolderInUse(RunFolderError):
    """Another process holds the run folder's lock."""


def run_contents(run_dir: Path) -> list[str]:
    """Which of a run's files `run_dir` holds (empty: it holds no run and may be trained into)."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def enclosing_run(path: Path) -> Path | None:
    """The run folder whose checkpoints/ `path` lies in (as written, or through symlinks), if any: the run's
    checkpoint pruning deletes its `iter_N` folders whole, and its next save may take the name. (Elsewhere in a
    run folder, --overwrite moves a nested folder aside with it; a project folder's own config.yaml and
    checkpoints/ beside the runs/ it trains into is no run folder.)"""
    for where in (Path(os.path.abspath(path)), Path(path).resolve()):
        for folder in where.parents:
            run = folder.parent
            if folder.name == "checkpoints" and (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file():
                return run
    return None


def lock_folder(folder: Path, shared: bool = False) -> int | None:
    """Take `folder`'s exclusive lock for this process; returns the descriptor that holds it (`unlock_folder`
    releases it), or None where the folder cannot be locked (it is then not guarded). Raises FolderInUse,
    naming the holder, if another process holds it. `shared` only tests for a writer: shared locks do not
    exclude each other, so the ranks of one torchrun job can all check at once."""
    if fcntl is None:
        return None
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:  # unreadable: whatever is done in it next reports that
        log.debug("cannot lock %s (%s)", folder, exc)
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FolderInUse(f"{folder} is in use: {_holder(folder)} is training into it, and two processes writing "
                          f"one run folder would set each other's checkpoints aside and mix their metrics; wait "
                          f"for it to stop") from None
    except OSError as exc:  # e.g. a network file system without flock
        os.close(fd)
        log.debug("cannot lock %s (%s); not guarded against a second writer", folder, exc)
        return None
    return fd


def unlock_folder(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the only descriptor of the lock releases it


def check_not_in_use(folder: Path) -> None:
    """Refuse, before any work, a run folder another process is writing (see `lock_folder`)."""
    if folder.is_dir():
        unlock_folder(lock_folder(folder, shared=True))


def _holder(folder: Path) -> str:
    """'another process (pid N)', the pid read from Linux's lock table where it lists the folder's lock."""
    try:
        inode = os.stat(folder).st_ino
        with open("/proc/locks") as table:
            for line in table:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
                    return f"another process (pid {fields[4]})"
    except OSError:
        pass
    return "another process"


def check_new_run(run_dir: Path, overwrite: bool, cfg=None) -> None:
    """Refuse, before any work, to train into a folder holding a run unless `overwrite`, or into a folder another
    process is writing; with `cfg`, also an overwrite that would move the run's own inputs aside with the old run."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"{run_dir} is a file, not a run folder")
    try:
        check_not_in_use(run_dir)
    except FolderInUse as exc:
        raise FolderInUse(f"{exc}, or train into another folder with name=...") from None
    blocking = file_in_path(run_dir.parent)
    if blocking is not None:
        raise RunFolderError(f"{run_dir}: cannot create the run folder, {blocking} is a file "
                             f"(out_dir={run_dir.parent})")
    outer = enclosing_run(run_dir)
    if outer is not None:
        raise RunFolderError(f"{run_dir} lies inside the checkpoints of the run folder {outer}, whose checkpoint "
                             f"pruning would delete it; train into a folder outside them (out_dir=...)")
    held = run_contents(run_dir)
    if held and not overwrite:
        raise RunFolderError(
            f"{run_dir} already holds a run ({', '.join(held)}); continue it with "
            f"`--resume {shlex.quote(str(run_dir))}`, train into another folder with name=..., or start over with "
            f"--overwrite (the old run is moved aside, not deleted)")
    if held:
        _check_inputs_stay(run_dir, cfg)
        aside = run_dir.name + _ASIDE_SUFFIX.format(time="00000000-000000") + "-99"
        try:
            longest = os.pathconf(run_dir.parent, "PC_NAME_MAX")
        except (OSError, ValueError, AttributeError):
            longest = 255
        if len(os.fsencode(aside)) > longest:
            raise RunFolderError(
                f"{run_dir}: --overwrite moves the old run aside as {run_dir.name}{_ASIDE_SUFFIX.format(time='<time>')}, a name longer "
                f"than the {longest} bytes its file system allows; move or rename it yourself, or train into a "
                f"shorter name=...")


def _check_inputs_stay(run_dir: Path, cfg) -> None:
    """--overwrite moves the old folder aside with everything in it: a data file or model the new run names inside
    it would leave with it, and the new run's config.yaml would point at a path that is gone (its resume fails)."""
    if cfg is None:
        return
    inside = {run_dir.resolve(), Path(os.path.abspath(run_dir))}
    for key, value in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval), ("model.path", cfg.model.path)):
        for one in value if isinstance(value, list | tuple) else [value]:
            # as written too: a link in the folder to a file elsewhere moves aside with it
            if one is not None and inside & {*Path(one).resolve().parents, *Path(os.path.abspath(one)).parents}:
                raise RunFolderError(
                    f"{key}={one} lies inside {run_dir}, which --overwrite moves aside with the old run: this run "
                    f"and its resume would not find it there; move it out of the folder, or train into another name=...")


_ASIDE_SUFFIX = ".old-{time}"


def set_aside(run_dir: Path) -> Path:
    """Rename `run_dir` to a new sibling `<name>.old-<time>[-k]`; returns the new path."""
    target = free_sibling(run_dir, _ASIDE_SUFFIX.format(time=time.strftime('%Y%m%d-%H%M%S')))
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
    try:
        check_not_in_use(folder)
    except FolderInUse as exc:
        raise FolderInUse(f"--resume {exc} before resuming") from None
    moved = sorted(set(apply_overrides({}, overrides)) & {"name", "out_dir"})
    if moved:
        raise ConfigError(f"--resume {folder}: {' and '.join(moved)} {'come' if len(moved) > 1 else 'comes'} "
                          f"from the folder resumed; leave {'them' if len(moved) > 1 else 'it'} out (copy the "
                          f"folder to resume it elsewhere)")
    place = folder if folder.name not in ("", ".", "..") else folder.resolve()
    # checked once, as resumed (placed in the folder, with the overrides): the saved config on its own may
    # hold what a later version refuses but an override mends, and its warnings are not this run's
    cfg = load_config(saved, overrides, validate=False)
    before = load_config(saved, validate=False)
    _check_kept_on_resume(folder, before, cfg)
    cfg.name, cfg.out_dir = place.name, str(place.parent)
    cfg.validate()  # a refused override is said alone, not after a warning of the change it would make
    _say_changed(folder, before, cfg)
    return cfg


def _flat(tree, prefix: str = "") -> dict:
    """A `to_dict` config as dotted keys (`engine.kv.format`)."""
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def _holds_samples(cfg: RunConfig) -> bool:
    """Whether the run's checkpoints hold sampled work (batches sampled ahead, responses in flight)."""
    return cfg.rollout.placement == "colocated" and (cfg.staleness.lag > 0 or cfg.rollout.mode == "partial")


def _say_changed(folder: Path, saved: RunConfig, cfg: RunConfig) -> None:
    """One warning naming every setting the resume's overrides change (`trainer.iterations`, the way to
    train longer, aside unless a decaying learning-rate schedule stretches with it): the run's config.yaml
    takes them, so the rows after the checkpoint were trained under other settings than the rows before,
    which nothing else in the folder records."""
    from kv4rl.distributed import prints_setup_errors

    if not prints_setup_errors():  # under torchrun every rank reads the same folder: one says it
        return
    old, new = _flat(to_dict(saved)), _flat(to_dict(cfg))
    # a decaying schedule runs to trainer.iterations: training longer reshapes the rest of its curve
    kept = ("name", "out_dir") + (("trainer.iterations",) if cfg.trainer.lr_schedule == "constant" else ())
    changed = [key for key in new if key not in kept and new[key] != old.get(key)]
    if changed:
        sampling = _holds_samples(saved) and any(
            key.startswith(("rollout.", "data.prompt_template", "data.chat_template")) for key in changed)
        rescaled = ("rollout.max_new_tokens" in changed and cfg.algo.loss_agg == "token_sum_norm"
                    and cfg.algo.loss_norm_tokens is None)
        log.warning("--resume %s: settings changed from its config.yaml (config.yaml takes them; the rows "
                    "before this resume ran the old ones): %s%s%s", folder,
                    "; ".join(f"{key}: {old.get(key)!r} -> {new[key]!r}" for key in changed),
                    " (the batches the checkpoint holds sampled ahead and its responses in flight keep the "
                    "rollout settings and prompts they were sampled with)" if sampling else "",
                    f" (algo.loss_agg=token_sum_norm divides by rollout.max_new_tokens, so the loss's scale changes "
                    f"with it; algo.loss_norm_tokens={saved.rollout.max_new_tokens} keeps the old one)"
                    if rescaled else "")


def _check_kept_on_resume(folder: Path, saved: RunConfig, cfg: RunConfig) -> None:
    """Refuse overrides a run cannot take midway: another starting model (the reference of kl_ref and the
    fingerprint in every row would change under it), a partial run continued as sync (its checkpoints
    hold responses in flight that a sync collection does not carry), or a switch to or from ReMax while groups are
    held (they were started with or without its greedy response), or another reward where batches sampled ahead hold
    groups `rollout.filter_groups` scored."""
    swapped = [f"model.{key}" for key in ("path", "testbed") if getattr(cfg.model, key) != getattr(saved.model, key)]
    if swapped:
        raise ConfigError(
            f"--resume {folder}: {' and '.join(swapped)} cannot change on resume: the run's starting model is its "
            f"reference (kl_ref) and its fingerprint in every row. To train this run's checkpoint under another "
            f"setup, start a new run with model.path={folder / 'checkpoints' / '<iter_N>'}; if the model folder "
            f"only moved, change model.path in {folder / 'config.yaml'}")
    held = [(key, why) for key, why in (
        ("staleness.lag", "its checkpoints hold the batches sampled ahead for the old lag, which the resumed "
                          "pipeline would keep delivering"),
        ("rollout.group_size", "its checkpoints hold groups of the old size in flight, and advantages are "
                               "computed per group of the configured size"),
        ("engine.tensor_parallel", "its checkpoints hold each engine's prompt stream and work in flight (one "
                                   "engine per tensor-parallel group) and a lagging engine's weights as "
                                   "per-rank slices, which another grouping of the ranks would skip, repeat or "
                                   "fail to load"))
        if _dotted(cfg, key) != _dotted(saved, key)]
    if held:
        key, why = held[0]
        raise ConfigError(f"--resume {folder}: {key} cannot change on resume ({_dotted(saved, key)} -> "
                          f"{_dotted(cfg, key)}): {why}. To train on under another setting, start a new run with "
                          f"model.path={folder / 'checkpoints' / '<iter_N>'}")
    if _holds_samples(saved) and cfg.rollout.temperature != saved.rollout.temperature:
        raise ConfigError(f"--resume {folder}: rollout.temperature cannot change on resume ({saved.rollout.temperature}"
                          f" -> {cfg.rollout.temperature}) of a run with staleness.lag > 0 or partial rollout: its "
                          f"checkpoints hold responses sampled at the old temperature, which the learner would score "
                          f"at the new one (a wrong PPO ratio for their updates). To train on at another "
                          f"temperature, start a new run with model.path={folder / 'checkpoints' / '<iter_N>'}")
    if _holds_samples(saved) and (cfg.advantage.estimator == "remax") != (saved.advantage.estimator == "remax"):
        had = saved.advantage.estimator == "remax"
        raise ConfigError(f"--resume {folder}: advantage.estimator cannot change to or from remax on resume "
                          f"({saved.advantage.estimator} -> {cfg.advantage.estimator}) of a run with staleness.lag > 0 "
                          f"or partial rollout: its checkpoints hold groups in flight {'with' if had else 'without'} "
                          f"ReMax's greedy response. To train on under another estimator, start a new run with "
                          f"model.path={folder / 'checkpoints' / '<iter_N>'}")
    scoring = [f"reward.{key}" for key in ("name", "extra", "weights", "aggregation", "overlong_buffer",
                                             "overlong_penalty", "bias", "scale", "clip")
               if getattr(cfg.reward, key) != getattr(saved.reward, key)]
    if scoring and saved.rollout.filter_groups and saved.staleness.lag > 0 and _holds_samples(saved):
        raise ConfigError(f"--resume {folder}: {', '.join(scoring)} cannot change on resume of a run with "
                          f"rollout.filter_groups and staleness.lag > 0: its checkpoints hold batches sampled ahead "
                          f"whose groups were scored as they finished, under the old reward, which the learner would "
                          f"train beside new scores. To train on under another, start a new run with "
                          f"model.path={folder / 'checkpoints' / '<iter_N>'}")
    if saved.rollout.mode == "partial" and cfg.rollout.mode == "sync":
        raise ConfigError(f"--resume {folder}: rollout.mode=sync cannot take over a partial run: its checkpoints "
                          f"hold responses in flight that a sync collection does not carry; resume it as partial "
                          f"(switching sync -> partial works)")


def _dotted(cfg: RunConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


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
        self.lock: int | None = None
        self.moved_to: Path | None = None
        self.metrics = JsonlWriter(self.path / "metrics.jsonl", resume_from=resume_from)
        self.trace = JsonlWriter(self.path / "rollout_trace.jsonl", resume_from=resume_from)

    def open(self) -> None:
        """Make the folder this run's: take its lock (held until `close`), set an old run aside (--overwrite),
        clear temporary folders an interrupted save left, and write config.yaml. Runs once, at the first
        write. Every check is made again under the lock: another process may have started meanwhile."""
        if self.opened:
            return
        if self.resume_from is None:
            check_new_run(self.path, self.overwrite, self.cfg)
            if run_contents(self.path):
                held = lock_folder(self.path)  # the lock moves with the old folder and is then let go
                try:
                    self.moved_to = set_aside(self.path)
                finally:
                    unlock_folder(held)
                log.warning("moved the previous run in %s to %s", self.path, self.moved_to)
        self.path.mkdir(parents=True, exist_ok=True)
        self.lock = lock_folder(self.path)
        if self.resume_from is None and run_contents(self.path):
            self.close()
            raise RunFolderError(f"{self.path}: another process started a run there meanwhile; nothing was "
                                 f"written, train into another folder with name=...")
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

    def close(self, failing: bool = False) -> None:
        """Close the logs and release the lock, each even if another fails (`closing.close_all`)."""
        lock, self.lock = self.lock, None
        close_all({"metrics log": self.metrics.close, "trace": self.trace.close,
                   "run folder lock": lambda: unlock_folder(lock)}, failing)
