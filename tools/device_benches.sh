#!/bin/bash
# One device session: GPU tests, a kernel diagnostic and the GPU benchmarks, JSON under $OUT
# (how bench/results/2026-11-30-h200-*.json were made; run from the repository root on a CUDA machine).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
date
timeout 110 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/gpu/test_engine_fast_path_gpu.py tests/gpu/test_fp8_linear_gpu.py > $OUT/gpu_tests.txt 2>&1; tail -4 $OUT/gpu_tests.txt
timeout 30 python - <<'PY'
from kv4rl.bench import decode_attn as B
rows = B.tune(["int4", "fp8", "bf16"], [{}, {"num_stages": 3}], "qwen3-8b", 64, 8192)
for r in rows: print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
PY
timeout 90 python -m kv4rl.cli bench decode-attn --shapes qwen3-8b --batches 64 --contexts 2048,4096,8192,16384 --json $OUT/decode_attn.json 2>&1 | grep "│" | tail -22
timeout 45 python -m kv4rl.cli bench decode-attn --shapes qwen3-1.7b,qwen3-4b --batches 64 --contexts 8192 --formats bf16,kv4 --json $OUT/decode_attn_small.json 2>&1 | grep "│" | tail -8
timeout 140 python -m kv4rl.cli bench decode-forward --shapes qwen3-8b --json $OUT/decode_forward.json 2>&1 | grep "│" | tail -14
timeout 110 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,kv4 --json $OUT/generate.json 2>&1 | grep "│" | tail -6
date
