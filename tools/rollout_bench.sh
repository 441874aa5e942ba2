#!/bin/bash
# GPU runs of `kv4rl bench rollout`: what KV4 and partial rollout buy together at one KV memory budget.
# Run from the repository root on a CUDA machine; JSON and figures go under $OUT:
#   bash tools/rollout_bench.sh qwen3_1p7b qwen3_8b 2>&1 | tee $OUT/rollout_log.txt
# ROLLOUT_ARGS adds flags to every line (ROLLOUT_ARGS=--validate-only checks them without a GPU);
# tests/test_bench_rollout.py validates these exact lines on CPU.
#
# Workload of both: 16 prompt groups x 8 responses per learner batch, 256-token prompts, 128 decode
# slots, log-normal response lengths (sigma 1, EOS ignored). A sync batch lasts as long as its longest
# response (about 2% of draws reach --max-len), so the 8B line, at twice the lengths and a larger
# model, needs a longer time limit than the 1.7B one. Where one command may run only 10 minutes, run
# it once per format (ROLLOUT_ARGS="--formats bf16", then "--formats kv4"; the last --formats wins) and
# divide the medians of the two JSON files for the speedups.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}

# Qwen3-1.7B shape, pool in 60% of the GPU for every format (sized by the engine after weights and
# activations), median 512 / max 4096 tokens. All 128 slots at their longest need 128 x 4352 tokens x
# 112 KiB = 59.5 GiB of bf16, which 60% of an H200 holds: here KV4 is measured for its step cost, and
# the 8B line below for what its capacity buys.
qwen3_1p7b() {
    timeout 590 python -m kv4rl.cli bench rollout --shape qwen3-1.7b --formats bf16,kv4 --modes sync,partial \
        --quota-groups 16 --group-size 8 --prompt-len 256 --median-len 512 --max-len 4096 --max-slots 128 \
        engine.gpu_memory_fraction=0.6 --json $OUT/rollout_qwen3_1p7b.json --png $OUT/rollout_qwen3_1p7b.png $ROLLOUT_ARGS
}

# The same workload with KV4 given 256 decode slots (its pool in 60% of the GPU holds them): partial
# rollout keeps twice the responses in flight where BF16 has 128. bf16 sync is the reference again.
qwen3_1p7b_256() {
    timeout 590 python -m kv4rl.cli bench rollout --shape qwen3-1.7b --formats bf16,kv4@256 --modes sync,partial \
        --quota-groups 16 --group-size 8 --prompt-len 256 --median-len 512 --max-len 4096 --max-slots 128 \
        engine.gpu_memory_fraction=0.6 --json $OUT/rollout_qwen3_1p7b_256.json --png $OUT/rollout_qwen3_1p7b_256.png $ROLLOUT_ARGS
}

# Qwen3-8B shape, 40 GiB of KV for every format (bf16: 291,264 tokens, fewer than 128 slots at their
# longest), median 1024 / max 8192 tokens.
qwen3_8b() {
    timeout 1800 python -m kv4rl.cli bench rollout --shape qwen3-8b --kv-budget-gib 40 --formats bf16,kv4 \
        --modes sync,partial --quota-groups 16 --group-size 8 --prompt-len 256 --median-len 1024 --max-len 8192 \
        --max-slots 128 --json $OUT/rollout_qwen3_8b.json --png $OUT/rollout_qwen3_8b.png $ROLLOUT_ARGS
}

# The 8B line with one timed repeat after the warm-up, to fit a 10-minute device call (estimate: a sync
# batch lasts ~8,200 steps, since 91% of 128 draws include one at --max-len; ~320 s for the four corners).
# The JSON is rewritten after each corner, so a call cut short keeps the corners that ran (bf16 sync first).
qwen3_8b_one_repeat() {
    timeout 590 python -m kv4rl.cli bench rollout --shape qwen3-8b --kv-budget-gib 40 --formats bf16,kv4 \
        --modes sync,partial --quota-groups 16 --group-size 8 --prompt-len 256 --median-len 1024 --max-len 8192 \
        --max-slots 128 --repeats 1 --json $OUT/rollout_qwen3_8b.json --png $OUT/rollout_qwen3_8b.png $ROLLOUT_ARGS
}

# The one-repeat 8B line with KV4 given 256 decode slots (its pool in the same 40 GiB holds them, where
# BF16's holds 291,264 tokens): partial rollout keeps twice the responses in flight. ~7.5 min.
qwen3_8b_kv4_256() {
    timeout 590 python -m kv4rl.cli bench rollout --shape qwen3-8b --kv-budget-gib 40 --formats bf16,kv4@256 \
        --modes sync,partial --quota-groups 16 --group-size 8 --prompt-len 256 --median-len 1024 --max-len 8192 \
        --max-slots 128 --repeats 1 --json $OUT/rollout_qwen3_8b_256.json --png $OUT/rollout_qwen3_8b_256.png $ROLLOUT_ARGS
}

# The 1.7B workload over all three cache formats (the FP8 cache too), two timed repeats a corner; each
# corner also times a pure decode step of its mean batch at its mean context (`step / pure`). ~6 min.
qwen3_1p7b_formats() {
    timeout 590 python -m kv4rl.cli bench rollout --shape qwen3-1.7b --formats bf16,fp8,kv4 --modes sync,partial \
        --quota-groups 16 --group-size 8 --prompt-len 256 --median-len 512 --max-len 4096 --max-slots 128 \
        --repeats 2 engine.gpu_memory_fraction=0.6 --json $OUT/rollout_qwen3_1p7b_formats.json \
        --png $OUT/rollout_qwen3_1p7b_formats.png $ROLLOUT_ARGS
}

# The one-repeat 8B line for BF16 and the FP8 cache (~8 min): the sync corners are what takes time.
qwen3_8b_fp8() {
    timeout 590 python -m kv4rl.cli bench rollout --shape qwen3-8b --kv-budget-gib 40 --formats bf16,fp8 \
        --modes sync,partial --quota-groups 16 --group-size 8 --prompt-len 256 --median-len 1024 --max-len 8192 \
        --max-slots 128 --repeats 1 --json $OUT/rollout_qwen3_8b_fp8.json --png $OUT/rollout_qwen3_8b_fp8.png $ROLLOUT_ARGS
}

# Partial rollout only, every cache format and KV4 at 256 slots too (~5 min; KV4 first, so a time
# limit keeps it): the speedups against BF16
# partial of the same run, each corner's engine step against its pure decode step.
qwen3_8b_partial() {
    timeout 590 python -m kv4rl.cli bench rollout --shape qwen3-8b --kv-budget-gib 40 --formats kv4,bf16,kv4@256,fp8 \
        --modes partial --quota-groups 16 --group-size 8 --prompt-len 256 --median-len 1024 --max-len 8192 \
        --max-slots 128 --repeats 1 --json $OUT/rollout_qwen3_8b_partial.json \
        --png $OUT/rollout_qwen3_8b_partial.png $ROLLOUT_ARGS
}

stages=("$@")
if [ ${#stages[@]} -eq 0 ]; then  # each line is minutes on a GPU and hours (and more memory than a host has) off it
    echo "usage: bash tools/rollout_bench.sh LINE [LINE ...]  (on a CUDA machine; lines:" \
        "$(declare -F | awk '{print $3}' | tr '\n' ' '| sed 's/ $//'))" >&2
    exit 2
fi
for stage in "${stages[@]}"; do
    if ! declare -F "$stage" > /dev/null; then
        echo "tools/rollout_bench.sh: no line '$stage' (lines: $(declare -F | awk '{print $3}' | tr '\n' ' '))" >&2
        exit 2
    fi
done
date
for stage in "${stages[@]}"; do
    $stage
done
date
