"""`kv4rl train --seeds 0,1,2,3`: one run per seed, in parallel processes, into `runs/<name>-s<seed>`.

Why processes: each run owns an engine and a learner, and several small runs share one GPU far better
side by side than one after the other; a crash in one seed must not take the others down. Why every
check first: the run-folder rules (`kv4rl.run_folder`) hold for each seed folder, and a set of seeds
that half starts (two running, one refused) is worse than none, so every config is loaded and every
folder checked (fresh: holds no run unless --overwrite; resume: has a checkpoint) before any starts.

Each child is `kv4rl train` itself with `seed=<s> name=<name>-s<s>` appended to the overrides (they
win over the config file), writing its output to `<out_dir>/<name>-s<seed>.log` while it runs (`.2.log`, ...
where a file stands there already, which stays as it is). When it ends, the log moves into its run folder
as `train.log` (appended on resume); a seed that failed before its first iteration has no folder (or its
old one untouched, or another process's), so its log stays beside it: a child counts as having started
only if it wrote the folder's config.yaml itself, and no other process holds the folder. On CUDA the
children share the device: each gets `engine.gpu_memory_fraction` divided by the number running at once,
counted against its own memory only (`engine.gpu_memory_scope=process`), since they all start together.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kv4rl.config import RunConfig, load_config
from kv4rl.config_loader import apply_overrides
from kv4rl.engine.config import EngineConfig
from kv4rl.run_folder import (FolderInUse, RunFolderError, check_new_run, check_not_in_use, config_for_resume,
                              run_contents)

LOG_NAME = "train.log"


@dataclass
class SeedRun:
    seed: int
    cfg: RunConfig
    args: list[str]  # `kv4rl train` arguments of the child
    log: Path  # where the child writes while it runs
    returncode: int | None = None
    stopped_by: str | None = None  # the signal that stopped the sweep while this seed ran or waited
    seconds: float = 0.0
    final_log: Path | None = None
    replaces: bool = False  # --overwrite of a folder holding a run: the child moves it aside
    process: subprocess.Popen | None = field(default=None, repr=False)
    config_before: tuple | None = None  # the folder's config.yaml (inode, mtime) when the child started
    iterations: int = 0  # read from its metrics.jsonl when it ended, if it wrote the folder
    last_accuracy: float | None = None
    finished_at_signal: bool = False  # its last checkpoint saved, the signal the sweep passed on ended its shutdown
    nothing_to_train: bool = False  # resumed at a checkpoint that already reaches trainer.iterations


def seed_name(name: str, seed: int) -> str:
    return f"{name}-s{seed}"


def _seeds(seeds: list[int]) -> str:
    return f"seed{'s' if len(seeds) > 1 else ''} {','.join(map(str, seeds))}"


def how_to_go_on(folders: dict[int, Path], base: Path) -> list[str]:
    """What each seed's folder allows next: `--resume` of the sweep for those with a checkpoint short of
    their config.yaml's `trainer.iterations` (what such a resume runs to), a higher `trainer.iterations`
    for those whose last checkpoint reaches it (a resume trains nothing, and said so only in the seed's log), the same
    command for those without a folder, and `--overwrite` for a folder holding a run but no checkpoint
    (a resume refuses it and a fresh start does too)."""
    from kv4rl.trainer.checkpoint import checkpoints

    def done(folder: Path) -> int | None:  # the last checkpoint, where it reaches the run's length
        saved_at = checkpoints(folder)
        if not saved_at:
            return None
        try:
            target = load_config(folder / "config.yaml", validate=False).trainer.iterations
        except (OSError, ValueError):
            return None
        return saved_at[-1][0] if saved_at[-1][0] >= target else None

    finished = {s: n for s, d in folders.items() if (n := done(d)) is not None}
    saved = [s for s, d in folders.items() if (d / "checkpoints").is_dir() and s not in finished]
    held = [s for s, d in folders.items() if s not in saved and s not in finished and run_contents(d)]
    absent = [s for s in folders if s not in saved and s not in held and s not in finished]
    parts = []
    if finished:
        seeds = list(finished)
        parts.append(f"{_seeds(seeds)} finished ({', '.join(f'{n} iterations' for n in finished.values())}): to "
                     f"train {'them' if len(seeds) > 1 else 'it'} longer, kv4rl train --seeds "
                     f"{','.join(map(str, seeds))} --resume {shlex.quote(str(base))} trainer.iterations=<more>")
    if saved:
        parts.append(f"continue {_seeds(saved)} with: kv4rl train --seeds {','.join(map(str, saved))} "
                     f"--resume {shlex.quote(str(base))}")
    # "the same command" read as the --resume just printed, which refuses a seed without a folder
    if absent:
        parts.append(f"start {_seeds(absent)} with the command that started the sweep (not --resume), given "
                     f"--seeds {','.join(map(str, absent))}")
    if held:
        parts.append(f"{_seeds(held)} ha{'ve' if len(held) > 1 else 's'} a run but no checkpoint: start "
                     f"{'them' if len(held) > 1 else 'it'} again with the command that started the sweep, --seeds "
                     f"{','.join(map(str, held))} and --overwrite (the old folder is moved aside, not deleted)")
    return parts


def plan_runs(seeds: list[int], config: Path | None, overrides: list[str], resume: Path | None,
              overwrite: bool, extra_args: list[str]) -> list[SeedRun]:
    """Every seed's config and child arguments, after checking every seed folder (errors before any work).

    Fresh: the folders are `<out_dir>/<name>-s<seed>` of the config (name from the file or `name=`).
    Resume: `--resume runs/<name>` continues `runs/<name>-s<seed>` for each seed.
    """
    from kv4rl.run_setup import find_restore

    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: {seeds} repeats a seed; each seed is one run folder")
    if "seed" in apply_overrides({}, overrides):
        raise ValueError("--seeds sets each run's seed; leave seed= out")
    runs = []
    if resume is not None:
        folders = {seed: resume.with_name(seed_name(resume.name, seed)) for seed in seeds}
        unsaved = [seed for seed, folder in folders.items() if not (folder / "checkpoints").is_dir()]
        if not any(folder.exists() for folder in folders.values()):
            raise RunFolderError(f"--seeds {','.join(map(str, seeds))} --resume {resume}: "
                                 f"{', '.join(map(str, folders.values()))}: no such folder (--resume takes the "
                                 "sweep's runs/<name>, each seed's folder being runs/<name>-s<seed>)")
        if unsaved:  # a seed the stopped sweep never started (or stopped before its first checkpoint)
            raise RunFolderError(f"--seeds {','.join(map(str, seeds))} --resume {resume}: {_seeds(unsaved)} ha"
                                 f"{'ve' if len(unsaved) > 1 else 's'} no checkpoint to continue from; "
                                 + "; ".join(how_to_go_on(folders, resume)))
        for seed, folder in folders.items():
            cfg = config_for_resume(folder, overrides)
            restore = find_restore(cfg)  # refuses a folder with no checkpoint
            runs.append(SeedRun(seed, cfg, ["--resume", str(folder), *overrides, *extra_args], _log_path(cfg),
                                nothing_to_train=restore.state["iteration"] >= cfg.trainer.iterations))
        return runs
    base = load_config(config, overrides)
    for seed in seeds:
        # quoted: a name YAML would read otherwise (`exp #1` was cut at its comment) stays whole
        mine = [*overrides, f"seed={seed}", f"name={json.dumps(seed_name(base.name, seed), ensure_ascii=False)}"]
        cfg = load_config(config, mine)
        try:
            check_new_run(cfg.run_dir, overwrite, cfg)
        except FolderInUse:
            raise  # names the process writing it; no hint of ours would work before it ends
        except RunFolderError as exc:
            if not cfg.run_dir.is_dir():
                raise
            # the hint is the sweep's, not one seed's: what each seed's folder allows
            folders = {s: cfg.run_dir.with_name(seed_name(base.name, s)) for s in seeds}
            steps = how_to_go_on(folders, Path(base.out_dir) / base.name)
            raise RunFolderError(
                f"{cfg.run_dir} already holds a run; {'; '.join(steps)}; or give another name=..., or start every "
                f"seed over with --overwrite (the old runs are moved aside, not deleted)") from exc
        args = (["--config", str(config)] if config is not None else []) + mine
        runs.append(SeedRun(seed, cfg, args + (["--overwrite"] if overwrite else []) + extra_args, _log_path(cfg),
                            replaces=overwrite and bool(run_contents(cfg.run_dir))))
    return runs


def _log_path(cfg: RunConfig) -> Path:
    return Path(cfg.out_dir) / f"{cfg.name}.log"


def default_parallel(runs: list[SeedRun]) -> int:
    """All seeds at once on CUDA, one at a time on the CPU (the cores are already shared by torch)."""
    from kv4rl.engine.placement import resolve_device

    return len(runs) if resolve_device(runs[0].cfg.device).type == "cuda" else 1


def share_device(runs: list[SeedRun], parallel: int) -> None:
    """Give each of `parallel` concurrent CUDA runs its part of the device's memory (engine pool sizing)."""
    from kv4rl.engine.placement import resolve_device

    if parallel < 2 or resolve_device(runs[0].cfg.device).type != "cuda":
        return
    for run in runs:
        resumed = run.args[0] == "--resume"
        # a resumed run's saved fraction may already be a share; never hand it more than a fresh share
        full = EngineConfig().gpu_memory_fraction if resumed else run.cfg.engine.gpu_memory_fraction
        share = min(run.cfg.engine.gpu_memory_fraction, full / parallel) if resumed else full / parallel
        run.args += [f"engine.gpu_memory_fraction={share:.4f}", "engine.gpu_memory_scope=process"]


def launch(runs: list[SeedRun], parallel: int, announce=print) -> list[int]:
    """Run every seed's child, at most `parallel` at a time. SIGINT/SIGTERM stop the sweep: they are passed
    on to the running children (each then stops after its iteration with a checkpoint, as a single run
    does) and the seeds still waiting are not started; the hint printed then (`continue_hint`) says how to
    go on with each: `--seeds ... --resume` for those with a checkpoint, the same command for the others.
    Returns the signals received, in order (a second one ends the running children at once, as it ends a run)."""
    from kv4rl.graceful_stop import take_early

    pending, active, received = list(runs), [], []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    early = take_early()  # a signal while the sweep read its configs: no seed starts, exit 0 as a single run
    if early is not None:
        for run in pending:
            run.stopped_by = early
        announce(f"{early}: seeds {', '.join(str(r.seed) for r in pending)} will not start")
        return [signal.Signals[early]]

    def forward(signum, frame) -> None:
        received.append(signum)
        name = signal.Signals(signum).name
        for run in active:
            if run.process is not None and run.process.poll() is None:
                run.process.send_signal(signum)
                run.stopped_by = name
        for run in pending:
            run.stopped_by = name
        if pending:
            announce(f"{name}: seeds {', '.join(str(r.seed) for r in pending)} will not start")
        pending.clear()

    for s in previous:
        signal.signal(s, forward)
    try:
        while pending or active:
            while pending and len(active) < parallel:
                run = pending.pop(0)
                _start(run)
                active.append(run)
                aside = f"; the run in {run.cfg.run_dir} is moved aside ({run.cfg.name}.old-<time>)" if run.replaces else ""
                announce(f"seed {run.seed}: started, log {run.log}{aside}")
            time.sleep(0.2)
            for run in [r for r in active if r.process.poll() is not None]:
                active.remove(run)
                _finish(run)
                announce(f"seed {run.seed}: {status_of(run)} in {run.seconds:.0f} s, log {run.final_log}")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return received


def _config_identity(folder: Path) -> tuple | None:
    try:
        stat = (folder / "config.yaml").stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _held_by_another(folder: Path) -> bool:
    """Whether another process trains in `folder` now (this seed's child has ended, so the lock is not its)."""
    try:
        check_not_in_use(folder)
    except FolderInUse:
        return True
    return False


def _claim_log(path: Path) -> tuple[Path, int]:
    """A log file of this sweep's own, made exclusively: `path`, or `<name>.2.log`, `.3`, ... where a file stands
    there already (a failed start's log, another sweep's running child's, a user's own file), which is then
    neither appended to nor, when the seed ends, deleted."""
    candidate, k = path, 1
    while True:
        try:
            return candidate, os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            k += 1
            candidate = path.with_name(f"{path.stem}.{k}{path.suffix}")


def _start(run: SeedRun) -> None:
    run.config_before = _config_identity(run.cfg.run_dir)
    run.log.parent.mkdir(parents=True, exist_ok=True)
    run.log, fd = _claim_log(run.log)
    handle = os.fdopen(fd, "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # its own session: a Ctrl-C in the terminal reaches the parent only, which passes it on once
    run.process = subprocess.Popen([sys.executable, "-m", "kv4rl.cli", "train", *run.args], stdout=handle,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    handle.close()
    run.seconds = time.perf_counter()


def _finish(run: SeedRun) -> None:
    run.returncode = run.process.returncode
    run.seconds = time.perf_counter() - run.seconds
    folder = run.cfg.run_dir
    resumed = run.args[:1] == ["--resume"]  # its own folder, checked to hold its checkpoint
    config_now = _config_identity(folder)
    if config_now is None or (not resumed and config_now == run.config_before) or _held_by_another(folder):
        # it never wrote the folder (held: another sweep's child wrote the config.yaml and trains there, this one
        # was refused): the log stays beside it, whoever's run the folder holds
        run.final_log = run.log
        return
    from kv4rl.telemetry.metrics import read_jsonl
    from kv4rl.trainer.checkpoint import checkpoints

    rows = read_jsonl(folder / "metrics.jsonl") if (folder / "metrics.jsonl").is_file() else []
    run.iterations, run.last_accuracy = len(rows), (rows[-1].get("accuracy") if rows else None)  # now, not later
    saved = checkpoints(folder)  # not the rows: those past the last checkpoint stay until a resume rewrites them
    if saved and saved[-1][0] >= run.cfg.trainer.iterations:
        if run.returncode == 0:
            run.stopped_by = None  # the signal came during its last iteration: it finished, nothing to resume
        elif run.stopped_by:  # it came as the finished run shut down: killed then, with its last checkpoint saved
            run.finished_at_signal = True
    target = folder / LOG_NAME
    with target.open("a") as out:
        out.write(run.log.read_text())
    run.log.unlink()
    run.final_log = target


def status_of(run: SeedRun) -> str:
    """finished, stopped (a signal ended it with a checkpoint, or it never started), or failed."""
    if run.returncode is None:
        return f"not started ({run.stopped_by})" if run.stopped_by else "not started"
    if run.finished_at_signal:
        return f"finished ({run.stopped_by} as it shut down, exit {run.returncode})"
    if run.returncode != 0:  # a signal the sweep passed on ends it as stopped, whatever the child's code
        return f"stopped ({run.stopped_by}, exit {run.returncode})" if run.stopped_by else f"failed (exit {run.returncode})"
    if run.stopped_by:
        return f"stopped ({run.stopped_by})"
    return (f"finished (nothing trained: its checkpoint had reached trainer.iterations={run.cfg.trainer.iterations})"
            if run.nothing_to_train else "finished")


def continue_hint(runs: list[SeedRun]) -> str:
    """How to go on after a stopped sweep (`how_to_go_on` over its seeds' folders)."""
    first = runs[0]
    base = first.cfg.run_dir.with_name(first.cfg.name.removesuffix(f"-s{first.seed}"))
    return "; ".join(how_to_go_on({r.seed: r.cfg.run_dir for r in runs if not r.finished_at_signal}, base))


def failed(runs: list[SeedRun]) -> list[int]:
    """Seeds that ended badly on their own (not stopped by a signal the sweep passed on)."""
    return [r.seed for r in runs if r.returncode not in (0, None) and not r.stopped_by]


def summary_rows(runs: list[SeedRun]) -> list[list[str]]:
    """One row per seed: seed, folder, status, iterations logged, last accuracy, seconds, log (the numbers
    read when the seed ended, from its folder only if it wrote it)."""
    rows = []
    for run in runs:
        accuracy = run.last_accuracy
        rows.append([str(run.seed), str(run.cfg.run_dir), status_of(run), str(run.iterations),
                     "-" if accuracy is None else f"{accuracy:.3f}", f"{run.seconds:.0f}",
                     "-" if run.final_log is None else str(run.final_log)])
    return rows
