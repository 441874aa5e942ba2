"""AdamW whose two moments live in CPU memory (pinned on CUDA) and are streamed through the GPU.

Why: `trainer.offload` (FSDP2's CPUOffloadPolicy) keeps fp32 parameters, gradients and both AdamW
moments in host memory, 16 bytes per parameter: 131 GB for Qwen3-8B, more than a 125 GiB host. Here
the parameters (fp32 master, FSDP2-sharded or not) and their gradients stay on the GPU and only the
moments go to the host: 8 bytes per parameter there (66 GB at 8B), 8 on the GPU (33 GB weights + 33 GB
gradients) plus the staging buffers (2 x `bucket_bytes`).

The moments of every parameter lie end to end in one host allocation of shape [2, N] (row 0 exp_avg,
row 1 exp_avg_sq; N the local elements of all parameters that require grad, laid out at the first step
or load). One allocation because torch's pinned-memory allocator rounds every request up to a power of
two: per tensor that would pin ~81 GiB for 8B's 61 GiB of moments (its 192 MiB MLP and 2.3 GiB
embedding moments each round up), one arena pins 64 GiB.

A step walks that element space in buckets of `bucket_bytes` of moments (both rows; 256 MiB by
default: 32 Mi fp32 elements of each moment): upload the bucket's slice of both rows into a GPU
staging slot (non_blocking, side stream), run torch's fused AdamW kernel (`torch._fused_adamw_`, the
kernel of `AdamW(fused=True)`) on the pieces of the parameters it covers (a parameter larger than a
bucket spans several), download the slot back (a second side stream). Two slots alternate, so the
next bucket's upload and this one's download overlap the update; events order a slot's reuse after
its download. The step waits for the last download before it returns, so the host moments are final
(checkpoints read them). On the CPU the same loop runs with plain copies and a CPU staging buffer,
which is what lets the CPU tests check the bucketing.

The maths is torch's AdamW (decoupled weight decay, bias correction; the step count is a float32
tensor on the compute device, as fused AdamW keeps it), computed by the fused kernel (on the CPU a
piece shorter than a vector goes through its scalar loop, which may differ in the last bit). amsgrad,
capturable and differentiable are not supported. Not yet run on a GPU: tests/gpu/test_offloaded_adamw_gpu.py
is written for it.

State and checkpoints: `state[p]` holds `step`, `exp_avg` and `exp_avg_sq` as torch's AdamW does, the
moments being views into the host arena with the shape of the parameter's local shard. On a mesh of
one rank (and for plain parameters) they are plain tensors: the local shard is the full tensor, and
`get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)` then hands them out without a
round trip through the GPU or a second host copy (an 8B learner's host could not hold two). On
several ranks they are DTensors wrapping the host views with the parameter's mesh and placements,
so DCP writes and reads each rank's shard at its offset (as it does CPUOffloadPolicy's state).
`load_state_dict` copies loaded moments straight into the host arena (torch's would first move them
onto the parameter's device: 66 GB of GPU memory at 8B), and a step copies back any moment found
elsewhere (say, assigned on the GPU). A state dict holds the live moments, not copies: save it before
the next step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

MOMENTS = ("exp_avg", "exp_avg_sq")  # the arena's two rows, in this order
BUCKET_BYTES = 256 << 20


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class _Slot:
    """Where one parameter's moments lie in the arena's element space."""

    offset: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True, eq=False)
class _Piece:
    """The part [start, stop) of a parameter's flattened local shard that a bucket covers, at `at` in it."""

    param: Tensor
    start: int
    stop: int
    at: int


class OffloadedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` with its moments in (pinned) CPU memory; see the module docstring."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False, bucket_bytes: int | None = None):
        bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                         fused=True)
        self._step_supports_amp_scaling = False  # a GradScaler unscales the gradients itself before `step`
        self.bucket_bytes = bucket_bytes
        self._arena: Tensor | None = None  # [2, N] on the host: exp_avg and exp_avg_sq of every parameter
        self._slots: dict[Tensor, _Slot] = {}
        self._buckets: list[list[_Piece]] = []
        self._bucket_numel = 0
        self._device = torch.device("cpu")  # where the parameters are, and the update runs
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None

    # ---- the host arena -------------------------------------------------------------------------
    def _layout(self) -> None:
        """Lay out the moments of every parameter that requires grad and allocate the arena (once)."""
        if self._arena is not None:
            return
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        shards = [_local(p) for p in params]
        devices, dtypes = {t.device for t in shards}, {t.dtype for t in shards}
        if len(devices) > 1 or len(dtypes) > 1:
            raise ValueError(f"OffloadedAdamW streams parameters of one dtype on one device; these are on "
                             f"{sorted(map(str, devices))} in {sorted(map(str, dtypes))}")
        if not params:
            raise ValueError("OffloadedAdamW: no parameter requires grad")
        for t in shards:
            if not t.is_contiguous():
                raise ValueError(f"OffloadedAdamW needs contiguous parameters; one of shape {tuple(t.shape)} is not")
        self._device, dtype = shards[0].device, shards[0].dtype
        offset = 0
        for p, t in zip(params, shards):
            self._slots[p] = _Slot(offset, t.numel(), t.shape)
            offset += t.numel()
        per = max(1, self.bucket_bytes // (len(MOMENTS) * dtype.itemsize))
        self._bucket_numel = min(per, max(offset, 1))
        self._buckets = self._plan(self._bucket_numel)
        # contents are set per parameter when its state is made or loaded (`_state`, `load_state_dict`)
        self._arena = torch.empty((len(MOMENTS), offset), dtype=dtype, pin_memory=self._device.type == "cuda")

    def _plan(self, size: int) -> list[list[_Piece]]:
        """Bucket b covers the elements [b * size, (b + 1) * size) of the arena: the pieces of each
        parameter that falls in it."""
        buckets: list[list[_Piece]] = []
        for p, slot in self._slots.items():
            start, end = slot.offset, slot.offset + slot.numel
            while start < end:
                b = start // size
                stop = min(end, (b + 1) * size)
                while len(buckets) <= b:
                    buckets.append([])
                buckets[b].append(_Piece(p, start - slot.offset, stop - slot.offset, start - b * size))
                start = stop
        return buckets

    def _host(self, p: Tensor, row: int) -> Tensor:
        slot = self._slots[p]
        return self._arena[row, slot.offset:slot.offset + slot.numel].view(slot.shape)

    @staticmethod
    def _wrap(p: Tensor, host: Tensor) -> Tensor:
        """The state entry for a host view: a DTensor like `p` on a mesh of several ranks, else the view.
        Built as FSDP2 builds its CPU-offloaded parameters (`DTensor.from_local` would copy the view onto
        the mesh's device)."""
        if isinstance(p, DTensor) and p.device_mesh.size() > 1:
            return DTensor(host, p._spec, requires_grad=False)
        return host

    def _slot_of(self, p: Tensor) -> _Slot:
        slot = self._slots.get(p)
        if slot is None:
            raise RuntimeError(f"OffloadedAdamW: a parameter of shape {tuple(p.shape)} has a gradient but no host "
                               "memory; the moments are laid out at the first step or load, for the parameters "
                               "that required grad then (add parameters before that)")
        return slot

    def _state(self, p: Tensor) -> dict:
        """`p`'s state, made (zero moments) on its first step; moments found outside the arena (a load onto
        the GPU, an assignment) are copied back into it, and the step count put on the compute device."""
        self._slot_of(p)
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=self._device)
            for row, name in enumerate(MOMENTS):
                state[name] = self._wrap(p, self._host(p, row).zero_())
            return state
        for row, name in enumerate(MOMENTS):
            host, value = self._host(p, row), state.get(name)
            if value is None:
                raise RuntimeError(f"OffloadedAdamW: the state of a parameter of shape {tuple(p.shape)} has no {name}")
            local = _local(value)
            if local.device != host.device or local.data_ptr() != host.data_ptr():
                if local.shape != host.shape:
                    raise ValueError(f"OffloadedAdamW: {name} of shape {tuple(local.shape)} for a parameter whose "
                                     f"local shard is {tuple(host.shape)}")
                host.copy_(local)
                state[name] = self._wrap(p, host)
        step = state["step"]
        if not torch.is_tensor(step) or step.device != self._device or step.dtype != torch.float32:
            state["step"] = torch.as_tensor(step, dtype=torch.float32).to(self._device)
        return state

    # ---- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with_grad = []  # (parameter, its group), as torch's AdamW skips those without a gradient
        for group in self.param_groups:
            for option in ("amsgrad", "capturable", "differentiable"):
                if group.get(option):
                    raise ValueError(f"OffloadedAdamW does not support {option}=True")
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError("OffloadedAdamW does not support sparse gradients")
                    with_grad.append((p, group))
        if not with_grad:
            return loss
        self._layout()
        live: dict[Tensor, tuple[Tensor, Tensor, dict]] = {}  # param -> (flat local shard, flat grad, group)
        for p, group in with_grad:
            shard, grad = _local(p), _local(p.grad)
            if grad.device != self._device or grad.shape != shard.shape:
                raise ValueError(f"OffloadedAdamW: a gradient of shape {tuple(grad.shape)} on {grad.device} for a "
                                 f"parameter shard of shape {tuple(shard.shape)} on {self._device}")
            live[p] = (shard.view(-1), grad.reshape(-1), group)
        torch._foreach_add_([self._state(p)["step"] for p in live], 1)
        self._stream(live)
        return loss

    def _stream(self, live: dict[Tensor, tuple[Tensor, Tensor, dict]]) -> None:
        """Every bucket through a staging slot: upload, update, download (overlapped on CUDA)."""
        arena, size, count = self._arena, self._bucket_numel, len(self._buckets)
        total = arena.shape[1]
        cuda = self._device.type == "cuda"
        stage = torch.empty((2, len(MOMENTS), size), dtype=arena.dtype, device=self._device)  # [slot, row, element]
        up = down = compute = None
        if cuda:
            compute = torch.cuda.current_stream(self._device)
            up, down = self._side_streams()
            up.wait_stream(compute)  # `stage` is allocated on the compute stream
            down.wait_stream(compute)
        ready: list = [None, None]  # per slot: its upload has landed
        free: list = [None, None]  # per slot: its download has left, so it may be refilled

        def bounds(b: int) -> tuple[int, int]:
            return b * size, min((b + 1) * size, total)

        def upload(b: int) -> None:
            lo, hi = bounds(b)
            with _on(up):
                if free[b % 2] is not None:
                    up.wait_event(free[b % 2])
                for row in range(len(MOMENTS)):
                    stage[b % 2, row, :hi - lo].copy_(arena[row, lo:hi], non_blocking=cuda)
                ready[b % 2] = up.record_event() if cuda else None

        for b in range(min(2, count)):
            upload(b)
        for b in range(count):
            lo, hi = bounds(b)
            if cuda:
                compute.wait_event(ready[b % 2])
            self._update(self._buckets[b], stage[b % 2], live)
            with _on(down):
                if cuda:
                    down.wait_event(compute.record_event())
                for row in range(len(MOMENTS)):
                    arena[row, lo:hi].copy_(stage[b % 2, row, :hi - lo], non_blocking=cuda)
                free[b % 2] = down.record_event() if cuda else None
            if b + 2 < count:
                upload(b + 2)
        if cuda:
            compute.wait_stream(down)
            down.synchronize()  # the host moments are final once the step returns

    def _side_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self._device), torch.cuda.Stream(self._device))
        return self._streams

    def _update(self, pieces: list[_Piece], slot: Tensor, live: dict[Tensor, tuple[Tensor, Tensor, dict]]) -> None:
        """AdamW on the pieces of one bucket whose parameters have a gradient, one fused call per group."""
        calls: dict[int, tuple[dict, list, list, list, list, list]] = {}
        for piece in pieces:
            entry = live.get(piece.param)
            if entry is None:
                continue
            shard, grad, group = entry
            _, params, grads, exp_avgs, exp_avg_sqs, steps = calls.setdefault(id(group), (group, [], [], [], [], []))
            n = piece.stop - piece.start
            params.append(shard[piece.start:piece.stop])
            grads.append(grad[piece.start:piece.stop])
            exp_avgs.append(slot[0, piece.at:piece.at + n])
            exp_avg_sqs.append(slot[1, piece.at:piece.at + n])
            steps.append(self.state[piece.param]["step"])
        for group, params, grads, exp_avgs, exp_avg_sqs, steps in calls.values():
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=float(group["lr"]),
                                beta1=float(beta1), beta2=float(beta2), weight_decay=float(group["weight_decay"]),
                                eps=float(group["eps"]), amsgrad=False, maximize=bool(group["maximize"]))

    # ---- loading --------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """torch's `load_state_dict`, except that the moments are copied straight into the host arena
        (torch's would move every one onto its parameter's device first)."""
        saved = [key for group in state_dict["param_groups"] for key in group["params"]]
        stripped, moments = {}, {}
        for key, values in state_dict["state"].items():
            stripped[key] = {k: v for k, v in values.items() if k not in MOMENTS}
            moments[key] = {k: v for k, v in values.items() if k in MOMENTS}
        super().load_state_dict({**state_dict, "state": stripped})  # checks the groups' sizes
        params = dict(zip(saved, [p for group in self.param_groups for p in group["params"]]))
        if moments:
            self._layout()
        for key, values in moments.items():
            p = params[key]
            self._slot_of(p)
            state = self.state[p]
            for row, name in enumerate(MOMENTS):
                if name not in values:
                    raise ValueError(f"OffloadedAdamW.load_state_dict: the state of parameter {key!r} has no {name}")
                host, local = self._host(p, row), _local(values[name])
                if local.shape != host.shape:
                    raise ValueError(f"OffloadedAdamW.load_state_dict: {name} of parameter {key!r} has shape "
                                     f"{tuple(local.shape)}, its local shard {tuple(host.shape)}")
                if local.device != host.device or local.data_ptr() != host.data_ptr():
                    host.copy_(local)
                state[name] = self._wrap(p, host)
            if "step" in state:  # a copy: torch's load keeps the caller's tensor, which the caller may advance
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(self._device, copy=True)


def _on(stream):
    """The stream's context on CUDA; nothing on the CPU (stream None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
