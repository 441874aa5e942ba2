"""The learner's AdamW state in a checkpoint: full, or one distributed-checkpoint shard per rank.

With N > 1 ranks every rank writes its own FSDP2 shard of the optimizer state into the checkpoint's
`optimizer/` folder (DCP's `__<rank>_0.distcp` files and its `.metadata`), so no rank ever gathers
the whole state; a resume reads each rank's shard back with `dcp.load`. With one rank the state
stays a full, name-keyed dict inside `trainer_state.pt` (`FULL`, the format of older checkpoints).
The trainer state records which of the two a checkpoint holds and the world size that wrote it.
"""

from __future__ import annotations

import errno
from pathlib import Path

from torch import nn
from torch.optim import Optimizer

FULL = "full"  # the whole optimizer state in trainer_state.pt
SHARDED = "dcp"  # one DCP shard per rank under OPTIMIZER_DIR
OPTIMIZER_DIR = "optimizer"
METADATA_FILE = ".metadata"  # DCP's index of the shards


class OptimizerShardError(ValueError):
    """Optimizer shards that are missing or damaged (the message names the file, or the folder and the
    ranks that failed)."""


class ShardWriteError(OSError):
    """Optimizer shards that could not be written (a full disk on some rank): a failed file operation, which
    the command reports as one line with exit status 1, not as bad input. `filename` is the shard folder,
    `strerror` names the ranks that failed and why."""


def optimizer_format(state: dict) -> str:
    """The optimizer format of a checkpoint's learner state (older checkpoints: `FULL`)."""
    return state.get("optimizer_format", FULL)


def full_state(model: nn.Module, optimizer: Optimizer) -> dict:
    """The whole optimizer state as plain CPU tensors keyed by parameter name (gathered from the FSDP2
    shards: a collective), the same with or without FSDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state(model: nn.Module, optimizer: Optimizer, state: dict) -> None:
    """Load a `full_state` (or an older checkpoint's index-keyed `optimizer.state_dict()`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = _by_name(state, [name for name, _ in model.named_parameters()])
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _by_name(optim: dict, names: list[str]) -> dict:
    """An optimizer state keyed by parameter index (`optimizer.state_dict()`, older checkpoints) re-keyed
    by parameter name, as `set_optimizer_state_dict` expects; a name-keyed one is returned as it is."""
    groups = optim["param_groups"]
    if not any(isinstance(p, int) for g in groups for p in g["params"]):
        return optim
    return {"state": {names[i]: v for i, v in optim["state"].items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in groups]}


def save_shards(model: nn.Module, optimizer: Optimizer, folder: Path, group=None) -> None:
    """Every rank writes its shard of the optimizer state to `folder/optimizer` (a collective: it
    returns on every rank once DCP's coordinator has written the metadata after all shards).
    `group`: the learner's ranks when they are not the whole job (a split run)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    target = Path(folder) / OPTIMIZER_DIR
    try:
        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=target, process_group=group)
    except CheckpointException as error:  # a BaseException: `except Exception` handlers would miss it
        raise ShardWriteError(errno.EIO, f"writing the optimizer shards failed ({_failures(error)})",
                              str(target)) from None


def load_shards(model: nn.Module, optimizer: Optimizer, folder: Path, group=None) -> None:
    """Load `folder/optimizer` into this rank's shard of the optimizer state (a collective over
    `group`, the learner's ranks; default: the whole job).

    The files are checked first (`shards_problem`); a load that still fails is reported with the
    folder, each failed rank and, where a file's bytes do not load, that file. DCP reshards, so the
    shards of any number of ranks load.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    problem = shards_problem(folder)
    if problem is not None:
        raise OptimizerShardError(problem)
    state = get_optimizer_state_dict(model, optimizer)  # this rank's shard layout, filled in place
    try:
        dcp.load(state, storage_reader=_file_naming_reader(Path(folder) / OPTIMIZER_DIR), process_group=group)
    except CheckpointException as error:
        raise OptimizerShardError(f"{Path(folder) / OPTIMIZER_DIR}: the optimizer shards do not load "
                                  f"({_failures(error)})") from None
    set_optimizer_state_dict(model, optimizer, state)


def _file_naming_reader(path: Path):
    """DCP's file-system reader, reading one shard file at a time so that a file whose bytes do not
    load (sizes right, contents damaged) is named in the error."""
    import dataclasses

    from torch.distributed.checkpoint import FileSystemReader
    from torch.futures import Future

    class Reader(FileSystemReader):
        def read_data(self, plan, planner):
            by_file: dict[str, list] = {}
            for item in plan.items:
                by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, items in sorted(by_file.items()):
                try:
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
                except Exception as error:  # noqa: BLE001 - whatever the damage, name the file
                    raise OSError(f"{path / name} does not load ({type(error).__name__}: "
                                  f"{_first_line(error)})") from error
            done: Future = Future()
            done.set_result(None)
            return done

    return Reader(path)


def shards_problem(folder: Path) -> str | None:
    """Why the optimizer shards of checkpoint `folder` cannot be loaded, naming the file, or None:
    DCP's metadata is missing or unreadable, or a shard file it lists is missing or shorter than the
    bytes the metadata places in it."""
    from torch.distributed.checkpoint import FileSystemReader

    shards = Path(folder) / OPTIMIZER_DIR
    metadata_file = shards / METADATA_FILE
    if not metadata_file.is_file():
        return f"{metadata_file} is missing"
    try:
        metadata = FileSystemReader(shards).read_metadata()
    except Exception as error:  # noqa: BLE001 - any failure to unpickle means the file is damaged
        return f"{metadata_file} does not load ({_first_line(error)})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = shards / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size < size:
            return f"{file} is truncated ({file.stat().st_size} bytes, the metadata needs {size})"
    return None


def _failures(error) -> str:
    """Each failed rank's exception in one line (DCP's CheckpointException carries them by rank)."""
    return "; ".join(f"rank {rank}: {type(exc).__name__}: {_first_line(exc)}"
                     for rank, (exc, _) in sorted(error.failures.items()))


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."
