"""Checkpoints: an HF folder (loadable by transformers) plus the trainer's own state.

A checkpoint is written into a temporary sibling folder (`.tmp_iter_N`) and renamed into place,
and the pointer file `latest` is replaced atomically afterwards, so a crash at any moment leaves the
previous checkpoint intact and never a half-written one that looks complete (the files are synced to
the disk before each rename, so a power loss does not either: `kv4rl.durability`); temporary folders a
kill left behind are cleared when the run folder is next used. `checkpoint.json` records the run
that wrote a checkpoint: retention deletes only that run's own checkpoints, never another's.
Under torchrun every rank writes its optimizer shard (`kv4rl.trainer.optimizer_checkpoint`) into the
temporary folder before rank 0 renames it. A resume takes the newest intact checkpoint (its JSON
files parse, its safetensors headers match the file sizes, its trainer state loads, its optimizer
shards are all there) and names every damaged one it passes over.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from kv4rl.distributed import any_rank, from_main, resume_command
from kv4rl.durability import sync_path, sync_tree
from kv4rl.file_modes import honour_umask
from kv4rl.models.hf_weights import ModelFolderError, check_model_folder
from kv4rl.paths import free_sibling
from kv4rl.trainer.optimizer_checkpoint import SHARDED, optimizer_format, shards_problem
from kv4rl.versions import software_versions

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
META_FILE = "checkpoint.json"
TMP_PREFIX = ".tmp_"
PER_RANK = "per_rank"  # `engine_weights` of a lagging tensor-parallel engine: one file per rank's slice


def engine_slice_file(rank: int) -> str:
    """The checkpoint file of one rank's slice of a lagging tensor-parallel engine's weights."""
    return f"engine_weights.rank{rank}.pt"


def engine_slices_problem(path: Path, state: dict) -> str | None:
    """Why the per-rank engine slices a lagging tensor-parallel engine saved do not all open (a file missing,
    or cut short: its zip directory, at the end, is gone), or None; memory-mapped, so nothing is read."""
    if state.get("engine_weights") != PER_RANK:
        return None
    for rank in range(state.get("world", 1)):
        file = path / engine_slice_file(rank)
        try:
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # noqa: BLE001 - any failure to open means the file is damaged
            return f"{file} does not load ({_one_line(error)})"
    return None

_NAME = re.compile(r"iter_(\d+)")


class CheckpointError(ValueError):
    """No checkpoint of a run folder can be resumed from."""


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(iteration, folder) of every `iter_N` folder, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.fullmatch(p.name))]
    return sorted(found)


def run_of(path: Path) -> str | None:
    """The id of the run that wrote the checkpoint at `path` (None: unknown, e.g. an older layout)."""
    try:
        return json.loads((path / META_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def resume_hint(run_dir: Path, world: int | None = None) -> str:
    """After a failed write: where the run's checkpoints are and the command that continues from the newest
    (on `world` processes; default: as many as this job was started with), if it has any."""
    if not checkpoints(run_dir):
        return ""
    return (f"; the checkpoints in {checkpoint_root(run_dir)} are kept: once that is mended, continue with "
            f"{resume_command(run_dir, world)}")


class SaveFailedElsewhere(OSError):
    """Raised on the other ranks when rank 0 could not write a checkpoint: they stop with it instead of
    waiting for a peer that is going down (its own error line names the file)."""


def save_checkpoint(run_dir: Path | None, iteration: int, write_files: Callable[[Path], None], state: dict,
                    run_id: str | None, keep_last: int | None,
                    write_shards: Callable[[Path], None] | None = None,
                    group: dist.ProcessGroup | None = None) -> Path | None:
    """Write `write_files(folder)` (the HF model and tokenizer) plus `state` as `iter_<iteration>`,
    point `latest` at it and drop this run's checkpoints beyond the newest `keep_last`.

    Under torchrun every rank calls this; rank 0 passes the `run_dir` (the others None). Rank 0 makes
    the temporary folder, every rank writes its shards into it with `write_shards(folder)` (a
    collective: DCP returns on every rank once all shards and the metadata are written), then rank 0
    alone writes the rest and renames the folder into place while the others wait; they get None. A
    save that fails never leaves an `iter_N` a resume would pick up: rank 0 removes the
    temporary folder when its own writes fail, and one a killed save left goes at the next resume.
    `group`: the ranks that save when they are not the whole job (a split run's learner ranks, rank 0
    among them); the others never call this.
    """
    tmp = None
    if run_dir is not None:
        root = checkpoint_root(run_dir)
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{TMP_PREFIX}iter_{iteration:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    tmp = from_main(tmp, group)
    if run_dir is None:
        if write_shards is not None:
            write_shards(tmp)
        if any_rank(False, group):  # rank 0 writes the rest and renames the folder, then says how it went
            raise SaveFailedElsewhere(errno.EIO, "rank 0 could not write the checkpoint (its error names the file)",
                                      str(tmp))
        return None
    final = tmp.with_name(tmp.name.removeprefix(TMP_PREFIX))
    try:
        if write_shards is not None:  # a collective: a failure on any rank raises on every rank
            write_shards(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    failed = None
    try:
        _write_and_publish(tmp, final, write_files, {"iteration": iteration, **state}, run_id)
        _prune(run_dir, run_id, iteration, keep_last)
    except BaseException as error:  # a full disk: give back what this save took (a resume would delete it anyway)
        shutil.rmtree(tmp, ignore_errors=True)
        failed = error
    if any_rank(failed is not None, group) and failed is not None:  # the other ranks fail too, at once
        raise failed
    return final


def _write_and_publish(tmp: Path, final: Path, write_files: Callable[[Path], None], state: dict, run_id: str) -> None:
    """Rank 0's part of a save: the files into `tmp`, `tmp` renamed to `final`, `latest` pointed at it."""
    with _writing(tmp):
        write_files(tmp)
    with _writing(tmp / STATE_FILE):
        torch.save(state, tmp / STATE_FILE)
    meta = {"run_id": run_id, "iteration": state["iteration"], "versions": software_versions()}
    (tmp / META_FILE).write_text(json.dumps(meta) + "\n")
    honour_umask(tmp)  # safetensors writes model.safetensors 0600, unlike every other file here
    sync_tree(tmp)  # every rank's files on the disk before the name that makes them a checkpoint
    replaced = _make_room(final, run_id) if final.exists() else None
    os.replace(tmp, final)
    sync_path(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    pointer = final.parent / "latest.tmp"
    pointer.write_text(final.name)
    sync_path(pointer)
    os.replace(pointer, final.parent / "latest")
    sync_path(final.parent)


_OS_ERROR_NUMBER = re.compile(r"\(os error (\d+)\)")


@contextlib.contextmanager
def _writing(path: Path):
    """Raise a failed write inside safetensors or torch.save as the OSError it is, naming `path`: they raise
    types of their own (a full disk printed ~150 lines of traceback, torch's saying only "unexpected pos"),
    which the CLI's one error line and resume hint did not catch. Other errors pass unchanged."""
    try:
        yield
    except Exception as error:
        text = str(error).strip()
        if type(error).__name__ == "SafetensorError" and "I/O error" in text:
            number = int(found.group(1)) if (found := _OS_ERROR_NUMBER.search(text)) else errno.EIO
            raise OSError(number, os.strerror(number), str(path)) from error
        if isinstance(error, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text):
            number = _torch_write_errno(path)
            raise OSError(number, f"{os.strerror(number)} (torch.save: {text})", str(path)) from error
        raise


def _torch_write_errno(path: Path) -> int:
    """What stopped torch.save's write, which it does not say: a full disk (under 1 MiB free), the process's
    file-size limit (the file within 1 MiB of it), else an I/O error."""
    if shutil.disk_usage(path.parent).free < 1 << 20:
        return errno.ENOSPC
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and path.stat().st_size > limit - (1 << 20):
            return errno.EFBIG
    except (ImportError, OSError):  # no such limit here (Windows), or the file is gone
        pass
    return errno.EIO


def _make_room(final: Path, run_id: str) -> Path | None:
    """Move an existing folder of this iteration out of the way. This run's own goes to a temporary name,
    deleted after the swap (a resume sets its damaged newer saves aside before its first write, and the run
    folder's lock keeps a second process out, so this is a save the run makes again, e.g. a direct call of
    `save`); another run's is kept under a new name."""
    writer = run_of(final)
    if writer == run_id:
        old = final.with_name(f"{TMP_PREFIX}old_{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        log.warning("replaced %s, an earlier save of this run at the same iteration, with a new one", final)
        return old
    k = 1
    while (kept := final.with_name(f"{final.name}.other-run-{k}")).exists():
        k += 1
    os.replace(final, kept)
    if writer is None:
        log.warning("%s does not say which run wrote it (%s unreadable or missing); kept it as %s", final,
                    META_FILE, kept.name)
    else:
        log.warning("%s was written by another run; kept it as %s", final, kept.name)
    return None


def _prune(run_dir: Path, run_id: str, iteration: int, keep_last: int | None) -> None:
    """Keep this run's newest `keep_last` checkpoints up to `iteration` (None: every one); touch nothing else."""
    if keep_last is None:
        return
    own = [p for i, p in checkpoints(run_dir) if i <= iteration and run_of(p) == run_id]
    for old in own[:-keep_last]:
        # renamed first: a deletion killed part way leaves a temporary folder that the next resume clears,
        # not an `iter_N` without its `checkpoint.json`, which no later prune would count as this run's
        doomed = old.with_name(f"{TMP_PREFIX}pruned_{old.name}")
        os.replace(old, doomed)
        try:
            shutil.rmtree(doomed)
        except OSError as error:  # e.g. a folder made read-only: the run goes on, the user is told
            log.warning("could not delete %s, this run's checkpoint older than the newest %d "
                        "(checkpoint.keep_last): %s; delete it by hand", doomed, keep_last, _one_line(error))


def set_aside_newer(run_dir: Path, iteration: int) -> list[str]:
    """Rename every `iter_N` newer than `iteration`, the checkpoint a resume starts from, to
    `iter_N.damaged[-k]`; returns the new names. A resume takes the newest intact checkpoint, so each of
    these was passed over as damaged: renamed, retention no longer counts them among the run's newest
    (it kept them and deleted intact older ones) and no later resume tries them again. Never deleted."""
    moved = []
    for i, path in checkpoints(run_dir):
        if i <= iteration:
            continue
        target = free_sibling(path, ".damaged")
        os.replace(path, target)
        moved.append(target.name)
    resumed = dict(checkpoints(run_dir)).get(iteration)
    if moved and resumed is not None:  # `latest` names the newest checkpoint, which is now this one
        pointer = resumed.parent / "latest.tmp"
        pointer.write_text(resumed.name)
        os.replace(pointer, resumed.parent / "latest")
    return moved


def clear_stale_temps(run_dir: Path) -> list[str]:
    """Delete the temporary folders and pointer files an interrupted save or a prune left; returns the names
    deleted. One that cannot be deleted (made read-only) is left with a warning: it is no checkpoint, and a
    resume that failed on it did so only after its first iteration, naming a bare file."""
    root = checkpoint_root(run_dir)
    stale = sorted([*root.glob(f"{TMP_PREFIX}*"), *root.glob("latest.tmp")]) if root.is_dir() else []
    removed = []
    for path in stale:
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path.name)
        except OSError as error:
            log.warning("could not delete %s, left by an unfinished save or prune: %s; delete it by hand", path,
                        _one_line(error))
    return removed


def _one_line(error: Exception) -> str:
    """The first sentence of an error, on one line (torch appends paragraphs of advice)."""
    text = " ".join(str(error).split()).split(". ")[0] or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def checkpoint_problem(path: Path) -> str | None:
    """Why the files of checkpoint `path` cannot be resumed from (naming the file), or None. The weight
    files' headers, and that they cover each file's bytes, are checked by `check_model_folder`."""
    for file in sorted(path.glob("*.json")):
        try:
            json.loads(file.read_text())
        except (ValueError, OSError) as error:
            return f"{file} is not valid JSON ({_one_line(error)})"
    try:
        check_model_folder(path)
    except ModelFolderError as error:
        return _one_line(error)
    if not (path / STATE_FILE).is_file():
        return f"{path / STATE_FILE} is missing"
    return None


def load_trainer_state(path: Path) -> dict:
    """The trainer state of checkpoint `path`, its tensors memory-mapped from the file rather than read
    into memory: an 8B learner's AdamW moments (61 GiB) would otherwise sit in host memory beside the
    pinned ones `trainer.offload_optimizer` loads them into, more than a 125 GiB host holds."""
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False, mmap=True)


def find_resume_checkpoint(run_dir: Path) -> tuple[Path, dict] | None:
    """The newest intact checkpoint and its trainer state; None when the folder has no checkpoint.

    Each damaged checkpoint passed over is reported in one line naming the file; CheckpointError
    when none is intact.
    """
    found = checkpoints(run_dir)
    problems = []
    for iteration, path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            try:  # any failure to unpickle means the file is damaged, whatever the exception type
                state = load_trainer_state(path)
            except Exception as error:  # noqa: BLE001
                problem = f"{path / STATE_FILE} does not load ({_one_line(error)})"
            else:
                if state.get("iteration") != iteration:
                    problem = f"{path / STATE_FILE} holds iteration {state.get('iteration')}, not {iteration}"
                elif optimizer_format(state.get("learner") or {}) == SHARDED:
                    problem = shards_problem(path)
                problem = problem or engine_slices_problem(path, state)
        if problem is None:
            if problems:
                log.warning("resuming from %s, the newest intact checkpoint", path)
            return path, state
        log.warning("checkpoint %s is damaged: %s", path.name, problem)
        problems.append(problem)
    if found:
        raise CheckpointError(f"{checkpoint_root(run_dir)}: no intact checkpoint ({'; '.join(problems)})")
    return None


def check_resume_world(path: Path, state: dict, world: int) -> None:
    """Refuse a checkpoint written by another number of ranks than this job has, saying
    what could follow (the weights; the optimizer state, which DCP can reshard) and what cannot (each
    rank's in-flight rollouts and place in the prompt stream), and what to do instead."""
    written_by = state.get("world", 1)
    if written_by == world:
        return
    sharded = optimizer_format(state.get("learner") or {}) == SHARDED
    optim = "its optimizer shards could be resharded" if sharded else "its full optimizer state could be loaded"
    same = f"torchrun --nproc-per-node {written_by}" if written_by > 1 else "one process, without torchrun"
    raise CheckpointError(
        f"{path} was written by {written_by} rank(s) (torchrun processes) and this job has {world}: {optim}, but "
        f"each rank's in-flight rollouts and place in the prompt stream belong to that rank and cannot be "
        f"shared out anew. Resume it with the same number ({same}), or start a new run from its policy "
        f"with model.path={path} (a fresh optimizer and prompt stream, that policy as the KL reference)")
