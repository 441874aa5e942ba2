"""The wires of a split run: process groups, rollouts from engines to the learner, weights back.

Ranks 0..L-1 hold the learner, ranks L..W-1 run the K = W - L engines; rank 0 (the learner's
"head", which also writes the run folder) is the only learner rank that talks to the engines. Every
rank makes three groups, in this order:

- `learner`: ranks 0..L-1, the learner's FSDP2 group (its gathers, reductions and metrics).
- `data` (gloo, CPU tensors): the engines and the head. An engine sends each finished batch as a
  pickled byte tensor behind a one-number length header (`isend`, so generation goes on while the
  head has not taken it yet); the head sends each engine a two-number notice: new weights of a
  version follow, or stop. An engine keeps one `irecv` posted for the next notice and looks at it
  between engine steps, so taking new weights never waits for a whole batch to finish.
- `weights` (the job's default backend: NCCL for CUDA tensors): the same ranks; the head broadcasts
  the learner's full weights one tensor at a time (`Learner.full_weights`), in the order of a
  manifest (name, shape, dtype) the engines received once at the start.

Every group carries the job's collective timeout, so a rank that dies or hangs cannot keep the
others waiting forever (torchrun then ends the job with the failing rank's error).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kv4rl.distributed import COLLECTIVE_TIMEOUT

WEIGHTS, STOP = 1, 0  # notice kinds, head -> engine


class Stopped(Exception):
    """The head told this engine to stop (the learner has done its last update)."""


HEAD = 0  # the learner's first rank


@dataclass
class SplitGroups:
    learners: int  # L: ranks 0..L-1 hold the learner, ranks L..W-1 run engines
    engines: int  # K
    learner: dist.ProcessGroup | None  # None on engine ranks
    data: dist.ProcessGroup | None  # None on learner ranks other than the head
    weights: dist.ProcessGroup | None

    def engine_rank(self, engine: int) -> int:
        return self.learners + engine


def make_groups(engines: int, world: int) -> SplitGroups:
    """The three groups for K = `engines` engine ranks (every rank calls this, members or not)."""
    rank, learners = dist.get_rank(), world - engines
    learner = dist.new_group(list(range(learners)), timeout=COLLECTIVE_TIMEOUT)
    wire = [HEAD, *range(learners, world)]
    data = dist.new_group(wire, backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    weights = dist.new_group(wire, timeout=COLLECTIVE_TIMEOUT)
    talks = rank in wire
    return SplitGroups(learners, engines, learner if rank < learners else None,
                       data if talks else None, weights if talks else None)


def _encode(obj) -> tuple[torch.Tensor, torch.Tensor]:
    payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    return torch.tensor([payload.numel()], dtype=torch.long), payload


def send_object(obj, dst: int, group: dist.ProcessGroup) -> None:
    for tensor in _encode(obj):
        dist.send(tensor, dst=dst, group=group)


def recv_object(src: int, group: dist.ProcessGroup):
    header = torch.zeros(1, dtype=torch.long)
    dist.recv(header, src=src, group=group)
    payload = torch.empty(int(header.item()), dtype=torch.uint8)
    dist.recv(payload, src=src, group=group)
    return pickle.loads(payload.numpy().tobytes())


def weight_manifest(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, full shape, dtype) of each tensor the weight stream will carry, in stream order."""
    return [(name, tuple(p.shape), p.dtype) for name, p in named]


class EngineLink:
    """An engine rank's end: send batches without waiting, look for notices, receive weights."""

    def __init__(self, groups: SplitGroups, device: torch.device):
        self.groups, self.device = groups, device
        self.manifest = recv_object(HEAD, groups.data)
        self.pending: list[tuple[list, tuple]] = []  # (works, tensors kept alive until sent)
        self.notice = torch.zeros(2, dtype=torch.long)
        self.work = dist.irecv(self.notice, src=HEAD, group=groups.data)

    def next_notice(self, block: bool) -> int | None:
        """The version of the weights the head is about to broadcast (None: no notice yet and not
        `block`); raises Stopped when the notice says stop."""
        if not block and not self.work.is_completed():
            return None
        self.work.wait()
        kind, version = (int(v) for v in self.notice.tolist())
        if kind == STOP:
            raise Stopped
        return version

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The broadcast weight stream (consume it whole, e.g. with `Engine.load_weights`); the next
        notice is listened for once it is done."""
        for name, shape, dtype in self.manifest:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(tensor, src=HEAD, group=self.groups.weights)
            yield name, tensor
        self.work = dist.irecv(self.notice, src=HEAD, group=self.groups.data)

    def send(self, obj) -> None:
        tensors = _encode(obj)
        works = [dist.isend(t, dst=HEAD, group=self.groups.data) for t in tensors]
        self.pending = [p for p in self.pending if not all(w.is_completed() for w in p[0])]
        self.pending.append((works, tensors))

    def close(self) -> None:
        """Wait until the head has taken everything sent."""
        for works, _ in self.pending:
            for w in works:
                w.wait()
        self.pending = []


class HeadLink:
    """The learner head's end: one batch from every engine per update, notices and the weight stream."""

    def __init__(self, groups: SplitGroups, manifest: list):
        self.groups = groups
        for engine in range(groups.engines):
            send_object(manifest, groups.engine_rank(engine), groups.data)

    def receive(self) -> list[dict]:
        """The next message of each engine, in engine order (waits for the slowest)."""
        return [recv_object(self.groups.engine_rank(e), self.groups.data) for e in range(self.groups.engines)]

    def _notify(self, kind: int, version: int) -> None:
        for engine in range(self.groups.engines):
            dist.send(torch.tensor([kind, version], dtype=torch.long), dst=self.groups.engine_rank(engine),
                      group=self.groups.data)

    def broadcast(self, stream: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Tell the engines that weights of `version` follow, then broadcast `stream` tensor by tensor."""
        self._notify(WEIGHTS, version)
        for _, tensor in stream:
            dist.broadcast(tensor.contiguous(), src=HEAD, group=self.groups.weights)

    def stop(self) -> tuple[list[dict], list[dict]]:
        """Stop the engines and take what they still send: (batches no update will consume, each
        engine's final report)."""
        self._notify(STOP, -1)
        unused, reports = [], []
        for engine in range(self.groups.engines):
            while True:
                message = recv_object(self.groups.engine_rank(engine), self.groups.data)
                if message.get("end"):
                    reports.append(message)
                    break
                unused.append(message)
        return unused, reports
