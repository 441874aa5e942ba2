#!/usr/bin/env bash
# The fast prefill on one H200 (< 5 min): the kernel and engine GPU tests, the per-layer attention timing,
# then `bench generate` at Qwen3-1.7B, B256 x (128 prompt + 256 new) for bf16 and kv4, with the fast prefill
# (default) and with the reference prefill (engine.prefill_backend=torch), JSON under ${OUT:-out/prefill}.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src
out=${OUT:-out/prefill}
mkdir -p "$out"
python -m pytest -q tests/gpu/test_prefill_kernel_gpu.py tests/gpu/test_prefill_engine_gpu.py
python tools/prefill_micro.py | tee "$out/prefill_micro.txt"
for prefill in triton torch; do
  python -m kv4rl.cli bench generate --shape qwen3-1.7b --batch-sizes 256 --prompt-len 128 --new-tokens 256 \
    --kv-format bf16,kv4 --no-hf --json "$out/generate_prefill_$prefill.json" engine.prefill_backend=$prefill
done
python - "$out" <<'PY'
import json, sys
for prefill in ("triton", "torch"):
    res = json.load(open(f"{sys.argv[1]}/generate_prefill_{prefill}.json"))
    for r in res["results"]:
        print(f"prefill {prefill:6s} {r['kv_format']:4s} B{r['batch_size']}: {r['engine_tokens_per_s']:,.0f} tok/s, "
              f"prefill {r['prefill_s']:.3f} s over {r['prefill_steps']} steps, decode step {r['decode_step_ms']:.2f} ms")
PY
