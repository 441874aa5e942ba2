"""A CUDA graph's static inputs filled by one host-to-device copy a step, from pinned memory.

A graph step used to copy each input (ids, positions, slots, contexts, block tables, ...) from its own
pageable numpy array and clear the padding rows with one fill kernel per tensor: a dozen torch calls
a step before the replay. A pageable copy is staged by the driver through its own pinned buffers, and
CUDA's API notes say such a copy "might be synchronous with respect to host": with the stream a step
or more behind, the host can end up waiting for the device in a copy it meant to queue.

Here the inputs are views of one flat device buffer, and the host writes each step's rows, padding
included, into a pinned mirror of it. One copy of the mirror's used prefix moves them all. Mirrors
rotate (`depth` of them), each guarded by an event recorded after its copy, so the host never writes a
mirror whose last copy has not run yet. Without CUDA (tests) the mirror is plain memory and the copy
is a memcpy, so the packing is checked on CPU.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 16  # bytes: every field starts aligned for any dtype's view


class StagedInputs:
    """`fields`: name -> (shape, dtype, initial value), laid out in this order; put the fields whose
    used part varies most (a block table) last, so a step copies a short prefix."""

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], torch.dtype, int]], device: torch.device | str,
                 depth: int = 2):
        self.device = torch.device(device)
        self.layout = fields
        self.itemsize = {name: torch.empty((), dtype=dtype).element_size() for name, (_, dtype, _) in fields.items()}
        self.offsets: dict[str, int] = {}
        nbytes = 0
        for name, (shape, _, _) in fields.items():
            self.offsets[name] = nbytes
            nbytes += -(-int(np.prod(shape)) * self.itemsize[name] // ALIGN) * ALIGN
        self.nbytes = nbytes
        on_gpu = self.device.type == "cuda"
        self.flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.tensors = {name: self._view(self.flat, name) for name in fields}
        self.mirrors = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu) for _ in range(depth)]
        self.copied = [torch.cuda.Event() if on_gpu else None for _ in range(depth)]
        self.turn = 0
        for mirror in self.mirrors:
            for name, (_, _, value) in fields.items():
                self._view(mirror, name).fill_(value)
        self.flat.copy_(self.mirrors[0])
        self.host_views = [{name: self._view(m, name).numpy() for name in fields} for m in self.mirrors]
        self.num_copies = 0

    def _view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        shape, dtype, _ = self.layout[name]
        start = self.offsets[name]
        return flat[start:start + int(np.prod(shape)) * self.itemsize[name]].view(dtype).view(shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        """The device tensor `name` (a view of the flat buffer: its address never changes)."""
        return self.tensors[name]

    def host(self) -> dict[str, np.ndarray]:
        """Writable numpy views of the next mirror, once its previous copy has run. The mirror keeps
        whatever it held two steps ago: write every row the step's graph reads."""
        event = self.copied[self.turn]
        if event is not None:
            event.synchronize()
        return self.host_views[self.turn]

    def end(self, name: str, count: int) -> int:
        """Byte offset just past the first `count` elements of field `name`."""
        return self.offsets[name] + count * self.itemsize[name]

    def upload(self, nbytes: int) -> None:
        """Queue the copy of the mirror's first `nbytes` bytes (those the step wrote) to the device, and
        move to the next mirror."""
        mirror = self.mirrors[self.turn]
        self.flat[:nbytes].copy_(mirror[:nbytes], non_blocking=True)
        if self.copied[self.turn] is not None:
            self.copied[self.turn].record()
        self.turn = (self.turn + 1) % len(self.mirrors)
        self.num_copies += 1
