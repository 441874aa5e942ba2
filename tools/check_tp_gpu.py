"""A tensor-parallel engine on N GPUs against the one-GPU engine (run under torchrun; prints a table).

    torchrun --nproc-per-node 2 tools/check_tp_gpu.py

Every rank builds the TP-N engine on the same random checkpoint (head_dim 128, 32/8 heads) and rank 0
also builds the one-GPU engine. float32 + fp32 KV (reference path) must give the same greedy tokens and
teacher-forced logits to float32 rounding. bf16 with bf16/fp8/kv4 KV (Triton decode kernels, CUDA
graphs with the all-reduces inside) rounds differently when sharded, so its yardstick is the one-GPU
engine in float32 with the same KV format: the TP-N bf16 logits must be no further from it than the
one-GPU bf16 logits are (x1.25, RMS over all scored positions). Exits non-zero on a mismatch.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv4rl.engine.config import EngineConfig, KVConfig  # noqa: E402
from kv4rl.engine.llm import Engine  # noqa: E402
from kv4rl.engine.sequence import SamplingParams  # noqa: E402

CASES = [("float32", "fp32"), ("bfloat16", "bf16"), ("bfloat16", "fp8"), ("bfloat16", "kv4")]


def _run(path: str, dtype: str, fmt: str, tp: int) -> dict:
    engine = Engine(path, EngineConfig(kv=KVConfig(format=fmt), max_model_len=512, tensor_parallel=tp,
                                       num_kv_blocks=512), device="cuda", dtype=dtype, max_num_seqs=16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (int(n),), generator=g).tolist() for n in torch.randint(3, 200, (12,), generator=g)]
    forced = [torch.randint(0, 500, (40,), generator=g).tolist() for _ in prompts]
    logits = [t.cpu() for t in engine.score_tokens(prompts, forced)]
    tokens = [c.token_ids for c in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64,
                                                                            ignore_eos=True))]
    return {"logits": logits, "tokens": tokens, "summary": engine.summary}


def _rms(logits: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    sq = sum(float(((a - b) ** 2).sum()) for a, b in zip(logits, exact))
    return (sq / sum(a.numel() for a in exact)) ** 0.5


def main() -> int:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    folder = [tempfile.mkdtemp(prefix="tp-check-")] if rank == 0 else [None]
    if rank == 0:
        from tests.conftest import make_checkpoint

        make_checkpoint(folder[0], vocab=512, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=1024)
    dist.broadcast_object_list(folder, src=0)
    failures = 0
    rows = []
    for dtype, fmt in CASES:
        got = _run(folder[0], dtype, fmt, world)
        dist.barrier()
        if rank == 0:
            ref = _run(folder[0], dtype, fmt, 1)
            same = sum(x == y for a, b in zip(got["tokens"], ref["tokens"]) for x, y in zip(a, b))
            total = sum(len(a) for a in ref["tokens"])
            if dtype == "float32":
                diff = max(float((a - b).abs().max()) for a, b in zip(got["logits"], ref["logits"]))
                ok, yardstick = diff <= 1e-3 and same == total, "TP1 fp32: max |d| <= 1e-3, same tokens"
            else:
                exact = _run(folder[0], "float32", fmt, 1)["logits"]
                diff, floor = _rms(got["logits"], exact), _rms(ref["logits"], exact)
                ok, yardstick = diff <= 1.25 * floor, f"RMS vs fp32 model <= 1.25 x TP1's {floor:.3f}"
            failures += not ok
            rows.append((dtype, fmt, f"{diff:.3g}", f"{same}/{total}", yardstick, "ok" if ok else "MISMATCH"))
        dist.barrier()
    if rank == 0:
        print(got["summary"])
        print(f"{'dtype':9} {'kv':5} {'logit error':>11} {'same greedy':>12}  yardstick  result")
        for r in rows:
            print(f"{r[0]:9} {r[1]:5} {r[2]:>11} {r[3]:>12}  {r[4]}  {r[5]}")
    flag = torch.tensor([failures], device="cuda")
    dist.broadcast(flag, src=0)
    dist.destroy_process_group()
    return int(flag.item() > 0)


if __name__ == "__main__":
    sys.exit(main())
