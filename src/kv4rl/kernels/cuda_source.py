"""What the CUDA decode bodies (`int4_decode_cuda`, `fp8_decode_cuda`) share: whether the device can run
them, and their sources compiled with NVRTC on first use (torch's `_compile_kernel`, launched on torch's
current stream, so CUDA graphs capture them).

NVRTC compiles one string without include paths, so `#include "name"` lines of a source are replaced by
the named file from the same folder (nvcc, for offline register and SASS checks, finds them itself).
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
from pathlib import Path

import torch

_INCLUDE = re.compile(r'^#include "([^"/]+)"[ \t]*$', re.MULTILINE)


def source_text(path: Path) -> str:
    """The source at `path` with its local includes pasted in (each file once)."""
    seen: set[str] = set()

    def paste(match: re.Match) -> str:
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return _INCLUDE.sub(paste, (path.parent / name).read_text())

    return _INCLUDE.sub(paste, path.read_text())


def device_problem(device: torch.device, capability: tuple[int, int], needs: str) -> str | None:
    """Why a CUDA kernel needing compute `capability` (for `needs`, said in the reason) cannot run on
    `device` at all (hardware, toolkit), or None."""
    if device.type != "cuda":
        return "not a CUDA device"
    if torch.version.hip is not None:
        return "ROCm: the kernel uses NVIDIA PTX"
    if torch.cuda.get_device_capability(device) < capability:
        return f"needs sm_{capability[0]}{capability[1]} or newer ({needs})"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)"
    if _cuda_home() is None:
        return "no CUDA toolkit found (CUDA_HOME): NVRTC needs its headers"
    return None


@functools.cache
def _cuda_home() -> str | None:
    """torch's NVRTC wrapper adds the toolkit's include directory, found through CUDA_HOME."""
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME


@functools.cache  # one compile per device, source and options, kept for the process
def compiled(device_index: int, path: Path, name: str, options: tuple[str, ...], shared_bytes: int):
    """Kernel `name` of the source at `path` compiled with `options` (-D macros) for `device_index`,
    allowed `shared_bytes` of dynamic shared memory."""
    with torch.cuda.device(device_index):
        kernel = torch.cuda._compile_kernel(source_text(path), name, nvcc_options=list(options))
        kernel.set_shared_memory_config(shared_bytes)
    return kernel


def body_kernel(problem: str | None, enabled: bool, interpreter: bool) -> tuple[str, str | None]:
    """Which kernel runs a body, 'cuda' or 'triton', and for Triton why not CUDA; `problem`: the device's or
    the shape's reason the CUDA kernel cannot run (None: it can)."""
    if not enabled:
        return "triton", "disabled"
    if interpreter:
        return "triton", "Triton interpreter"
    return ("triton", problem) if problem else ("cuda", None)


def whole_wave_splits(batch: int, num_kv_heads: int, max_splits: int, num_sms: int, warps: int,
                      warps_per_sm: int) -> int:
    """Splits per sequence so that the grid is about a whole number of waves: blocks are (split, sequence)
    pairs of up to `warps` KV heads, `warps_per_sm / warps` of them resident per SM, and a wave and a bit
    is slower than one (measured on an H200, bench/RESULTS.md)."""
    slots, blocks_per_piece = _wave(num_kv_heads, num_sms, warps, warps_per_sm)
    return max(1, min(max_splits, round(slots / (batch * blocks_per_piece))))


def wave_pieces(num_kv_heads: int, num_sms: int, warps: int, warps_per_sm: int) -> float:
    """(sequence, split) pieces resident at once: a wave of the grid `whole_wave_splits` sizes."""
    slots, blocks_per_piece = _wave(num_kv_heads, num_sms, warps, warps_per_sm)
    return slots / blocks_per_piece


def _wave(num_kv_heads: int, num_sms: int, warps: int, warps_per_sm: int) -> tuple[int, int]:
    """Blocks resident at once, and blocks per (sequence, split) piece (up to `warps` KV heads a block)."""
    warps = min(warps, num_kv_heads)
    return num_sms * max(1, warps_per_sm // warps), math.ceil(num_kv_heads / warps)


# ---- what both kernels' launches share: the MMA tiling's shape limits, their macros, the query's layout ----
HEAD_DIM = 128  # the kernels' tiles are built for this head size
MAX_GROUP = 8  # query heads per KV head: the 8 columns of the MMA tile


def tile_shape_problem(head_dim: int, group: int, block_size: int) -> str | None:
    """Why the kernels' tiling cannot take this head shape and block size (16-token tiles inside a page), or None."""
    if head_dim != HEAD_DIM:
        return f"head_dim {head_dim} != {HEAD_DIM}"
    if group > MAX_GROUP:
        return f"{group} query heads per KV head > {MAX_GROUP}"
    if block_size % 16:
        return f"block_size {block_size} is not a multiple of 16 (the kernels read 16-token tiles inside a page)"
    if block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two"
    return None


def block_settings(config, num_kv_heads: int) -> tuple[int, int, int]:
    """(warps per block, stages, blocks per SM for __launch_bounds__) of a launch under `config`
    ({warps, stages, warps_per_sm}): a block holds up to `warps` KV heads of one (sequence, split)."""
    warps = min(config["warps"], num_kv_heads)
    return warps, config["stages"], max(1, config["warps_per_sm"] // warps)


def compile_options(warps: int, stages: int, min_blocks: int, strides: tuple[int, ...], *extra: str) -> tuple[str, ...]:
    """The -D macros of one compilation: block settings and the cache's strides (bytes per row and per head of
    the codes, scale elements per row and per head), which the sources take as compile-time constants."""
    options = [f"-DWARPS={warps}", f"-DSTAGES={stages}", f"-DMIN_BLOCKS={min_blocks}"]
    options += [f"-D{name}={value}" for name, value in zip(("KV_ROW", "KV_HEAD", "S_ROW", "S_HEAD"), strides)]
    return (*options, *extra)


def kernel_query(q: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, D] as the kernels read it: bf16 rows in 16-byte pieces (a contiguous copy where it is not)."""
    if q.stride(-1) != 1 or q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16:
        return q.contiguous()
    return q


# ---- programmatic dependent launch: torch's kernel object launches with cuLaunchKernel only ----
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def programmatic_launch_problem(device: torch.device) -> str | None:
    """Why kernels on `device` cannot be launched as programmatic dependents, or None: the kernels' waits
    (`griddepcontrol`) exist from sm_90 on, and the launch needs the driver's cuLaunchKernelEx."""
    if device.type != "cuda":
        return "not a CUDA device"
    return _device_programmatic_problem(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache  # asked once a layer in eager steps
def _device_programmatic_problem(index: int) -> str | None:
    return _programmatic_problem(torch.cuda.get_device_capability(index), _has_launch_ex())


def _programmatic_problem(capability: tuple[int, int], has_launch_ex: bool) -> str | None:
    if capability < (9, 0):
        return f"sm_{capability[0]}{capability[1]}: griddepcontrol needs sm_90 or newer"
    return None if has_launch_ex else "the CUDA driver has no cuLaunchKernelEx"


@functools.cache
def _has_launch_ex() -> bool:
    try:
        return hasattr(torch.cuda._utils._get_gpu_runtime_library(), "cuLaunchKernelEx")
    except (OSError, RuntimeError, AttributeError):
        return False


def launch_after_previous(kernel, grid: tuple[int, int, int], block: tuple[int, int, int], args: list,
                          shared_mem: int) -> None:
    """Launch `kernel` (from `compiled`) on torch's current stream as a programmatic dependent of the kernel
    before it: it may start while that one's last blocks run, and must wait (`griddepcontrol.wait`) before it
    reads what that kernel writes. CUDA graphs capture the dependency as a programmatic edge. Arguments as
    torch's launcher takes them: tensors (pointers), ints (C int), floats (C double). Callers check
    `programmatic_launch_problem` first: without the kernels' waits the dependent would race."""
    keep, params = [], []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            value = ctypes.c_void_p(arg.data_ptr())
        elif isinstance(arg, bool) or not isinstance(arg, (int, float)):
            raise TypeError(f"unsupported kernel argument {type(arg).__name__}")
        else:
            value = ctypes.c_int(arg) if isinstance(arg, int) else ctypes.c_double(arg)
        keep.append(value)
        params.append(ctypes.cast(ctypes.byref(value), ctypes.c_void_p))
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                           ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), ctypes.pointer(attr), 1)
    c_params = (ctypes.c_void_p * len(params))(*params)
    status = _driver().cuLaunchKernelEx(ctypes.byref(config), kernel.func, c_params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")


@functools.cache
def _driver():
    lib = torch.cuda._utils._get_gpu_runtime_library()
    lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib
