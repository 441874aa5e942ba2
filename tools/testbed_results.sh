#!/usr/bin/env bash
# The research results on the long-multiplication testbed (docs/testbed.md, "Results"): several arms x
# seeds trained side by side on one GPU until a deadline, then their curves, the KV fidelity of each
# format, the mismatch attribution and the time composition, all under $OUT (default runs/results).
#
#   tools/testbed_results.sh SET [DEADLINE_S]
#     SET fidelity     rollouts with bf16, kv4 (16+128) and naive int4 KV caches (paper B's claim)
#         staleness16  every batch 16 versions old: PPO-clip vs future-KL (paper A's claim)
#         staleness4   every batch 4 versions old at a 5x learning rate: PPO-clip vs future-KL
#         attribution  one run with FP8 weights + kv4 + staleness 4, mismatch attribution every 2 iterations
#         behavior_is  int4 KV, 4 versions old, 5x learning rate: PPO-clip with pi_old = mu (behavior), recomputed,
#                      and recomputed with TIS weights (algo.behavior_is=token_truncate, at most 2)
#         stabilizers  the same conditions, PPO-clip with pi_old = mu (the behavior arm, the control) against
#                      verl's rejection in bypass mode (token_k1 at 2), prime-rl's DPPO and its IPO (run it alone:
#                      it shares the control arm with behavior_is)
#         int4_stabilizers  the stabilizers at the default learning rate and no staleness, naive INT4 KV alone (where
#                      PPO-clip stopped learning in the fidelity set)
#     several sets at once: "fidelity+staleness16+attribution"
#   DEADLINE_S: seconds after which every run is asked to stop (SIGTERM: it ends its iteration and
#     writes a checkpoint); curves are compared at the last iteration every run of a figure reached.
#
# Environment: SEEDS (default 0,1,2), SIZE (gpu; `test` runs the CPU test size, a check of the wiring
# that takes minutes on 2 cores, e.g. SIZE=test SEEDS=0 ITERATIONS=3), ITERATIONS (cap per run, default
# 200), MEM (GPU memory fraction per run, default 0.035; the learner's peak comes on top: warned above 50% in
# all), KILL_AFTER (seconds a run may take to stop
# after the deadline before it is killed, default 120), ONLY (comma-separated arm names: run just
# these arms of the sets), EXTRA (overrides for every run, e.g. "engine.num_kv_blocks=17000"),
# KV4RL_CACHE (where the testbed is built). Start the CUDA MPS daemon first (`nvidia-cuda-mps-control -d`):
# without it the runs time-slice the GPU and each decode step takes ~10x longer. Compare arms of one build
# only (runs record model_sha256): chained calls on one machine reuse $KV4RL_CACHE.
set -uo pipefail
sets=${1:?usage: tools/testbed_results.sh SET[+SET...] [DEADLINE_S]}
deadline=${2:-400}
seeds=${SEEDS:-0,1,2}
size=${SIZE:-gpu}
out=${OUT:-runs/results}
iterations=${ITERATIONS:-200}
mem=${MEM:-0.035}
kill_after=${KILL_AFTER:-120}
runs=$out/runs
kv4rl() { python -m kv4rl.cli "$@"; }
nseeds=$(echo "$seeds" | tr ',' '\n' | wc -l)

common=(--config "recipes/testbed_longmul_$size.yaml" "out_dir=$runs" eval.every=0 checkpoint.save_every=100000
        "trainer.iterations=$iterations")
if [ "$size" = test ]; then
    common+=(device=cpu engine.kv.group_size=32)
else
    common+=(trainer.micro_batch_size=16)
fi
lr=$(python -c "import yaml; print(yaml.safe_load(open('recipes/testbed_longmul_$size.yaml'))['trainer'].get('lr', 1e-4))")
high_lr=$(python -c "print(5 * $lr)")
ppo=(algo.loss=ppo_clip algo.eps_low=0.2 algo.eps_high=0.2 algo.old_logprob=behavior)
fkl=(algo.loss=future_kl algo.horizon=full algo.beta=0.3 algo.is_mode=token)

arms=()      # "name|overrides" lines
case_arms() {
    case $1 in
        fidelity) arms+=("kv-bf16|engine.kv.format=bf16" "kv-kv4|engine.kv.format=kv4" "kv-int4|engine.kv.format=int4") ;;
        staleness16) arms+=("stale16-ppo-clip|staleness.lag=16 ${ppo[*]}" "stale16-future-kl|staleness.lag=16 ${fkl[*]}") ;;
        staleness4) arms+=("stale4-lr5x-ppo-clip|staleness.lag=4 trainer.lr=$high_lr ${ppo[*]}"
                           "stale4-lr5x-future-kl|staleness.lag=4 trainer.lr=$high_lr ${fkl[*]}") ;;
        attribution) ;;
        behavior_is) arms+=("stale4-int4-behavior|staleness.lag=4 engine.kv.format=int4 trainer.lr=$high_lr ${ppo[*]}"
                            "stale4-int4-recompute|staleness.lag=4 engine.kv.format=int4 trainer.lr=$high_lr ${ppo[*]} algo.old_logprob=recompute"
                            "stale4-int4-recompute-tis|staleness.lag=4 engine.kv.format=int4 trainer.lr=$high_lr ${ppo[*]} algo.old_logprob=recompute algo.behavior_is=token_truncate algo.behavior_is_max=2") ;;
        stabilizers) local hard="staleness.lag=4 engine.kv.format=int4 trainer.lr=$high_lr ${ppo[*]}"
                     arms+=("stale4-int4-behavior|$hard" "stale4-int4-rs|$hard algo.behavior_rs=token_k1 algo.behavior_rs_threshold=2"
                            "stale4-int4-dppo|$hard algo.surrogate=dppo" "stale4-int4-ipo|$hard algo.surrogate=ipo") ;;
        int4_stabilizers) local int4="engine.kv.format=int4 ${ppo[*]}"
                     arms+=("int4-behavior|$int4" "int4-rs|$int4 algo.behavior_rs=token_k1 algo.behavior_rs_threshold=2"
                            "int4-dppo|$int4 algo.surrogate=dppo" "int4-ipo|$int4 algo.surrogate=ipo") ;;
        *) echo "unknown set '$1' (fidelity, staleness16, staleness4, attribution, behavior_is, stabilizers," \
                "int4_stabilizers)" >&2; exit 2 ;;
    esac
}
IFS=+ read -ra set_list <<<"$sets"
for s in "${set_list[@]}"; do case_arms "$s"; done
if [ -n "${ONLY:-}" ]; then  # ONLY=arm,arm: run just these arms of the sets (figures still take every arm's folders)
    kept=(); for arm in "${arms[@]}"; do [[ ",$ONLY," == *",${arm%%|*},"* ]] && kept+=("$arm"); done; arms=("${kept[@]}")
fi
read -ra extra_all <<<"${EXTRA:-}"  # EXTRA="key=value ...": overrides for every run
common+=("${extra_all[@]}")
[ "$size" = test ] && [ "$(nproc)" -lt 8 ] && parallel=(--parallel 1) || parallel=()

total_runs=$(( ${#arms[@]} * nseeds )); [[ "+$sets+" == *+attribution+* ]] && total_runs=$(( total_runs + 1 ))
python - "$mem" "$total_runs" <<'PY'
import sys
mem, runs = float(sys.argv[1]), int(sys.argv[2])
if mem * runs > 0.5:  # 12 runs at 0.05 (0.6) filled an H200: one ran out of memory at iteration 16
    print(f"warning: {runs} runs x MEM={mem:g} = {mem * runs:.0%} of the GPU for the engines alone; each run's "
          f"learner peak (~4.5 GiB at the GPU size) comes on top; MEM <= {0.5 / runs:.3f} leaves room", file=sys.stderr)
PY
# the daemon's own command line starts with its name (a plain `pgrep -f` would also match this shell's)
if [ "$size" != test ] && [ "$total_runs" -gt 1 ] && ! pgrep -f '^nvidia-cuda-mps-control' >/dev/null; then
    echo "warning: no CUDA MPS daemon: $total_runs runs will time-slice the GPU (~10x slower decode steps);" \
         "start it with 'nvidia-cuda-mps-control -d'" >&2
fi
mkdir -p "$runs"
start=$(date +%s)
kv4rl build-model --task longmul --size "$size" --json "$out/testbed_build.json" || exit 1
echo "build-model: $(( $(date +%s) - start )) s"
model=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['path'])" "$out/testbed_build.json")
left=$(( deadline - ($(date +%s) - start) ))
[ "$left" -gt 30 ] || { echo "no time left for training after the build ($left s)"; exit 1; }

pids=()
for arm in "${arms[@]}"; do
    name=${arm%%|*}; read -ra extra <<<"${arm#*|}"
    share=$(python -c "print(round($mem * $nseeds, 4))")
    timeout --foreground -s TERM -k "$kill_after" "$left" python -m kv4rl.cli train "${common[@]}" "name=$name" "${extra[@]}" \
        "engine.gpu_memory_fraction=$share" --seeds "$seeds" "${parallel[@]}" --overwrite >"$out/$name.out" 2>&1 &
    pids+=($!)
done
if [[ "+$sets+" == *+attribution+* ]]; then
    timeout --foreground -s TERM -k "$kill_after" "$left" python -m kv4rl.cli train "${common[@]}" name=attribution-fp8-kv4-stale4 \
        engine.weight_format=fp8 engine.kv.format=kv4 staleness.lag=4 "${fkl[@]}" telemetry.attribution_every=2 \
        telemetry.attribution_samples=8 "engine.gpu_memory_fraction=$mem" engine.gpu_memory_scope=process --no-progress --overwrite \
        >"$out/attribution.out" 2>&1 &
    pids+=($!)
fi
if [[ "+$sets+" == *+fidelity+* ]] && [ -z "${ONLY:-}" ]; then  # the fidelity KL of each format on the testbed's own responses
    fid_tokens=1536; [ "$size" = test ] && fid_tokens=100
    fid_alloc=16+128; [ "$size" = test ] && fid_alloc=3+23
    python -m kv4rl.cli bench fidelity --model "$model" --formats bf16,kv4,int4 --allocations "$fid_alloc" \
        --stop-at-eos --n 64 --max-new-tokens "$fid_tokens" --json "$out/fidelity.json" >"$out/fidelity.out" 2>&1 &
    pids+=($!)
fi
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
echo "training: $(( $(date +%s) - start )) s since the start (exit status of any failure: $status)"

figure() {  # figure NAME ARM... : curves of these arms compared at their last common iteration
    local name=$1; shift
    local globs=(); for a in "$@"; do globs+=("$runs/$a-s*"); done
    kv4rl plot curves "${globs[@]}" --metric accuracy --ema 0.9 --until common --out "$out/$name.png" \
        --json "$out/$name.json" || status=1
}
[[ "+$sets+" == *+fidelity+* ]] && figure curves_kv_formats kv-bf16 kv-kv4 kv-int4
[[ "+$sets+" == *+staleness16+* ]] && figure curves_staleness16 stale16-ppo-clip stale16-future-kl
[[ "+$sets+" == *+staleness4+* ]] && figure curves_staleness4_lr5x stale4-lr5x-ppo-clip stale4-lr5x-future-kl
[[ "+$sets+" == *+behavior_is+* ]] && figure curves_behavior_is stale4-int4-behavior stale4-int4-recompute stale4-int4-recompute-tis
[[ "+$sets+" == *+stabilizers+* ]] && figure curves_stabilizers stale4-int4-behavior stale4-int4-rs stale4-int4-dppo stale4-int4-ipo
[[ "+$sets+" == *+int4_stabilizers+* ]] && figure curves_int4_stabilizers int4-behavior int4-rs int4-dppo int4-ipo
if [[ "+$sets+" == *+attribution+* ]]; then
    kv4rl plot mismatch "$runs/attribution-fp8-kv4-stale4" --out "$out/mismatch.png" || status=1
fi
timed=(); for r in kv-bf16-s0 kv-kv4-s0 attribution-fp8-kv4-stale4; do [ -f "$runs/$r/metrics.jsonl" ] && timed+=("$runs/$r"); done
[ ${#timed[@]} -gt 0 ] && { kv4rl plot iteration-time "${timed[@]}" --skip 2 --out "$out/iteration_time.png" || status=1; }
[ -f "$out/fidelity.out" ] && tail -8 "$out/fidelity.out"
# everything small enough to keep: metrics, configs, logs, figures (no checkpoints)
tar -czf /tmp/testbed_results.tgz --exclude='checkpoints' --exclude='*.safetensors' --exclude='rollout_trace.jsonl' \
    -C "$out" . && mv /tmp/testbed_results.tgz "$out/"
echo "total: $(( $(date +%s) - start )) s"
exit $status
