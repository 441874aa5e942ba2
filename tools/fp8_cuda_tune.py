"""Time the CUDA FP8 decode kernel on the GPU over its compile-time settings (warps per block, cp.async
stages, resident warps per SM) with the split grid each implies, against cuDNN SDPA on BF16 and the
Triton FP8 kernel of the same cache (device tool; prints one line per setting).

    python tools/fp8_cuda_tune.py qwen3-8b 64 8192
"""

import sys

import torch

from kv4rl.bench.decode_attn import HEAD_SHAPES, PagedCase, _time_graph, body_kernel, kv_bytes_read, time_sdpa
from kv4rl.kernels import cuda_source, fp8_decode_cuda

SETTINGS = [
    {"warps": 8, "stages": 3, "warps_per_sm": 16},
    {"warps": 8, "stages": 4, "warps_per_sm": 8},
    {"warps": 4, "stages": 3, "warps_per_sm": 16},
    {"warps": 4, "stages": 4, "warps_per_sm": 12},
    {"warps": 2, "stages": 4, "warps_per_sm": 12},
]

shape, batch, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hq, hkv, d = HEAD_SHAPES[shape]
gen = torch.Generator(device="cuda")
gen.manual_seed(7)
sdpa_ms, _, qkv = time_sdpa(batch, context, hq, hkv, d, "cuda", gen)
q = qkv[0][:, :, 0, :].contiguous()
case = PagedCase("fp8", batch, context, hq, hkv, d, "cuda", gen, bf16_kv=qkv)
del qkv
nbytes = kv_bytes_read("fp8", batch, context, hkv, d)
print(f"{shape} B{batch} x {context}: sdpa-cudnn-bf16 {sdpa_ms:.4f} ms", flush=True)
with body_kernel(case, "triton"):
    ref = case.call(q).float()
    ms = _time_graph(lambda: case.call(q))
print(f"fp8 triton: {ms:.4f} ms {nbytes / ms / 1e9:.2f} TB/s {sdpa_ms / ms:.2f}x sdpa", flush=True)
sms = torch.cuda.get_device_properties(0).multi_processor_count
default = dict(fp8_decode_cuda.CONFIG)
for setting in SETTINGS:
    fp8_decode_cuda.CONFIG = setting
    for splits in sorted({cuda_source.whole_wave_splits(batch, hkv, 64, sms, setting["warps"], setting["warps_per_sm"]),
                          2 * cuda_source.whole_wave_splits(batch, hkv, 64, sms, setting["warps"],
                                                            setting["warps_per_sm"])}):
        case.inputs.batch.max_splits = splits
        case.inputs.batch.split_size.fill_(-(-context // splits // 128) * 128)
        out = case.call(q).float()
        err = float((out - ref).norm() / ref.norm())
        ms = _time_graph(lambda: case.call(q))
        print(f"fp8 cuda {setting} splits={splits}: {ms:.4f} ms {nbytes / ms / 1e9:.2f} TB/s {sdpa_ms / ms:.2f}x sdpa "
              f"rel_diff_vs_triton={err:.2e}", flush=True)
fp8_decode_cuda.CONFIG = default
