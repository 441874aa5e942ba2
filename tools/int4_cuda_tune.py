"""Time the INT4/KV4 decode path on the GPU over split counts and the warps of KV4's INT8 item, then
profile one call kernel by kernel (device tool; prints lines and a table)."""

import sys

import torch

from kv4rl.bench.decode_attn import HEAD_SHAPES, PagedCase, _time_graph, body_kernel, kv_bytes_read, time_sdpa
from kv4rl.kernels.decode_common import DecodeKind

shape, batch, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hq, hkv, d = HEAD_SHAPES[shape]
gen = torch.Generator(device="cuda")
gen.manual_seed(5)
sdpa_ms, _, qkv = time_sdpa(batch, context, hq, hkv, d, "cuda", gen)
q = qkv[0][:, :, 0, :].contiguous()
del qkv
print(f"sdpa {sdpa_ms:.4f} ms")


def run(case, label):
    out = case.call(q).float()
    ms = _time_graph(lambda: case.call(q))
    with body_kernel(case, "triton"):
        ref = case.call(q).float()
    err = float((out - ref).norm() / ref.norm())
    print(f"{label}: {ms:.4f} ms {kv_bytes_read(case.fmt.name, batch, context, hkv, d) / ms / 1e9:.2f} TB/s "
          f"{sdpa_ms / ms:.2f}x rel_diff_vs_triton={err:.2e}", flush=True)


for fmt in ("int4", "kv4"):
    case = PagedCase(fmt, batch, context, hq, hkv, d, "cuda", gen)
    for splits in (2, 4, 8):
        case.inputs.batch.max_splits = splits
        case.inputs.batch.split_size.fill_(-(-context // splits // 16) * 16)
        run(case, f"{fmt} splits={splits}")
    case.inputs.batch.max_splits = 8
    case.inputs.batch.split_size.fill_(context // 8)
    if fmt == "kv4":
        for warps in (1, 2, 4):
            case.fast.kernels.launch[DecodeKind.INT8_SIDE]["num_warps"] = warps
            run(case, f"{fmt} int8_side_warps={warps}")
        case.fast.kernels.launch[DecodeKind.INT8_SIDE]["num_warps"] = 1
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            case.call(q)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=40))
