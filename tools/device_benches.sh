#!/bin/bash
# Device session script: GPU tests and the GPU benchmarks, JSON under $OUT. This is how the
# bench/results/2026-11-30-h200-*.json files were made. Run it from the repository root on a CUDA
# machine, one part per device call (each fits the 10-minute limit):
#   bash tools/device_benches.sh tests baseline 2>&1 | tee $OUT/log.txt   # GPU tests, then the benchmarks
#   bash tools/device_benches.sh optin 2>&1 | tee $OUT/log_optin.txt      # engine.sampler / engine.fused_ops
# Every stage has its own time limit, so one slow stage cannot take the others' results with it.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}

tests() {
    timeout 150 python -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py tests/gpu tests/test_fast_path_cpu.py \
        > $OUT/gpu_tests.txt 2>&1; tail -6 $OUT/gpu_tests.txt
}

baseline() {
    timeout 90 python -m kv4rl.cli bench decode-attn --shapes qwen3-8b --batches 64 --contexts 2048,4096,8192,16384 \
        --json $OUT/decode_attn.json 2>&1 | grep "│" | tail -22
    timeout 140 python -m kv4rl.cli bench decode-forward --shapes qwen3-8b --json $OUT/decode_forward.json 2>&1 \
        | grep "│" | tail -14
    timeout 110 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,kv4 \
        --json $OUT/generate.json 2>&1 | grep "│" | tail -6
}

optin() {  # paths that still need a measurement before they become defaults
    timeout 140 python -m kv4rl.cli bench decode-forward --shapes qwen3-8b --fused-ops \
        --json $OUT/decode_forward_fused.json 2>&1 | grep "│" | tail -14
    timeout 80 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,kv4 --no-hf \
        --json $OUT/generate_fused.json engine.sampler=triton engine.fused_ops=true 2>&1 | grep "│" | tail -6
    timeout 80 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,kv4 --no-hf \
        --weight-format fp8 --json $OUT/generate_fused_fp8.json engine.sampler=triton engine.fused_ops=true 2>&1 \
        | grep "│" | tail -6
}

date
for part in "${@:-tests baseline}"; do
    for stage in $part; do "$stage"; done
done
date
