"""`kv4rl bench decode-attn`: one layer's decode attention over a paged cache, per KV format, against
torch SDPA (cuDNN) on a contiguous BF16 cache measured in the same run.

Caches are filled with random codes and scales (the kernels' speed does not depend on the values, and
random data cannot hide unwritten memory the way zeros can), pages are shuffled as after a long run of
continuous batching, and every sequence has the full context. Times are medians of CUDA-graph replays
(several calls per graph, so launch gaps do not count); bandwidth counts the bytes the kernel must read:
codes, scales and zero points, protected INT8 rows (the query and its output, ~0.1%, are left out).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kv4rl.bench.random_model import QWEN3_SHAPES

if TYPE_CHECKING:  # the kernels need triton: imported where they run, so the CLI can check its options without it
    from kv4rl.kernels.decode_attention import DecodeKernels

# -triton: the body in Triton; kv4-serial: KV4's CUDA INT8 item after the body, not beside it
FORMATS = ("bf16", "fp8", "int4", "kv4", "fp8-triton", "int4-triton", "kv4-triton", "kv4-serial")
HEAD_SHAPES = {name: (QWEN3_SHAPES[name]["num_attention_heads"], QWEN3_SHAPES[name]["num_key_value_heads"],
                      QWEN3_SHAPES[name]["head_dim"]) for name in ("qwen3-1.7b", "qwen3-4b", "qwen3-8b")}


def kv_bytes_read(fmt: str, batch: int, context: int, hkv: int, d: int, n_sink: int = 16, n_recent: int = 128) -> int:
    """Bytes of K and V the kernel reads for one decode step (scales and zeros included)."""
    per_token = {"bf16": 2 * d, "fp8": d + 4, "int4": d // 2 + 4}
    if fmt == "kv4":
        protected = min(context, n_sink + n_recent)
        tokens = (context - protected) * per_token["int4"] + protected * (d + 4)
    else:
        tokens = context * per_token[fmt]
    return 2 * batch * hkv * tokens


def _time_graph(fn, calls: int = 10, reps: int = 30) -> float:
    """Median ms per call over `reps` replays of a graph holding `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def sdpa_backend():
    from torch.nn.attention import SDPBackend

    return SDPBackend.CUDNN_ATTENTION


def time_sdpa(batch: int, context: int, hq: int, hkv: int, d: int, device, gen) -> tuple[float, torch.Tensor, tuple]:
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(batch, hq, 1, d, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, hkv, context, d, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, hkv, context, d, device=device, dtype=torch.bfloat16, generator=gen)

    def call():
        with sdpa_kernel([sdpa_backend()]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    out = call()
    return _time_graph(call), out, (q, k, v)


def fill_random(cache: dict, gen: torch.Generator) -> None:
    """Random codes and plausible scales in every cache tensor (never zeros: they hide unread memory)."""
    for name, t in cache.items():
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, device=t.device, dtype=torch.uint8, generator=gen))
        elif t.dtype == torch.int8:
            t.copy_(torch.randint(-127, 128, t.shape, device=t.device, dtype=torch.int8, generator=gen))
        elif t.dtype == torch.float8_e4m3fn:
            t.copy_(torch.randn(t.shape, device=t.device, generator=gen).to(torch.float8_e4m3fn))
        elif "scale" in name:
            t.copy_(torch.rand(t.shape, device=t.device, generator=gen) * 0.02 + 0.01)
        else:
            t.normal_(0.0, 0.1, generator=gen)


class PagedCase:
    """A paged cache of one layer in `fmt` with every sequence at `context` tokens."""

    def __init__(self, fmt: str, batch: int, context: int, hq: int, hkv: int, d: int, device, gen,
                 block_size: int = 16, bf16_kv: tuple | None = None, n_sink: int = 16, n_recent: int = 128,
                 kernels: DecodeKernels | None = None):
        from kv4rl.engine.fast_path import DecodeInputs, FastAttention
        from kv4rl.engine.kv_formats import get_kv_format
        from kv4rl.kernels.decode_attention import DecodeBatch

        opts = {"group_size": d} if fmt in ("int4", "kv4") else {}
        if fmt == "kv4":
            opts.update(n_sink=n_sink, n_recent=n_recent)
        self.fmt = get_kv_format(fmt, **opts)
        blocks_per_seq = math.ceil(context / block_size)
        num_blocks = batch * blocks_per_seq
        self.cache = self.fmt.allocate(num_blocks * block_size, hkv, d, device, num_seq_slots=batch)
        fill_random(self.cache, gen)
        perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
        tables = perm.view(batch, blocks_per_seq)
        if bf16_kv is not None and fmt == "bf16":  # the very values SDPA reads, for a sanity check
            _, k, v = bf16_kv
            slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
            slots = slots[:, :context]
            self.cache["k"][slots] = k.transpose(1, 2)
            self.cache["v"][slots] = v.transpose(1, 2)
        self.fast = FastAttention(self.fmt, hkv, d, block_size, torch.device(device), num_q_heads=hq,
                                  kernels=kernels)
        host_lens = torch.full((batch,), context, dtype=torch.int32)
        split = self.fast.split_size(context, batch)
        self.inputs = DecodeInputs(
            slots=torch.full((batch,), -1, dtype=torch.long, device=device), protect_rows=None,
            batch=DecodeBatch(block_tables=tables, context_lens=host_lens.to(device),
                              seq_slots=torch.arange(batch, dtype=torch.int32, device=device),
                              split_size=torch.tensor([split], dtype=torch.int32, device=device),
                              max_splits=self.fast.num_splits(batch), block_size=block_size))
        self.split = split

    def call(self, q: torch.Tensor) -> torch.Tensor:
        return self.fast.attend(self.cache, q, self.inputs)


@contextlib.contextmanager
def body_kernel(case: PagedCase, which: str):
    """Run the case's INT4/FP8 body in its CUDA kernel ('auto': where it can) or in Triton ('triton')."""
    kernels = case.fast.kernels
    saved = kernels.int4_cuda, kernels.fp8_cuda
    kernels.int4_cuda = kernels.fp8_cuda = which != "triton"
    try:
        yield
    finally:
        kernels.int4_cuda, kernels.fp8_cuda = saved


def run_decode_attn(shapes: list[str], batches: list[int], contexts: list[int], formats: list[str], device="cuda",
                    seed: int = 0, progress=None) -> dict:
    from kv4rl.kernels.decode_attention import DecodeKernels

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    results = []
    for shape in shapes:
        hq, hkv, d = HEAD_SHAPES[shape]
        for batch in batches:
            for context in contexts:
                sdpa_ms, sdpa_out, qkv = time_sdpa(batch, context, hq, hkv, d, device, gen)
                sdpa_bytes = kv_bytes_read("bf16", batch, context, hkv, d)
                q = qkv[0][:, :, 0, :].contiguous()
                results.append({"shape": shape, "format": "sdpa-cudnn-bf16", "batch": batch, "context": context,
                                "ms": sdpa_ms, "tbps": sdpa_bytes / sdpa_ms / 1e9, "speedup_vs_sdpa": 1.0,
                                "bytes": sdpa_bytes})
                for fmt in formats:
                    base, _, kernel = fmt.partition("-")
                    # the split grid follows the body's kernel too
                    case = PagedCase(base, batch, context, hq, hkv, d, device, gen, bf16_kv=qkv,
                                     kernels=DecodeKernels(int4_cuda=kernel != "triton", fp8_cuda=kernel != "triton",
                                                           int8_item_beside_body=kernel != "serial"))
                    out = case.call(q)
                    check = {"finite": bool(torch.isfinite(out).all())}
                    if case.fast.body_kernel is not None:
                        check["kernel"] = case.fast.body_kernel
                    ms = _time_graph(lambda c=case, q=q: c.call(q))
                    if fmt == "bf16":
                        ref = sdpa_out[:, :, 0, :].float()
                        check["rel_err_vs_sdpa"] = float((out.float() - ref).norm() / ref.norm())
                    elif check.get("kernel") == "cuda":  # the same cache through the Triton kernel
                        with body_kernel(case, "triton"):
                            ref = case.call(q).float()
                        check["rel_diff_vs_triton"] = float((out.float() - ref).norm() / ref.norm())
                    nbytes = kv_bytes_read(base, batch, context, hkv, d)
                    results.append({"shape": shape, "format": fmt, "batch": batch, "context": context, "ms": ms,
                                    "tbps": nbytes / ms / 1e9, "speedup_vs_sdpa": sdpa_ms / ms, "bytes": nbytes,
                                    "split_size": case.split, "splits": case.inputs.batch.max_splits, **check})
                    del case
                    if progress:
                        progress(results[-1])
                del qkv, sdpa_out
                torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}


def tune(kinds: list[str], configs: list[dict], shape: str, batch: int, context: int, device="cuda") -> list[dict]:
    """Time each launch config (BLOCK_N, num_warps, num_stages) per kind at one shape."""
    hq, hkv, d = HEAD_SHAPES[shape]
    gen = torch.Generator(device=device)
    gen.manual_seed(1)
    q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16, generator=gen)
    rows = []
    for fmt in kinds:
        case = PagedCase(fmt, batch, context, hq, hkv, d, device, gen)
        kind, tuned = case.fmt.decode_kind, case.fast.kernels
        ref = case.call(q).float()
        default_split = int(case.inputs.batch.split_size)
        for cfg in configs:
            cfg = dict(cfg)
            if "split" in cfg:  # a fixed split size: the grid must cover the context with it
                case.inputs.batch.max_splits = math.ceil(context / cfg["split"])
            else:
                case.inputs.batch.max_splits = case.fast.num_splits(batch)
            case.inputs.batch.split_size.fill_(cfg.pop("split", default_split))
            case.fast.kernels = tuned.with_launch(kind, **cfg)
            try:
                out = case.call(q).float()
                err = float((out - ref).norm() / ref.norm())
                ms = _time_graph(lambda c=case, q=q: c.call(q))
            except Exception as exc:  # noqa: BLE001 - a config may not compile (shared memory)
                rows.append({"format": fmt, **cfg, "error": str(exc)[:80]})
                continue
            ck = case.fast.kernels.last_compiled
            stats = {"regs": getattr(ck, "n_regs", None), "spills": getattr(ck, "n_spills", None),
                     "smem": getattr(ck, "shared", None)}
            rows.append({"format": fmt, **cfg, **stats, "split": int(case.inputs.batch.split_size), "ms": ms, "tbps": kv_bytes_read(fmt, batch, context, hkv, d) / ms / 1e9,
                         "rel_diff": err})
        del case
    return rows
