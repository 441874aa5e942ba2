#!/bin/bash
# Device session script: GPU tests and the GPU benchmarks, JSON under $OUT. This is how the second
# round's bench/results/2026-11-30-h200-*-cuda-int4.json files were made (the first round's came from
# an earlier version of this script with the same bench commands). Run it from the repository root on a CUDA
# machine; stages run in the order given, each with its own time limit, so one slow stage cannot take
# the others' results with it:
#   bash tools/device_benches.sh tests_kernels attn generate forward 2>&1 | tee $OUT/log.txt
#   bash tools/device_benches.sh tests_engine 2>&1 | tee $OUT/log.txt              # the engine's GPU tests (~5 min)
#   bash tools/device_benches.sh learner 2>&1 | tee $OUT/log.txt               # the learner (~4 min)
#   bash tools/device_benches.sh entropy_objectives 2>&1 | tee $OUT/log.txt    # entropy bonus / top-entropy step vs plain (~3 min)
#   bash tools/device_benches.sh profile_learner 2>&1 | tee $OUT/log.txt       # its step by kernel family, eager and fused (~3 min)
#   bash tools/device_benches.sh compiled 2>&1 | tee $OUT/log.txt              # trainer.compile_layers vs fused (~5 min)
#   bash tools/device_benches.sh fused_logprobs 2>&1 | tee $OUT/log.txt        # the Triton log-prob head (~4 min)
#   bash tools/device_benches.sh iteration 2>&1 | tee $OUT/log.txt             # one RL iteration per arm (~8 min)
#   bash tools/device_benches.sh iteration_compiled 2>&1 | tee $OUT/log.txt    # baseline and awake@192/256, CUDA learner defaults (~5 min)
#   bash tools/device_benches.sh merged 2>&1 | tee $OUT/log.txt                # merged projections (~8 min)
#   bash tools/device_benches.sh engine_tests 2>&1 | tee $OUT/log.txt          # engine GPU tests (~4 min)
#   bash tools/device_benches.sh fit_4b 2>&1 | tee $OUT/log.txt                # 4B baseline, awake@192 and @256 (~8 min)
#   bash tools/device_benches.sh fit_8b 2>&1 | tee $OUT/log.txt                # 8B, AdamW moments on the host (<10 min)
#   bash tools/device_benches.sh generate_async 2>&1 | tee $OUT/log.txt        # async scheduling vs sync (~5 min)
#   bash tools/device_benches.sh roofline 2>&1 | tee $OUT/log.txt              # issue 11's points against the byte roofline (~6 min)
#   bash tools/device_benches.sh fp8 2>&1 | tee $OUT/log.txt                   # the CUDA FP8 decode kernel: tests, decode-attn, settings (~5 min)
#   bash tools/device_benches.sh fp8_gemm 2>&1 | tee $OUT/log.txt              # the weight-only FP8 GEMM: tests, tile sweep, 8B step (~6 min)
#   bash tools/device_benches.sh run_ahead 2>&1 | tee $OUT/log.txt             # engine tests, 1.7B rollout over all formats (<10 min)
#   bash tools/device_benches.sh prefill_graphs 2>&1 | tee $OUT/log.txt        # prefill graphs: GPU tests, 1.7B rollout with them (<10 min)
#   bash tools/device_benches.sh gemm_blas 2>&1 | tee $OUT/log.txt             # decode GEMMs under cuBLAS and cuBLASLt (~1 min)
#   bash tools/device_benches.sh profile_rollout 2>&1 | tee $OUT/log.txt       # 1.7B partial-rollout step vs pure step, by kernel family (~2 min)
#   bash tools/device_benches.sh write_sampler 2>&1 | tee $OUT/log.txt         # K+V write in one launch, sampler passes: tests and timings (~5 min)
#   bash tools/device_benches.sh screen_beside 2>&1 | tee $OUT/log.txt         # sampler screen + log-sum-exp, INT8 item beside the body (~6 min)
#   bash tools/device_benches.sh step_profiles 2>&1 | tee $OUT/log.txt         # KV4 rollout step, generate 1.7B, B256 step profile (~6 min)
#   bash tools/device_benches.sh fp8_decode_gemm 2>&1 | tee $OUT/log.txt      # Triton e4m3 GEMM: tests, tile grid, 8B step both paths (<10 min)
#   bash tools/device_benches.sh fp8_inputs 2>&1 | tee $OUT/log.txt           # FP8 inputs from the norms/SwiGLU: tests, 8B step both ways (~6 min)
#   bash tools/device_benches.sh fp8_tma 2>&1 | tee $OUT/log.txt              # TMA-fed e4m3 tiles: tests, grid, products, generate with FP8 weights (<10 min)
#   bash tools/device_benches.sh generate_hf3 2>&1 | tee $OUT/log.txt         # bench generate 1.7B with transformers timed 3x per batch (~4 min)
#   bash tools/device_benches.sh short_profiles 2>&1 | tee $OUT/log.txt       # 8B generate steps at 128+256 tokens by kernel family: FP8 weights, KV4 (~5 min)
#   bash tools/device_benches.sh kv4_short 2>&1 | tee $OUT/log.txt            # KV4 vs BF16 at short 8B contexts: write tests, its parts, generate B16/B64 (~3 min)
#   bash tools/device_benches.sh kv4_item 2>&1 | tee $OUT/log.txt             # KV4's INT8 item, warps per head by batch vs one: tests, decode-attn, generate (~5 min)
#   bash tools/device_benches.sh prefill_long 2>&1 | tee $OUT/log.txt         # prefill launch settings by step length, 8B B16 4096+512 (~5 min)
#   bash tools/device_benches.sh prefill_short 2>&1 | tee $OUT/log.txt        # short-prompt prefill by kernel, KV4 vs BF16, 8B short generate (~5 min)
#   bash tools/device_benches.sh prefill_variants 2>&1 | tee $OUT/log.txt     # prefill kernel sources in tools/_variants/ against main's (~1 min each)
#   bash tools/device_benches.sh write_variants 2>&1 | tee $OUT/log.txt       # KV write sources in tools/_write_variants/ against main's (~2 min each)
#   bash tools/device_benches.sh prefill_whole 2>&1 | tee $OUT/log.txt        # prefill + engine GPU tests, layer by kernel, tiles, generate 8B short and 1.7B (~6 min)
#   bash tools/device_benches.sh kv4_tiles 2>&1 | tee $OUT/log.txt            # prefill GPU tests, tiles at 1.7B heads, generate 1.7B / 8B short / 8B B128 (~5 min)
#   bash tools/device_benches.sh prefill_trees 2>&1 | tee $OUT/log.txt        # multi-file candidates in tools/_trees/NAME/ against main's (~1 min each)
#   bash tools/device_benches.sh prefill_trees_short 2>&1 | tee $OUT/log.txt  # the same at a short prompt, with 8B B64 short generate (~40 s each)
#   bash tools/device_benches.sh targets_8b 2>&1 | tee $OUT/log.txt           # issue 11's 8B points: B128 full memory, memory-limited B256, whole step (<10 min)
#   bash tools/device_benches.sh rope_rotation 2>&1 | tee $OUT/log.txt      # q/k rotated in the RoPE kernel: settings, write layouts, generate vs tools/_trees/ (~6 min)
#   bash tools/device_benches.sh rope_trees 2>&1 | tee $OUT/log.txt         # RoPE-kernel candidates in tools/_trees/ against main's (~2 min each)
#   bash tools/device_benches.sh write_small 2>&1 | tee $OUT/log.txt        # unrotated decode KV writes in 1-16-row programs (~1 min)
#   bash tools/device_benches.sh kv4_item_write 2>&1 | tee $OUT/log.txt     # KV4's INT8 item stores the decode step's K/V: GPU tests (<8 min)
#   bash tools/device_benches.sh kv4_item_write_ab 2>&1 | tee $OUT/log.txt  # the same, 8B short generate with it and without, twice (~6 min)
#   bash tools/device_benches.sh shapes 2>&1 | tee $OUT/log.txt                # decode + prefill kernels at 64/256-dim heads (~2 min)
#   bash tools/device_benches.sh rl_options 2>&1 | tee $OUT/log.txt            # behavior_rs (both modes), dppo, ipo, normalised IS on CUDA (~2 min)
#   bash tools/device_benches.sh host_api 2>&1 | tee $OUT/log.txt              # host time in CUDA API calls, KV4 item beside/after, BF16 (~5 min)
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}

KERNEL_TESTS="tests/test_kernels.py tests/test_logprob_head_kernel.py tests/test_roofline.py tests/gpu/test_fp8_linear_gpu.py
    tests/gpu/test_fp8_quant_kernel_gpu.py tests/gpu/test_fused_elementwise_gpu.py tests/gpu/test_fused_ops_gpu.py
    tests/gpu/test_prefill_kernel_gpu.py tests/gpu/test_sampling_kernel_gpu.py tests/gpu/test_kernel_shapes_gpu.py"

tests() {  # every GPU-side test: kernels (the CUDA INT4 kernel and KV4 in every layout), engine, FP8, pool
    # (443 s whole on an H200 on 2026-12-04; on an H100 on 2026-12-05 it passed 540 s at 237 of 252: run it as two
    # calls, `tests_kernels` and `tests_engine`, where one call may take 10 minutes at most)
    tests_kernels
    tests_engine
}

tests_kernels() {  # the kernels against their references, the FP8 linears, the byte roofline (~5 min)
    timeout 420 python -m pytest -q -p no:cacheprovider -rf $KERNEL_TESTS -k "not heads_on_m or kv4" \
        > $OUT/gpu_tests_kernels.txt 2>&1; tail -8 $OUT/gpu_tests_kernels.txt
}

tests_engine() {  # the engine, the learner and the pool on the GPU (~5 min)
    local ignore=""
    for f in $KERNEL_TESTS; do ignore="$ignore --ignore=$f"; done
    timeout 420 python -m pytest -q -p no:cacheprovider -rf tests/gpu tests/test_fast_path_cpu.py $ignore \
        > $OUT/gpu_tests_engine.txt 2>&1; tail -8 $OUT/gpu_tests_engine.txt
}

attn() {
    timeout 90 python -m kv4rl.cli bench decode-attn --shapes qwen3-8b --batches 64 --contexts 4096,8192,16384 \
        --formats bf16,fp8,int4,kv4,kv4-triton --json $OUT/decode_attn.json 2>&1 | grep "│" | tail -22
}

generate() {
    timeout 130 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,kv4 \
        --json $OUT/generate.json 2>&1 | grep "│" | tail -6
}

generate_hf3() {  # issue 11: the >= 15x-transformers target with transformers timed three times per batch (its rate
    # varied by a third between runs; the ratio is over the median), 1.7B B64/B256, BF16 and KV4 (~4 min)
    timeout 300 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,kv4 \
        --hf-repeats 3 --json $OUT/generate_hf3.json 2>&1 | grep "│" | tail -6
}

generate_async() {  # issue 11: engine.async_scheduling (the next step launched before this one's tokens are
    # read) against the synchronous engine, 1.7B B64/B256 BF16 and KV4; its GPU tests first (~5 min). The
    # host part of a step was 1.9-3.7 ms of 4.6-6.6 ms on 2026-12-02 (35.2k tok/s BF16 at B256)
    timeout 150 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_async_scheduling_gpu.py \
        tests/gpu/test_engine_no_host_wait_gpu.py > $OUT/async_tests.txt 2>&1; tail -3 $OUT/async_tests.txt
    timeout 200 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,kv4 \
        --scheduling sync,async --json $OUT/generate_async.json 2>&1 | grep "│" | tail -10
}

fp8() {  # issue 11 part 3: the CUDA FP8 decode kernel - its GPU tests (and every kernel test), the decode-attention
    # points of the target (B64 x 4k-16k) and a short-context one, then its launch settings (~5 min)
    timeout 300 python -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py tests/test_engine_plan.py \
        > $OUT/fp8_tests.txt 2>&1; tail -8 $OUT/fp8_tests.txt
    timeout 120 python -m kv4rl.cli bench decode-attn --shapes qwen3-8b --batches 64 --contexts 4096,8192,16384 \
        --formats bf16,fp8,fp8-triton,kv4 --json $OUT/decode_attn_fp8.json 2>&1 | grep "│" | tail -16
    timeout 60 python -m kv4rl.cli bench decode-attn --shapes qwen3-8b --batches 128 --contexts 1024 \
        --formats bf16,fp8,fp8-triton,kv4 --json $OUT/decode_attn_fp8_short.json 2>&1 | grep "│" | tail -6
    timeout 120 python tools/fp8_cuda_tune.py qwen3-8b 64 8192 2>&1 | tail -12
}

fp8_gemm() {  # issue 11 part 3: the weight-only FP8 GEMM for decode batches - its GPU tests, the 8B products
    # against cuBLAS BF16 and scaled_mm with a tile sweep (compiled first in 8 processes), the whole 8B step
    # (since the GEMM stayed out of the engine, decode-forward's FP8 rows time scaled_mm, its current path)
    timeout 200 python -m pytest -q -p no:cacheprovider -rf tests/test_fp8_weight_gemm.py tests/gpu/test_fp8_linear_gpu.py \
        tests/gpu/test_fp8_quant_kernel_gpu.py tests/test_engine_plan.py > $OUT/fp8_gemm_tests.txt 2>&1; tail -8 $OUT/fp8_gemm_tests.txt
    for i in 0 1 2 3 4 5 6 7; do
        timeout 150 python tools/gemm_decode_shapes.py --shape qwen3-8b --rows 64,128,256 --warm-only $i/8 > $OUT/warm_$i.txt 2>&1 &
    done; wait; cat $OUT/warm_*.txt | sort | uniq -c | head -5
    timeout 200 python tools/gemm_decode_shapes.py --shape qwen3-8b --rows 64,128,256 --fp8 --sweep \
        --json $OUT/gemm_fp8_8b.json 2>&1 | grep -v "skipped" | tail -20
    timeout 150 python -m kv4rl.cli bench decode-forward --shapes qwen3-8b --json $OUT/decode_forward_fp8_gemm.json \
        2>&1 | grep "│" | tail -14
}

roofline() {  # issue 11: each point's decode step against its byte roofline (`kv4rl.bench.roofline`, printed
    # since the eleventh session): 1.7B B64/B256, the whole 8B step at early/mid/late, 8B B128 full memory
    # (KV4 9.09 ms against a ~5.1 ms roofline, 56%, and BF16 76% there, worked out after the 2026-12-02 run)
    # (FP8 caches too since the CUDA FP8 body, thirteenth session)
    timeout 150 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,fp8,kv4 \
        --no-hf --json $OUT/generate_roofline_1p7b.json 2>&1 | grep "│" | tail -8
    timeout 150 python -m kv4rl.cli bench decode-forward --shapes qwen3-8b --json $OUT/decode_forward_roofline.json \
        2>&1 | grep "│" | tail -14
    timeout 150 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 128 --prompt-len 512 \
        --new-tokens 1024 --kv-format bf16,fp8,kv4 --no-hf --json $OUT/generate_roofline_8b.json 2>&1 | grep "│" | tail -5
}

forward() {
    timeout 130 python -m kv4rl.cli bench decode-forward --shapes qwen3-8b --json $OUT/decode_forward.json 2>&1 \
        | grep "│" | tail -14
}

merged() {  # engine.merge_projections: one GEMM for q|k|v and one for gate|up, against the separate products
    timeout 120 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_fused_ops_gpu.py tests/gpu/test_fp8_linear_gpu.py \
        > $OUT/merged_tests.txt 2>&1; tail -3 $OUT/merged_tests.txt
    for m in merge-projections no-merge-projections; do
        timeout 150 python -m kv4rl.cli bench decode-forward --shapes qwen3-1.7b,qwen3-8b --$m \
            --json $OUT/decode_forward_$m.json 2>&1 | grep "│" | tail -14
    done
    timeout 130 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,kv4 \
        --json $OUT/generate_merged.json 2>&1 | grep "│" | tail -6
}

compiled() {  # issue 12: trainer.compile_layers (every decoder layer one compiled region) against the fused
    # learner, uniform and log-normal, and its step by kernel family (~5 min; timed on 2026-12-02)
    timeout 150 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_learner_options_gpu.py -k compile_layers \
        > $OUT/compiled_tests.txt 2>&1; tail -4 $OUT/compiled_tests.txt
    for w in uniform lognormal; do
        timeout 240 python -m kv4rl.cli bench learner --shape qwen3-1.7b --workload $w --layouts packed \
            --attention flex --fuse-elementwise on --compile-layers off,on --checkpointing off --reference off \
            --steps 2 --json $OUT/learner_compiled_$w.json 2>&1 | grep -E "│|/[0-9]+ pa"
    done
    timeout 150 python tools/profile_learner.py --shape qwen3-1.7b --workload uniform --attention flex \
        --fuse-elementwise --compile-layers --ops 30 --json $OUT/profile_learner_compiled.json 2>&1 \
        | grep -v "^USDT" | tail -66
}

fused_logprobs() {  # issue 12: trainer.fused_logprobs (the Triton log-prob head) on top of compiled layers
    # (256 s on 2026-12-02 with generate: 48.0% / 43.0% MFU): kernel and learner GPU tests, then the two steps
    timeout 150 python -m pytest -q -p no:cacheprovider -rf tests/test_logprob_head_kernel.py \
        tests/gpu/test_learner_options_gpu.py -k "not compile_layers" > $OUT/fused_logprobs_tests.txt 2>&1
    tail -4 $OUT/fused_logprobs_tests.txt
    for w in uniform lognormal; do
        timeout 200 python -m kv4rl.cli bench learner --shape qwen3-1.7b --workload $w --layouts packed \
            --attention flex --fuse-elementwise on --compile-layers on --fused-logprobs off,on --checkpointing off \
            --reference off --steps 2 --json $OUT/learner_fused_logprobs_$w.json 2>&1 | grep -E "│|/[0-9]+ pa"
    done
}

entropy_objectives() {  # the forty-fifth session's entropy bonus (the Triton head's entropy gradient) and
    # top_entropy_quantile: the head's GPU tests, then the 1.7B uniform step with each against without (~3 min)
    timeout 120 python -m pytest -q -p no:cacheprovider -rf tests/test_logprob_head_kernel.py \
        > $OUT/entropy_tests.txt 2>&1; tail -3 $OUT/entropy_tests.txt
    for arm in "0 1" "0.001 1" "0 0.2"; do set -- $arm
        timeout 100 python -m kv4rl.cli bench learner --shape qwen3-1.7b --workload uniform --layouts packed \
            --attention flex --checkpointing off --reference off --steps 2 --entropy-coeff $1 \
            --top-entropy-quantile $2 --json $OUT/learner_entropy_$1_$2.json 2>&1 | grep -E "│"
    done
}

learner() {  # issue 12: the packed learner with FlexAttention vs SDPA's dense mask, and vs padded rows, 1.7B
    # shape (~4 min on 2026-12-01; each variant is printed and the JSON rewritten as soon as it is timed)
    timeout 200 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_learner_flex_gpu.py tests/gpu/test_learner_gpu.py \
        tests/gpu/test_fused_elementwise_gpu.py tests/gpu/test_update_memory_gpu.py \
        > $OUT/learner_tests.txt 2>&1; tail -4 $OUT/learner_tests.txt
    timeout 180 python -m kv4rl.cli bench learner --shape qwen3-1.7b --workload uniform --layouts packed \
        --attention flex --fuse-elementwise off,on --checkpointing off --reference off --steps 2 \
        --json $OUT/learner_uniform.json 2>&1 | grep -E "│|/[0-9]+ pa"
    # the log-normal mix with the fused learner (CUDA default), with and without activation checkpointing:
    # checkpointing recomputes the forward, which MFU does not count (packed vs padded: 5.5x, measured twice)
    timeout 150 python -m kv4rl.cli bench learner --shape qwen3-1.7b --workload lognormal --layouts packed \
        --attention flex --checkpointing off,on --reference off --steps 1 --json $OUT/learner_lognormal.json 2>&1 \
        | grep -E "│|/[0-9]+ pa"
}

profile_learner() {  # issue 12: the packed flex learner step kernel family by family (~1.5 min)
    for fused in "" --fuse-elementwise; do
        timeout 150 python tools/profile_learner.py --shape qwen3-1.7b --workload uniform --attention flex $fused \
            --ops 30 --json $OUT/profile_learner_uniform$fused.json 2>&1 | grep -v "^USDT" | tail -66
    done
}

iteration() {  # issue 12: seconds per RL iteration at the 1.7B shape, packed learner, the issue's length mix
    # (311 s for the first two arms on 2026-12-01: a warm-up and one timed iteration per arm; each arm is
    # printed and the JSON rewritten when it ends, so the limit keeps the arms that finished)
    # kv4+partial+awake: no sleep, the carried responses keep their KV (352 s for the three arms of the
    # fifth session, which had kv4+partial@256, 37 s per iteration, where this has the awake arm)
    # two warm-up iterations: with one, the first call on a fresh machine timed kv4+partial's rollout 20-44% long
    # (forty-first and forty-eighth sessions; the partial rollout's mixed shapes compile on later iterations)
    timeout 570 python -m kv4rl.cli bench iteration --shape qwen3-1.7b --arms bf16+sync,kv4+partial,kv4+partial+awake \
        --quota-groups 16 --group-size 8 --median-len 1024 --max-len 8192 --max-tokens-per-micro-batch 16384 \
        --warmup-iterations 2 --iterations 1 --json $OUT/iteration_1p7b.json --png $OUT/iteration_1p7b.png 2>&1 \
        | grep -E "│|s per iteration|error" | tail -10
}

iteration_compiled() {  # issue 12: the iteration with the learner's CUDA defaults (compiled layers and the
    # Triton log-prob head since 2026-12-02: 48.0% MFU per 1.7B step) against the baseline, the awake arm at
    # 192 decode slots (2.01x with compiled layers and the torch head on 2026-12-02: 23.35 s against 47.02)
    # and at 256 (a full KV4 pool would be 2 x 31.2 GiB beside the learner's ~76 GiB; where the GPU has less,
    # the pool is sized to what is free and the arm preempts: its JSON row counts the preemptions). On the
    # asynchronous engine, 2026-12-02 (eleventh session, 297 s): 37.48 s baseline, 1.82x at 192, 2.01x at 256
    timeout 570 python -m kv4rl.cli bench iteration --shape qwen3-1.7b \
        --arms bf16+sync,kv4+partial+awake@192,kv4+partial+awake@256 \
        --quota-groups 16 --group-size 8 --median-len 1024 --max-len 8192 --max-tokens-per-micro-batch 16384 \
        --iterations 1 --json $OUT/iteration_1p7b_compiled.json \
        --png $OUT/iteration_1p7b_compiled.png 2>&1 | grep -E "│|s per iteration|Error" | tail -9
}

engine_tests() {  # the engine on CUDA: fast path (mixed steps replaying the decode graph), prefill, sleep/wake,
    # and no host wait inside a step's launch (on 2026-12-02, after the iteration stage, 10 of the first
    # three files' 15 tests had passed when a 200 s limit cut the stage)
    timeout 330 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine_no_host_wait_gpu.py \
        tests/gpu/test_engine_fast_path_gpu.py tests/gpu/test_prefill_engine_gpu.py tests/gpu/test_engine_sleep_gpu.py \
        > $OUT/engine_tests.txt 2>&1
    tail -4 $OUT/engine_tests.txt
}

run_ahead() {  # issue 11: the fifteenth session's engine changes on the GPU - balanced splits for skewed
    # batches and run-ahead while a group waits for its slots: their GPU tests, then the 1.7B rollout over
    # every cache format (`run ahead` and `step / pure` columns; fifteenth session: KV4 partial 1.60x the
    # pure step, 849 decode steps a batch nearly none of them run ahead)
    timeout 240 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_async_scheduling_gpu.py \
        tests/gpu/test_engine_fast_path_gpu.py tests/gpu/test_bench_rollout_gpu.py > $OUT/run_ahead_tests.txt 2>&1
    tail -4 $OUT/run_ahead_tests.txt
    OUT=$OUT bash tools/rollout_bench.sh qwen3_1p7b_formats 2>&1 | grep "│" | tail -8
}

prefill_graphs() {  # issue 11: small prefills replayed as CUDA graphs (engine.prefill_graph_tokens). Its GPU
    # tests, then the 1.7B rollout over every format with prefills of up to 512 tokens replayed (sixteenth
    # session, eager: a mixed step 18.5 ms BF16 / 33.8 ms KV4, nearly all host; KV4+partial 2.44x) (<10 min)
    timeout 240 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_prefill_graphs_gpu.py \
        "tests/gpu/test_bench_rollout_gpu.py::test_partial_rollout_admissions_replay_prefill_graphs" \
        > $OUT/prefill_graphs_tests.txt 2>&1; tail -4 $OUT/prefill_graphs_tests.txt
    OUT=$OUT ROLLOUT_ARGS="engine.prefill_graph_tokens=512" bash tools/rollout_bench.sh qwen3_1p7b_formats 2>&1 \
        | grep -E "│|Error" | tail -8
}

gemm_blas() {  # issue 11: the decode step's BF16 products under cuBLAS and cuBLASLt at the 1.7B and 8B shapes
    # (twelfth session: at 8B M = 128 cuBLAS runs `o` at 2.34 TB/s with split-K kernels plus a reduce)
    for shape in qwen3-1.7b qwen3-8b; do
        timeout 120 python tools/gemm_decode_shapes.py --shape $shape --rows 64,128,256 --blas cublas,cublaslt \
            --json $OUT/gemm_blas_${shape}.json 2>&1 | grep -E "all products|Error"
    done
}

profile_rollout() {  # issue 11: what a 1.7B partial-rollout engine step runs on the GPU beside the pure step of the
    # same rows (seventeenth session: KV4 4.91 vs 4.24 ms, step / same rows 1.19x; BF16 1.04x), KV4 then BF16
    for fmt in kv4 bf16; do
        timeout 200 python tools/profile_rollout_step.py --shape qwen3-1.7b --format $fmt engine.gpu_memory_fraction=0.6 \
            --json $OUT/profile_rollout_${fmt}.json 2>&1 | grep -v "^\[" | tail -24
    done
}

write_sampler() {  # issue 11: K and V written in one launch a layer (write_kv_pair) and the sampler's skipped
    # passes (seventeenth session's profile: KV4 write 0.295 ms, sampler 0.29 ms of a 4.2-4.6 ms 1.7B step).
    # GPU tests of both and of the shared graph capture first, then the two timing tools (~5 min)
    timeout 200 python -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py tests/test_sampler.py \
        tests/gpu/test_sampling_kernel_gpu.py tests/gpu/test_engine_fast_path_gpu.py tests/gpu/test_prefill_graphs_gpu.py \
        -k "write or sampl or fast_path or graph" > $OUT/write_sampler_tests.txt 2>&1; tail -4 $OUT/write_sampler_tests.txt
    timeout 60 python tools/kv_write_time.py --tokens 64,128,256,4096 --layouts 8x2,32x4,32x8,64x8 \
        --json $OUT/kv_write_time.json
    timeout 60 python tools/sampler_time.py --batches 64,128,256 --json $OUT/sampler_time.json
}

write_sampler_check() {  # issue 11: after write_sampler, the engine's K/V write as one launch (V a strided view of
    # q|k|v), the large-write layout, the 1.7B KV4 rollout step's profile and bench generate (~6 min)
    timeout 150 python -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py tests/gpu/test_engine_fast_path_gpu.py \
        -k "write or fast_path" > $OUT/write_check_tests.txt 2>&1; tail -3 $OUT/write_check_tests.txt
    timeout 60 python tools/kv_write_time.py --tokens 128,1024,2048,4096 --layouts 16x4,64x8 --json $OUT/kv_write_time.json
    timeout 100 python tools/profile_rollout_step.py --shape qwen3-1.7b --format kv4 engine.gpu_memory_fraction=0.6 \
        --json $OUT/profile_rollout_kv4.json 2>&1 | grep -v "^\[" | tail -24
    generate
}

screen_beside() {  # issue 11 (nineteenth session): the sampler's log-sum-exp from the Gumbel kernel's pass and its
    # float32 screen; KV4's INT8 item launched beside the INT4 body. Their GPU tests, the sampler against the
    # old path, decode attention with the item beside and after the body, the engine's fast-path tests (~6 min)
    timeout 120 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_sampling_kernel_gpu.py \
        tests/test_sampling_kernel.py tests/test_sampler.py > $OUT/sampler_tests.txt 2>&1; tail -3 $OUT/sampler_tests.txt
    timeout 150 python -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py -k "decode_attention_matches_reference \
        or kv4_sequences or cuda_int4_kernel_rotations or beside or cuda_fp8_kernel" > $OUT/attn_tests.txt 2>&1
    tail -3 $OUT/attn_tests.txt
    timeout 60 python tools/sampler_time.py --batches 64,128,256 --layouts 1024x8x4 --json $OUT/sampler_time.json
    timeout 60 python -m kv4rl.cli bench decode-attn --shapes qwen3-8b --batches 64 --contexts 8192 \
        --formats int4,kv4,kv4-serial --json $OUT/decode_attn_8b.json 2>&1 | grep "│" | tail -6
    timeout 60 python -m kv4rl.cli bench decode-attn --shapes qwen3-1.7b --batches 128,256 --contexts 1024 \
        --formats bf16,kv4,kv4-serial --json $OUT/decode_attn_1p7b.json 2>&1 | grep "│" | tail -10
    timeout 120 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine_fast_path_gpu.py \
        > $OUT/engine_tests.txt 2>&1; tail -3 $OUT/engine_tests.txt
}

step_profiles() {  # issue 11: the 1.7B KV4 rollout step's profile, bench generate 1.7B, and where a B256 generate
    # step's GPU time goes, BF16 and KV4 (~6 min)
    timeout 100 python tools/profile_rollout_step.py --shape qwen3-1.7b --format kv4 engine.gpu_memory_fraction=0.6 \
        --json $OUT/profile_rollout_kv4.json 2>&1 | grep -v "^\[" | tail -14
    generate
    timeout 150 python tools/profile_generate.py --shape qwen3-1.7b --batch 256 --prompt-len 128 --new-tokens 256 \
        --kv-formats bf16,kv4 --top 16 --json $OUT/profile_generate_b256.json 2>&1 | grep -v "^\[" | tail -50
}

host_api() {  # issue 11 (nineteenth session's lead): the host's time in CUDA API calls of the 1.7B rollout step, KV4
    # with the INT8 item beside the body and after it, and BF16 (~5 min): which call holds the 0.76 ms of host time
    # a KV4 partial step spends over BF16's (bench rollout, nineteenth session). Top-kernel lines left out here.
    for corner in kv4 kv4-after bf16; do
        extra=$([ $corner = kv4-after ] && echo --item-after-body)
        timeout 100 python tools/profile_rollout_step.py --shape qwen3-1.7b --format ${corner%-after} $extra \
            engine.gpu_memory_fraction=0.6 --json $OUT/host_api_$corner.json 2>&1 | grep -v "^\[" | grep -v "  \[[a-z]"
    done
}

fit_4b() {  # issue 12: Qwen3-4B shape, engine + learner + KV pool colocated on one H200, no offload; the
    # awake arm at 192 and 256 slots against the baseline (483 s on 2026-12-02, eleventh session: 1.88x and
    # 2.07x, no recompile in a timed step once micro-batches were filled evenly). Dynamo's recompile reasons
    # and timestamped progress in fit_4b_full.txt. The update reserve's GPU test is in the `learner` stage.
    TORCH_LOGS=recompiles timeout 580 python -m kv4rl.cli bench iteration --shape qwen3-4b \
        --arms ${FIT_4B_ARMS:-bf16+sync,kv4+partial+awake@192,kv4+partial+awake@256} \
        --quota-groups 16 --group-size 8 --median-len 1024 --max-len 8192 --max-tokens-per-micro-batch 16384 \
        --grad-checkpointing --iterations 1 --json $OUT/iteration_4b.json --png $OUT/iteration_4b.png 2>&1 \
        | while IFS= read -r line; do echo "$(date +%T) $line"; done \
        | tee $OUT/fit_4b_full.txt | grep -E "│|s per iteration|Error|reserved|iteration|Recompiling" | tail -30
}

fit_8b() {  # issue 12: Qwen3-8B shape with AdamW's moments in pinned CPU memory (trainer.offload_optimizer)
    # trainer.offload (FSDP2 CPUOffloadPolicy: 16 bytes/parameter on the host, 131 GB) was OOM-killed on the
    # 125 GiB host on 2026-12-02; this keeps 8 bytes/parameter there (64 GiB pinned) and 8 on the GPU. Its GPU
    # test first; host and GPU memory logged every 10 s to $OUT/fit_8b_memory.txt; progress lines timestamped
    timeout 90 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_offloaded_adamw_gpu.py \
        > $OUT/offloaded_adamw_tests.txt 2>&1; tail -3 $OUT/offloaded_adamw_tests.txt
    (while sleep 10; do echo "$(date +%T) host $(free -g | awk '/Mem/{print $3"/"$2}') GiB," \
        "gpu $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; done) > $OUT/fit_8b_memory.txt &
    local logger=$!
    timeout 480 python -m kv4rl.cli bench iteration --shape qwen3-8b --arms kv4+partial --offload-optimizer \
        --quota-groups 8 --group-size 8 --median-len 1024 --max-len 4096 --max-tokens-per-micro-batch 16384 \
        --grad-checkpointing --iterations 1 --json $OUT/iteration_8b_offload.json 2>&1 \
        | while IFS= read -r line; do echo "$(date +%T) $line"; done \
        | grep -E "│|s per iteration|Error|memory|iteration|random-init|building" | tail -24
    kill $logger; tail -3 $OUT/fit_8b_memory.txt
    dmesg 2>/dev/null | grep -iE "out of memory|oom-kill" | tail -2
}

if pgrep -f '^nvidia-cuda-mps-control' >/dev/null; then  # only the testbed's many processes need it
    echo "warning: the CUDA MPS daemon is running; single-process timings may be slower (echo quit | nvidia-cuda-mps-control)"
fi
fp8_decode_gemm() {  # issue 11 (twenty-first session): the Triton e4m3 GEMM at decode sizes (engine.fp8_gemm) - its
    # GPU tests, the timed grid of tile settings (compiled first in 14 processes) that pick_config was fitted to,
    # and the whole 8B step with it and with scaled_mm
    timeout 200 python -m pytest -q -p no:cacheprovider -rf tests/test_fp8_weight_gemm.py tests/gpu/test_fp8_linear_gpu.py \
        tests/gpu/test_fp8_quant_kernel_gpu.py tests/test_engine_plan.py > $OUT/fp8_gemm_tests.txt 2>&1 &
    for i in $(seq 0 13); do
        timeout 150 python tools/gemm_decode_shapes.py --shape qwen3-8b --rows 64,128,256 --table --warm-only $i/14 > $OUT/warm_$i.txt 2>&1 &
    done; wait; cat $OUT/warm_*.txt | sort | uniq -c | head -3; rm -f $OUT/warm_*.txt; tail -4 $OUT/fp8_gemm_tests.txt
    for shape in qwen3-8b qwen3-1.7b; do
        timeout 150 python tools/gemm_decode_shapes.py --shape $shape --rows 64,128,256 --fp8 --table \
            --json $OUT/gemm_table_$shape.json 2>&1 | grep -v skipped | tail -16
    done
    for g in auto scaled_mm; do
        timeout 170 python -m kv4rl.cli bench decode-forward --shapes qwen3-8b --workloads early,mid,late,short --fp8-gemm $g \
            --json $OUT/decode_forward_8b_$g.json 2>&1 | grep "│" | tail -16
    done
}

fp8_inputs() {  # issue 11 (twenty-second session): the norms and SwiGLU quantize the FP8 linears' inputs - GPU
    # tests (codes bit for bit, decoder hidden states equal with and without), then the whole 8B step both ways
    timeout 240 python -m pytest -q -p no:cacheprovider -rf tests/test_fp8_fused_inputs.py tests/test_fused_ops.py \
        tests/test_fp8_quant_kernel.py tests/gpu/test_fp8_quant_kernel_gpu.py tests/gpu/test_fp8_linear_gpu.py \
        tests/gpu/test_fused_ops_gpu.py > $OUT/fp8_inputs_tests.txt 2>&1; tail -6 $OUT/fp8_inputs_tests.txt
    for inputs in --fp8-inputs --no-fp8-inputs; do
        timeout 170 python -m kv4rl.cli bench decode-forward --shapes qwen3-8b --workloads early,mid,late,short $inputs \
            --json $OUT/decode_forward_8b$inputs.json 2>&1 | grep "│" | tail -16
    done
}

fp8_tma() {  # issue 11 (twenty-second session): the e4m3 GEMM's TMA-fed tiles - GPU tests, the timed TMA grid
    # (compiled first in 14 processes) beside pick_config, the 8B products with pick_config against cuBLAS and
    # scaled_mm, and what FP8 weights buy in `bench generate` on the 8B shape
    timeout 200 python -m pytest -q -p no:cacheprovider -rf tests/test_fp8_weight_gemm.py tests/gpu/test_fp8_linear_gpu.py \
        tests/test_fp8_fused_inputs.py > $OUT/fp8_tma_tests.txt 2>&1 &
    for i in $(seq 0 13); do
        timeout 150 python tools/gemm_decode_shapes.py --shape qwen3-8b --rows 64,128 --table --tma --warm-only $i/14 > $OUT/warm_$i.txt 2>&1 &
    done; wait; rm -f $OUT/warm_*.txt; tail -4 $OUT/fp8_tma_tests.txt
    for shape in qwen3-8b qwen3-1.7b; do
        timeout 150 python tools/gemm_decode_shapes.py --shape $shape --rows 64,128 --fp8 --table --tma \
            --json $OUT/gemm_tma_$shape.json 2>&1 | grep -v skipped | tail -14
    done
    timeout 90 python tools/gemm_decode_shapes.py --shape qwen3-8b --rows 16,64,128 --fp8 --json $OUT/gemm_pick_8b.json 2>&1 | grep "M=" | tail -3
    timeout 200 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 16,64,128 --prompt-len 128 --new-tokens 256 \
        --kv-format bf16,kv4 --weight-format auto,fp8 --no-hf --json $OUT/generate_8b_fp8.json 2>&1 | grep "│" | tail -12
}

short_profiles() {  # issue 11 (twenty-second session's leads): where an 8B generate step at 128 + 256 tokens
    # spends its time - with FP8 weights it is at 46-53% of its byte roofline (59-69% with BF16 weights), and KV4 was
    # 0.96x BF16 at B16 there; B16 and B64, each weight format x KV format
    for batch in 16 64; do
        timeout 140 python tools/profile_generate.py --shape qwen3-8b --batch $batch --prompt-len 128 --new-tokens 256 \
            --kv-formats bf16,kv4 --weight-formats auto,fp8 --top 12 --json $OUT/profile_generate_8b_b$batch.json 2>&1 \
            | grep -v "^\[" | tail -64
    done
}

kv4_short() {  # issue 11: KV4 was 0.96x BF16 at 8B B16, 128 + 256 tokens (twenty-third session), its KV write
    # 4.7 us a layer against BF16's 1.4: the write's GPU tests, its parts, and the generate point (~3 min)
    timeout 60 python -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py -k write > $OUT/kv4_short_tests.txt 2>&1
    tail -2 $OUT/kv4_short_tests.txt
    timeout 60 python tools/kv_write_time.py --tokens 16,64,128,256 --parts --json $OUT/kv_write_parts.json
    timeout 130 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 16,64 --prompt-len 128 --new-tokens 256 \
        --kv-format bf16,kv4 --no-hf --json $OUT/generate_8b_short.json 2>&1 | grep "│" | tail -6
}

kv4_item() {  # issue 11 (twenty-fourth session): KV4's INT8 item with up to four warps per KV head (choose_subs) against
    # one, its GPU tests, decode-attn at short and long contexts both ways, then the generate points that it changes
    timeout 120 python -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py \
        -k "cut_into_runs or cuda_int4 or beside or kv4 or more_warps" > $OUT/kv4_item_tests.txt 2>&1
    tail -2 $OUT/kv4_item_tests.txt
    for subs in 0 1; do  # 0: choose_subs (the default), 1: one warp a head (before)
        timeout 70 python -c "import sys; import kv4rl.kernels.fp8_decode_cuda as f; \
f.SIDE_CONFIG = {**f.SIDE_CONFIG, 'subs': $subs}; from kv4rl.cli import main; sys.argv = ['kv4rl'] + sys.argv[1:]; main()" \
            bench decode-attn --shapes qwen3-8b --batches 16,64 --contexts 256,4096,16384 --formats bf16,kv4 \
            --json $OUT/decode_attn_subs$subs.json 2>&1 | grep "│" | grep -v "bf16 " | tail -6 | sed "s/^/subs$subs /"
    done
    timeout 100 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 16,64 --prompt-len 128 --new-tokens 256 \
        --kv-format bf16,kv4 --no-hf --json $OUT/generate_8b_short.json 2>&1 | grep "│" | tail -4
    timeout 100 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,kv4 --no-hf \
        --json $OUT/generate_1p7b.json 2>&1 | grep "│" | tail -4
}

prefill_long() {  # issue 11 (twenty-fifth session): the prefill kernel's launch settings per format and step length
    # (LONG_PREFILL_LAUNCH from 1,024 tokens), its GPU tests, then a long-prompt generate where KV4's prefill shows
    timeout 120 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_prefill_kernel_gpu.py \
        tests/gpu/test_prefill_engine_gpu.py > $OUT/prefill_tests.txt 2>&1; tail -2 $OUT/prefill_tests.txt
    timeout 240 python tools/prefill_launch_sweep.py --formats kv4,int4 --q-heads 32,16 --json $OUT/prefill_sweep.json
    timeout 90 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 16 --prompt-len 4096 --new-tokens 512 \
        --kv-format bf16,kv4 --no-hf --json $OUT/generate_8b_b16_long.json 2>&1 | grep "│" | tail -2
}

prefill_short() {  # issue 11 (twenty-sixth session): a short prompt's KV4 prefill (every key in the INT8 window)
    # against BF16's, kernel by kernel; the prefill GPU tests; the engine's settings per case; 8B short generate
    timeout 120 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_prefill_kernel_gpu.py \
        tests/gpu/test_prefill_engine_gpu.py > $OUT/prefill_tests.txt 2>&1; tail -2 $OUT/prefill_tests.txt
    timeout 60 python tools/profile_prefill.py --formats kv4,bf16 --q-heads 32 --cases 256:0:128,8:0:2048 \
        --json $OUT/prefill_profile.json
    timeout 100 python tools/prefill_launch_sweep.py --formats kv4,bf16 --q-heads 32,16 --grid engine --top 2 \
        --cases 256:0:128,64:0:256,64:1024:256,8:0:2048 --json $OUT/prefill_engine_settings.json
    timeout 120 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 16,64 --prompt-len 128 --new-tokens 256 \
        --kv-format bf16,kv4 --no-hf --json $OUT/generate_8b_short.json 2>&1 | grep "│" | tail -6
}

prefill_whole() {  # issue 11 (twenty-seventh session): KV4 prefill in one whole layout with one-source INT8 passes -
    # the prefill and engine GPU tests, the layer by kernel, the launch candidates, 8B short and 1.7B generate
    timeout 240 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_prefill_kernel_gpu.py \
        tests/gpu/test_prefill_engine_gpu.py tests/gpu/test_prefill_graphs_gpu.py tests/gpu/test_engine_fast_path_gpu.py \
        > $OUT/prefill_whole_tests.txt 2>&1; tail -2 $OUT/prefill_whole_tests.txt
    timeout 60 python tools/profile_prefill.py --formats kv4,bf16 --q-heads 32 --cases 256:0:128,8:0:2048 \
        --json $OUT/prefill_profile.json
    timeout 90 python tools/prefill_launch_sweep.py --formats kv4 --q-heads 32,16 --grid candidates --top 3 \
        --cases 256:0:128,64:0:256,64:1024:256,8:0:2048 --json $OUT/prefill_candidates.json
    timeout 120 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 16,64 --prompt-len 128 --new-tokens 256 \
        --kv-format bf16,kv4 --no-hf --json $OUT/generate_8b_short.json 2>&1 | grep "│" | tail -6
    timeout 100 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,kv4 --no-hf \
        --json $OUT/generate_1p7b.json 2>&1 | grep "│" | tail -6
}
kv4_tiles() {  # issue 11 (twenty-seventh session): KV4's prefill at 128 x 32 tiles at every length - the prefill
    # GPU tests, the candidates at 1.7B heads (8B's in prefill_whole), generate at both shapes, 8B B128 full
    timeout 200 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_prefill_kernel_gpu.py \
        tests/gpu/test_prefill_engine_gpu.py tests/gpu/test_prefill_graphs_gpu.py > $OUT/kv4_tiles_tests.txt 2>&1
    tail -2 $OUT/kv4_tiles_tests.txt
    timeout 100 python tools/prefill_launch_sweep.py --formats kv4 --q-heads 16 --grid candidates --top 3 \
        --cases 256:0:128,64:0:256,64:1024:256,8:0:2048 --json $OUT/prefill_candidates_1p7b.json
    timeout 100 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,kv4 --no-hf \
        --json $OUT/generate_1p7b.json 2>&1 | grep "│" | tail -6
    timeout 120 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 16,64 --prompt-len 128 --new-tokens 256 \
        --kv-format bf16,kv4 --no-hf --json $OUT/generate_8b_short.json 2>&1 | grep "│" | tail -6
    timeout 170 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 128 --prompt-len 512 --new-tokens 1024 \
        --kv-format bf16,kv4 --no-hf --json $OUT/generate_8b_b128_full.json 2>&1 | grep "│" | tail -3
}
_variants() {  # $1: the source file that candidates replace, $2: their folder, $3: the function run for each
    # (given its name; "main" first). The device gets the working tree, not .git: put each candidate in the
    # folder before the call, e.g. `git show wip/NAME:src/kv4rl/kernels/prefill_triton.py > tools/_variants/NAME.py`
    local target=$1 dir=$2 each=$3
    cp $target /tmp/variant_main.py
    for f in /tmp/variant_main.py $dir/*.py; do
        [ -e "$f" ] || continue  # no candidates: main's alone
        local name=$(basename $f .py)
        name=${name#variant_}
        cp $f $target
        echo "=== $name"
        $each $name
    done
    cp /tmp/variant_main.py $target
}

tree_variants() {  # A/B of candidates that change several files: each folder tools/_trees/NAME/ holds its
    # changed files at their repository paths (`bash tools/lay_trees.sh wip/X wip/Y` writes them from branches
    # rebased on main); main runs first, then each candidate laid over it, then main's files are put back.
    # $1: the function run for each (given its name)
    local each=$1 backup=/tmp/tree_main
    rm -rf $backup; mkdir -p $backup
    local files=$(cd tools/_trees && find . -mindepth 2 -type f | cut -d/ -f3- | sort -u)
    for f in $files; do mkdir -p $backup/$(dirname $f); cp $f $backup/$f; done  # candidates only change files
    echo "=== main"; $each main
    for dir in tools/_trees/*/; do
        local name=$(basename $dir)
        cp -r $dir. .
        echo "=== $name"; $each $name
        for f in $files; do cp $backup/$f $f; done
    done
}
prefill_trees() {  # prefill candidates that change more than the kernel file (tools/_trees/, see tree_variants)
    tree_variants _prefill_tree
}
_prefill_tree() {
    timeout 100 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_prefill_kernel_gpu.py 2>&1 | tail -1
    timeout 60 python tools/profile_prefill.py --formats kv4 --q-heads 32 --cases 256:0:128,8:0:2048 \
        --json $OUT/prefill_tree_profile_$1.json 2>&1 | grep -v -e Warn -e _warn_once
    timeout 90 python tools/prefill_launch_sweep.py --formats kv4 --q-heads 32 --grid engine --top 1 \
        --cases 256:0:128,64:0:256,64:1024:256,8:0:2048 --json $OUT/prefill_tree_$1.json
}
rope_rotation() {  # issue 11: KV4's key rotation in the fused RoPE kernel. Its launch settings, the KV4 write
    # without a rotation by layout at prefill sizes, then generate (8B short B16/B64, 1.7B B256) with the
    # working tree ("main" below) and each tree of tools/_trees/ (e.g. the files before the change)
    timeout 90 python tools/rope_time.py --tokens 16,64,256,4096,32768 --q-heads 32 \
        --settings 1x4,2x4,4x4,8x4,16x4,1x8,4x8,8x8 --json $OUT/rope_time.json
    timeout 90 python tools/kv_write_time.py --tokens 4096,32768 --rotate none \
        --layouts 16x8,32x8,64x4,64x8,128x4,128x8,256x8 --json $OUT/kv_write_prefill.json
    tree_variants _rope_generate
}
_rope_generate() {
    local formats=kv4; [ $1 = main ] && formats=bf16,kv4
    timeout 150 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 16,64 --prompt-len 128 --new-tokens 256 \
        --kv-format $formats --no-hf --json $OUT/rope_generate_8b_$1.json 2>&1 | grep "│"
    timeout 100 python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 256 --kv-format kv4 --no-hf \
        --json $OUT/rope_generate_1p7b_$1.json 2>&1 | grep "│"
}
write_small() {  # issue 11 (thirty-first session's lead): a decode-sized KV write that rotates nothing (keys rotated by the
    # fused RoPE) in programs of 1-16 rows: the small-program test, then the layouts at 16-256 tokens (the default is
    # 16 rows x 8 warps, chosen when the write still rotated and its dot needed 16 rows); ~1 min
    timeout 90 python -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py -k "small_programs or pair_write or fused_write" \
        2>&1 | tail -2
    timeout 90 python tools/kv_write_time.py --tokens 16,64,256 --rotate none \
        --layouts 1x1,2x1,4x1,4x2,8x1,8x2,8x4,16x4,16x8 --json $OUT/write_small.json
}

rope_trees() {  # issue 11: RoPE-kernel candidates in tools/_trees/NAME/ (wip/rope-row-blocks, wip/rope-write-fused)
    # against main's: each one's fused-op GPU tests, its RoPE settings, the short prefill layer with RoPE counted,
    # generate 8B short B16/B64 (BF16 with main's files only)
    tree_variants _rope_tree
}
_rope_tree() {
    timeout 90 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_fused_ops_gpu.py 2>&1 | tail -1
    timeout 60 python tools/rope_time.py --tokens 16,256,4096,32768 --q-heads 32 --json $OUT/rope_tree_$1.json
    timeout 40 python tools/profile_prefill.py --formats kv4 --q-heads 32 --cases 256:0:128 --rope in-rope --top 4 \
        --json $OUT/rope_tree_profile_$1.json 2>&1 | grep -v -e Warn -e _warn_once
    local formats=kv4; [ $1 = main ] && formats=bf16,kv4
    timeout 150 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 16,64 --prompt-len 128 --new-tokens 256 \
        --kv-format $formats --no-hf --json $OUT/rope_tree_generate_$1.json 2>&1 | grep "│"
}
prefill_trees_short() {  # prefill_trees at a short prompt only, plus 8B B64 short generate (KV4)
    tree_variants _prefill_tree_short
}
_prefill_tree_short() {
    timeout 60 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_prefill_kernel_gpu.py 2>&1 | tail -1
    timeout 40 python tools/profile_prefill.py --formats kv4 --q-heads 32 --cases 256:0:128 \
        --json $OUT/prefill_tree_profile_$1.json 2>&1 | grep -v -e Warn -e _warn_once
    timeout 60 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 64 --prompt-len 128 --new-tokens 256 \
        --kv-format kv4 --no-hf --json $OUT/prefill_tree_generate_$1.json 2>&1 | grep "│" | tail -1
}
_prefill_variant() {
    timeout 100 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_prefill_kernel_gpu.py 2>&1 | tail -1
    timeout 90 python tools/prefill_launch_sweep.py --formats kv4 --q-heads 32 --grid engine --top 2 \
        --cases 256:0:128,64:0:256,64:1024:256,8:0:2048 --json $OUT/prefill_variant_$1.json
}

prefill_variants() {  # A/B of prefill kernel sources in tools/_variants/ against main's, in one call: the kernel's
    # GPU test, then the engine's settings at short and long KV4 prompts
    _variants src/kv4rl/kernels/prefill_triton.py tools/_variants _prefill_variant
}

_write_variant() {
    timeout 60 python -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py -k write 2>&1 | tail -1
    timeout 60 python tools/kv_write_time.py --tokens 16,64,128 --parts --json $OUT/write_variant_$1.json
    local formats=kv4; [ $1 = main ] && formats=bf16,kv4
    timeout 120 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 16 --prompt-len 128 --new-tokens 256 \
        --kv-format $formats --no-hf --json $OUT/write_variant_generate_$1.json 2>&1 | grep "│" | tail -2
}

write_variants() {  # A/B of KV write sources in tools/_write_variants/ against main's: the write's GPU tests, its
    # parts at decode sizes, and 8B B16 short, where KV4's write is the gap to BF16 (BF16 with main's only)
    _variants src/kv4rl/kernels/kv_write.py tools/_write_variants _write_variant
}

targets_8b() {  # issue 11's 8B targets as the issue states them, BF16 and KV4 in one process each: B128 512+1024 at
    # full memory (KV4 >= 1.4x), B256 512+2048 with the pool in 45% of the GPU (BF16 holds 128 sequences, KV4
    # all 256: >= 2.2x), the whole decode step at B64 x 8,192 (>= 2.2x). Last run in the twenty-second session
    timeout 170 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 128 --prompt-len 512 --new-tokens 1024 \
        --kv-format bf16,kv4 --no-hf --json $OUT/generate_8b_b128_full.json 2>&1 | grep "│" | tail -3
    timeout 240 python -m kv4rl.cli bench generate --shape qwen3-8b --batch-sizes 256 --prompt-len 512 --new-tokens 2048 \
        --kv-format bf16,kv4 --no-hf engine.gpu_memory_fraction=0.45 --json $OUT/generate_8b_memlimit.json 2>&1 \
        | grep "│" | tail -3
    timeout 130 python -m kv4rl.cli bench decode-forward --shapes qwen3-8b --json $OUT/decode_forward_8b.json 2>&1 \
        | grep "│" | tail -14
}

rl_options() {  # the learner's newer options on CUDA (bf16 learner, INT4 KV so that μ differs from π): their GPU
    # test, then verl's rejection in bypass and decoupled mode, with a sequence IS weight, prime-rl's dppo and ipo
    # surrogates, verl's batch-normalised IS weights; 3 iterations each of the embedded task, metrics printed (~2 min)
    timeout 120 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_ppo_options_gpu.py > $OUT/rl_options_tests.txt 2>&1
    tail -2 $OUT/rl_options_tests.txt
    local i=0 args
    for args in "algo.behavior_rs=token_k1,seq_max_k3 algo.behavior_rs_threshold=1.5,0.5" \
                "algo.behavior_rs=token_k1 algo.behavior_rs_threshold=1.5 algo.old_logprob=recompute algo.behavior_is=sequence_truncate" \
                "algo.surrogate=dppo" "algo.surrogate=ipo" \
                "algo.old_logprob=recompute algo.behavior_is=token_truncate algo.behavior_is_normalize=true"; do
        i=$((i + 1))
        timeout 150 python -m kv4rl.cli train $args engine.kv.format=int4 engine.kv.group_size=32 device=cuda \
            trainer.iterations=3 out_dir=$OUT/runs name=rl_options$i --no-progress > $OUT/rl_options$i.txt 2>&1
        echo "rl_options$i rc=$? ($args)"
        python -c "import json, sys
keys = ('iteration', 'loss', 'grad_norm', 'num_tokens', 'mismatch_k3', 'behavior_rs_frac', 'behavior_rs_seq_frac',
        'behavior_is_mean', 'dppo_masked_frac', 'ipo_masked_frac', 'behavior_is_norm_factor', 'accuracy')
for line in open(sys.argv[1]):
    row = json.loads(line)
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k in keys})" \
            $OUT/runs/rl_options$i/metrics.jsonl
    done
}

kv4_item_write() {  # issue 11 (fifty-fourth session): KV4's CUDA INT8 item stores a decode step's new K/V itself
    # (DecodeKernels.write_in_item), so no write kernel runs before the attention: its GPU test against the Triton
    # write, every kernel test (the write's FP8/INT8 scales now torch's CUDA product), the engine on CUDA
    timeout 200 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kv4_item_write_gpu.py tests/test_kernels.py \
        > $OUT/kv4_item_write_tests.txt 2>&1
    tail -6 $OUT/kv4_item_write_tests.txt
    timeout 250 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_engine_fast_path_gpu.py \
        tests/gpu/test_engine_no_host_wait_gpu.py > $OUT/kv4_item_write_engine.txt 2>&1
    tail -4 $OUT/kv4_item_write_engine.txt
}

kv4_item_write_ab() {  # the generate point the write moves (8B, 128 + 256 tokens, B16 and B64), with the item writing (1)
    # and the Triton write (0), alternated twice, each run BF16 and KV4 in one process
    for round in 1 2; do
        for arm in 1 0; do
            timeout 140 python -c "import sys; import kv4rl.kernels.decode_attention as d; d.WRITE_IN_ITEM = bool($arm); \
from kv4rl.cli import main; sys.argv = ['kv4rl'] + sys.argv[1:]; main()" \
                bench generate --shape qwen3-8b --batch-sizes 16,64 --prompt-len 128 --new-tokens 256 --kv-format bf16,kv4 \
                --no-hf --json $OUT/generate_8b_short_item$arm-round$round.json 2>&1 | grep "│" | tail -4 \
                | sed "s/^/item$arm round$round /"
        done
    done
}

shapes() {  # the decode and prefill kernels at 64- and 256-dim heads (SmolLM2, Llama-3.2-1B, Qwen2.5-0.5B shapes)
    timeout 300 python -m pytest -q -p no:cacheprovider -rf tests/gpu/test_kernel_shapes_gpu.py \
        > $OUT/gpu_tests_shapes.txt 2>&1; tail -8 $OUT/gpu_tests_shapes.txt
}

date
for stage in "${@:-tests attn generate forward}"; do
    $stage
done

date
