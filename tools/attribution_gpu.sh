#!/bin/bash
# Mismatch attribution on one GPU (a few minutes on an H200); run from the repository root, results under $OUT:
#   bash tools/attribution_gpu.sh 2>&1 | tee $OUT/attribution_log.txt
# 1. tests/gpu/test_attribution_gpu.py: the fast path with KV4 / FP8 weights, terms printed per case;
# 2. a 20-iteration run of the embedded tiny model with KV4 + FP8 weights and one version of lag,
#    attributed every 2 iterations, and `kv4rl plot mismatch` of it (PNG + CSV).
set -euo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}

python -m pytest -q -s -p no:cacheprovider tests/gpu/test_attribution_gpu.py
python -m kv4rl.cli train --no-progress --overwrite device=cuda out_dir=$OUT/runs name=attribution-kv4-fp8 \
    engine.kv.format=kv4 engine.kv.group_size=32 engine.kv.n_sink=4 engine.kv.n_recent=8 \
    engine.weight_format=fp8 engine.gpu_memory_fraction=0.3 staleness.lag=1 trainer.iterations=20 \
    telemetry.attribution_every=2 telemetry.attribution_samples=16 checkpoint.save_every=100 \
    logging.tensorboard=false
python -m kv4rl.cli plot mismatch $OUT/runs/attribution-kv4-fp8 -o $OUT/attribution_mismatch.png
cp $OUT/runs/attribution-kv4-fp8/metrics.jsonl $OUT/attribution_metrics.jsonl
