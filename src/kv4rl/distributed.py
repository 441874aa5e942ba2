"""Several processes of one job (torchrun): who is who, and the few collectives the RL loop needs.

`kv4rl train` under `torchrun --nproc-per-node N` runs the colocated layout: every rank holds an
engine replica and an FSDP2 shard of the learner (`kv4rl.trainer.learner`), collects its share of
each learner batch's prompt groups (a group never split: `kv4rl.rollout.collector`), scores them and
computes their advantages itself; the learner batch is the union. Rank 0 alone writes the run folder.
Without torchrun (or with one process) every function here is the identity of one process.

A rank that raises ends its process with a non-zero exit code, and torchrun then stops the others;
collectives carry a timeout (`COLLECTIVE_TIMEOUT`) so a rank that hangs cannot keep the job waiting
forever. A rank going down with an error first says so in the job's store (`stopped_peer`), so a rank
whose collective then fails because that peer went away knows why and says so in one line instead of
the backend's traceback.
"""

from __future__ import annotations

import gc
import hashlib
import os
import re
import shlex
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=int(os.environ.get("KV4RL_COLLECTIVE_TIMEOUT_S", "900")))


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched_ranks() -> int:
    """The world size torchrun asked for (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def train_launch(world: int | None = None) -> list[str]:
    """The words that start `kv4rl train` on `world` processes (default: as many as this job was started with):
    plain, or under torchrun. Hints that say how to resume or start over use it."""
    world = launched_ranks() if world is None else world
    return ["kv4rl", "train"] if world == 1 else ["torchrun", "--nproc-per-node", str(world), "-m", "kv4rl.cli", "train"]


def resume_command(run_dir: os.PathLike | str, world: int | None = None) -> str:
    """The command that continues the run in `run_dir` (see `train_launch`), quoted for a shell: a folder
    named with a space or a quote is pasted back whole."""
    return shlex.join([*train_launch(world), "--resume", str(run_dir)])


def prints_setup_errors() -> bool:
    """Whether this process reports an error found before the job is joined (a bad config): under
    torchrun every rank finds the same one, so only each host's first rank prints it."""
    return launched_ranks() <= 1 or os.environ.get("LOCAL_RANK", "0") == "0"


def init_from_torchrun(device: str) -> Ranks:
    """Join the job torchrun started (NCCL for CUDA tensors and gloo for CPU ones; gloo alone on the
    CPU). One process: no group is made (the learner makes its own one-process group)."""
    stop_with_launcher()  # torchrun with one rank too (it checks that torchrun started this process)
    if launched_ranks() <= 1:
        return Ranks()
    if not dist.is_initialized():
        cuda = device != "cpu" and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return current()


def stop_with_launcher() -> None:
    """Under torchrun on Linux, have the kernel send this rank SIGTERM when torchrun dies: a torchrun killed
    with SIGKILL (which it cannot forward) left its ranks training on, holding the run folder's lock. SIGTERM
    starts the graceful stop every rank handles; with the job's store gone with torchrun the ranks may end
    before the checkpoint of their iteration, and the last one saved stands."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no prctl here: the ranks outlive a killed launcher, as before
        return
    if os.getppid() == 1:  # torchrun died before the call above: nothing will send the signal
        os.kill(os.getpid(), signal.SIGTERM)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def current() -> Ranks:
    if not dist.is_available() or not dist.is_initialized():
        return Ranks()
    return Ranks(dist.get_rank(), dist.get_world_size())


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    ranks = current()
    if ranks.world == 1:
        return [obj]
    out: list = [None] * ranks.world
    dist.all_gather_object(out, obj)
    return out


def from_main(obj, group: dist.ProcessGroup | None = None):
    """Rank 0's `obj` on every rank of `group` (default: the job), e.g. a path only rank 0 knows."""
    if current().world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank of `group` (default: the job) when it is true on any (a stop signal seen by one rank
    stops all together; a save that failed on rank 0 fails on every rank)."""
    if current().world == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.long)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of `group` (default: the job)."""
    if current().world > 1:
        dist.barrier(group=group)


_FAILED_KEY = "kv4rl/failed_rank/"


def _store():
    """The job's key-value store (torchrun's agent hosts it, so it outlives a rank); None without a job."""
    if current().world == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, ValueError, RuntimeError):  # a private helper: gone in some torch, no error here
        return None


def first_to_report(message: str) -> bool:
    """Whether no other rank of the job has reported this same error line yet (the job's store counts each
    message once, atomically); True without a job or a store. A bad data file or a resume refused after the
    ranks joined printed the same line once per rank; a different line (an error only one rank met) prints."""
    store = _store()
    if store is None:
        return True
    try:
        return store.add(f"kv4rl/reported/{hashlib.sha1(message.encode()).hexdigest()}", 1) == 1
    except Exception:  # noqa: BLE001 - a store gone with the job: say it, if twice
        return True


def stopped_peer(error: Exception) -> int | None:
    """The rank whose failure made this rank's collective raise `error` (`failed_peer`); None when the error is
    this rank's own, which is then announced to the others (`announce_failure`)."""
    peer = failed_peer(error)
    if peer is None:
        announce_failure()
    return peer


def announce_failure() -> None:
    """Record in the job's store that this rank is going down with an error of its own. Called before its
    process group is destroyed, so a peer whose collective fails when the connection closes finds the
    record. Best effort: a store that cannot be reached leaves the peers to report their raw error."""
    store = _store()
    if store is None:
        return
    try:
        store.set(f"{_FAILED_KEY}{current().rank}", "1")
    except Exception:  # noqa: BLE001 - the rank's own error is the one to report
        pass


def failed_peer(error: BaseException) -> int | None:
    """The rank that announced its own failure, when `error` is what a collective raises on the ranks it
    leaves behind (gloo's RuntimeError "Connection closed by peer", NCCL's DistBackendError); None when
    `error` is of another kind or no other rank announced one (then `error` is this rank's own)."""
    if not (type(error) is RuntimeError or isinstance(error, dist.DistError)):
        return None
    store = _store()
    if store is None:
        return None
    me = current()
    try:
        return next((r for r in range(me.world) if r != me.rank and store.check([f"{_FAILED_KEY}{r}"])), None)
    except Exception:  # noqa: BLE001 - a store gone with the job: report the raw error
        return None


_LOST_CONNECTION = re.compile(r"Connection (reset|closed) by peer|Broken pipe|remote process exited|"
                              r"Socket Timeout|ECONNRESET", re.IGNORECASE)


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective's loss of its connection to another rank of a torchrun job that said
    nothing first (killed: SIGKILL, the out-of-memory killer), rather than this rank's own failure."""
    return (launched_ranks() > 1 and (type(error) is RuntimeError or isinstance(error, dist.DistError))
            and _LOST_CONNECTION.search(str(error)) is not None)


def shutdown() -> None:
    """Destroy the process groups, after collecting what still refers to them (an engine's tensor-parallel
    group held in a reference cycle would otherwise be freed at interpreter exit, after its backend: one
    suspect of an intermittent gloo abort at exit, "terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


_SUMMED = frozenset({"preemptions", "dropped_stale", "tokens_per_s", "filtered_groups"})
_SAME_ON_EVERY_RANK = frozenset({"iteration", "skipped_steps", "empty_steps"})  # the learner's steps are the whole job's


def _is_count(key: str) -> bool:
    """A reward's `reward_<count>` diagnostic (not its mean or std), which adds up over ranks."""
    return key.startswith("reward_") and key not in ("reward_mean", "reward_std")


def merge_rank_rows(rows: list[dict]) -> dict:
    """One metrics row from each rank's row of the same iteration (every rank holds an equal share of
    the groups): counts (the engine's running totals, the reward's `reward_<count>` diagnostics) and
    throughput add up, wall times are the slowest rank's (the largest `time_total`, every phase from it), maxima the largest, the staleness histograms add
    (and `staleness_mean` is theirs), the groups join, a `<x>_std` beside `<x>_mean` is the std over every
    rank's responses, and the rest (means over responses, or learner metrics that are already global)
    average. (A mean of the ranks' stds left out the spread between ranks, and averaged counts halved.)"""
    if len(rows) == 1:
        return rows[0]
    out: dict = {}
    totals = [row.get("time_total") for row in rows]
    # the phases of one rank, the slowest: each phase's max over ranks added up past time_total (plot
    # iteration-time drew a negative `other` above the bar)
    slowest = rows[totals.index(max(totals))] if all(isinstance(t, int | float) for t in totals) else None
    keys = dict.fromkeys(key for row in rows for key in row)  # rank 0's first, then any other rank's own
    for key in keys:
        values = [row.get(key) for row in rows]
        if _is_count(key):  # a reward's count that some rank's responses never gave (a verl scorer's key) is 0 there
            out[key] = sum(v for v in values if v is not None)
            continue
        first = rows[0][key] if key in rows[0] else next((v for v in values if v is not None), None)
        if key == "groups":
            out[key] = sorted(g for v in values for g in v)
        elif key == "staleness_hist":
            hist: dict[str, int] = {}
            for v in values:
                for age, count in v.items():
                    hist[age] = hist.get(age, 0) + count
            out[key] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        elif key in (*_SUMMED, "slot_util") and any(v is None for v in values):  # an engine took no step this time
            known = [v for v in values if v is not None]
            out[key] = None if not known else sum(known) if key in _SUMMED else sum(known) / len(known)
        elif (key in _SAME_ON_EVERY_RANK or isinstance(first, bool) or not isinstance(first, int | float)
              or any(v is None for v in values)):
            out[key] = first
        elif key in _SUMMED:
            out[key] = sum(values)
        elif key.endswith("_std") and key.removesuffix("_std") + "_mean" in rows[0]:
            means = [row[key.removesuffix("_std") + "_mean"] for row in rows]
            second = sum(sd * sd + mu * mu for sd, mu in zip(values, means)) / len(values)
            out[key] = max(second - (sum(means) / len(means)) ** 2, 0.0) ** 0.5
        elif key.startswith("time_") and slowest is not None:
            out[key] = slowest[key]
        elif key.startswith("time_") or key.endswith(("_max", "absmax")):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    if "staleness_hist" in out and "staleness_mean" in out:
        tokens = sum(out["staleness_hist"].values())
        out["staleness_mean"] = sum(int(age) * n for age, n in out["staleness_hist"].items()) / max(tokens, 1)
    return out
