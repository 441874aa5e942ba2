#!/usr/bin/env bash
# Build the GPU long-multiplication testbed (cached in $KV4RL_CACHE, default ~/.cache/kv4rl) and run a short
# RL run on it: prints the build time, starting accuracy and mean response length, then the run's table.
# About 5 minutes on one H200. Usage: tools/testbed_gpu.sh [iterations, default 10] [extra train overrides]
set -euo pipefail
iterations=${1:-10}
shift || true
out=${OUT:-runs}
kv4rl() { python -m kv4rl.cli "$@"; }
start=$(date +%s)
kv4rl build-model --task longmul --size gpu --json "$out/testbed_build.json"
echo "build-model took $(( $(date +%s) - start )) s (wall, including a cache reload)"
kv4rl train --config recipes/testbed_longmul_gpu.yaml "out_dir=$out" name=testbed-gpu-smoke \
  "trainer.iterations=$iterations" eval.every=0 checkpoint.save_every=1000 --no-progress --overwrite "$@"
python - "$out/testbed-gpu-smoke/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("iter  accuracy  response_len  truncated  time_rollout  time_update")
for r in rows:
    print(f"{r['iteration']:4d}  {r['accuracy']:8.3f}  {r['response_len_mean']:12.1f}  {r['truncated_frac']:9.3f}"
          f"  {r['time_rollout']:12.2f}  {r['time_update']:11.2f}")
PY
echo "total $(( $(date +%s) - start )) s"
