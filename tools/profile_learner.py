"""Where a learner step's GPU time goes, kernel family by family: GEMMs, attention (FlexAttention's
compiled kernels or SDPA), elementwise, norms and reductions, the log-prob head, the optimizer,
copies and casts. For the MFU gap of the packed learner (bench/RESULTS.md): `bench learner` says how
fast a step is, this says what it spends the time on.

Builds the learner as `kv4rl bench learner` does (random-init shape, FSDP2 at world size 1, the same
synthetic batch), runs one warm-up step (FlexAttention compiles there), then one step under the torch
profiler. Prints wall time, GPU busy time and milliseconds by family, then the top kernels, and with
`--ops N` the N aten ops (with their input shapes) whose own kernels took the most time, which names
what a kernel family is spent on (which copies, which casts); writes the same as JSON:

    python tools/profile_learner.py --shape qwen3-1.7b --workload uniform --attention flex --json prof.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from kv4rl.algo.config import AlgoConfig
from kv4rl.bench.learner import LearnerWorkload, synthetic_batch
from kv4rl.bench.random_model import _shape, random_hf_qwen3
from kv4rl.trainer.learner import Learner

FAMILIES = (  # kernel-name fragments -> family, first match wins
    ("attention", ("flex", "tem_fused", "fmha", "flash", "attention", "sdpa", "efficient")),
    ("gemm", ("nvjet", "gemm", "cublas", "cutlass", "xmma", "splitK", "sm90", "aten::mm", "aten::addmm", "aten::bmm")),
    ("optimizer", ("multi_tensor", "adam", "Adam", "foreach")),
    ("logprob head", ("log_softmax", "LogSoftMax", "softmax", "SoftMax", "gather", "scatter")),
    ("norm/reduce", ("reduce", "norm", "Norm", "sum_", "mean")),
    ("copy/cast", ("copy", "Memcpy", "memcpy", "cast", "to_copy", "cat", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton_poi", "triton_red")),
    ("nccl", ("nccl",)),
)


def family(name: str) -> str:
    return next((fam for fam, keys in FAMILIES if any(k in name for k in keys)), "other")


def top_ops(prof, dev: torch.device, n: int) -> list[dict]:
    """The aten ops whose own kernels (not their children's) took the most device time, by input shape."""
    own = (lambda e: e.self_device_time_total) if dev.type == "cuda" else (lambda e: e.self_cpu_time_total)
    ops = [{"name": e.key, "shapes": str(e.input_shapes)[:160], "calls": e.count, "ms": own(e) / 1e3}
           for e in prof.key_averages(group_by_input_shape=True)
           if e.key.startswith("aten::") and e.device_type == DeviceType.CPU and own(e) > 0]
    return sorted(ops, key=lambda o: -o["ms"])[:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-1.7b")
    p.add_argument("--workload", default="uniform", choices=["uniform", "lognormal"])
    p.add_argument("--num-seqs", type=int, default=None, help="default: 16 uniform, 32 lognormal")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16384, help="packed micro-batch token budget")
    p.add_argument("--attention", default="flex", choices=["flex", "sdpa"])
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--fuse-elementwise", action="store_true", help="trainer.fuse_elementwise")
    p.add_argument("--compile-layers", action="store_true", help="trainer.compile_layers")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--ops", type=int, default=0, help="also list this many aten ops by their kernels' time, "
                                                      "with input shapes (records shapes: a slower profile)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = torch.device(a.device)
    work = LearnerWorkload(kind=a.workload, num_seqs=a.num_seqs or (32 if a.workload == "lognormal" else 16),
                           seq_len=a.seq_len, prompt_len=a.prompt_len)
    config = _shape(a.shape)
    work.validate(config["max_position_embeddings"])
    batch = synthetic_batch(work, config["vocab_size"]).to(dev)
    policy = random_hf_qwen3(a.shape, dev, dtype=torch.float32, seed=work.seed)
    learner = Learner(policy, None, algo=AlgoConfig(), lr=1e-7, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1.0,
                      micro_batch_size=4, updates_per_batch=1, temperature=1.0, device=dev,
                      grad_checkpointing=a.checkpointing, ref_kl_every=1, max_tokens_per_micro_batch=a.max_tokens,
                      attention=a.attention, fuse_elementwise=a.fuse_elementwise,
                      compile_layers=a.compile_layers)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    learner.step(batch)  # warm-up: FlexAttention's compilation falls here
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities, record_shapes=a.ops > 0) as prof:
        learner.step(batch)
        sync()
    wall = time.perf_counter() - start
    device_type = DeviceType.CUDA if dev.type == "cuda" else DeviceType.CPU
    kernels = sorted(({"name": e.key[:100], "calls": e.count, "ms": (e.self_device_time_total if dev.type == "cuda"
                                                                    else e.self_cpu_time_total) / 1e3,
                       "family": family(e.key)}
                      for e in prof.key_averages() if e.device_type == device_type
                      and (e.self_device_time_total if dev.type == "cuda" else e.self_cpu_time_total) > 0),
                     key=lambda k: -k["ms"])
    families: dict[str, float] = {}
    for k in kernels:
        families[k["family"]] = families.get(k["family"], 0.0) + k["ms"]
    tokens = int(batch.attention_mask.sum())
    out = {"shape": a.shape, "workload": a.workload, "attention": learner.attention, "checkpointing": a.checkpointing,
           "fuse_elementwise": a.fuse_elementwise, "compile_layers": a.compile_layers,
           "max_tokens_per_micro_batch": a.max_tokens, "tokens": tokens, "wall_s": wall,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "busy_ms": sum(families.values()), "ms_by_family": families, "kernels": kernels[:a.top]}
    if a.ops:
        out["ops"] = top_ops(prof, dev, a.ops)
    print(f"== {a.shape} {a.workload} ({tokens:,} tokens), {learner.attention}"
          f"{', fused elementwise' if a.fuse_elementwise else ''}"
          f"{', compiled layers' if a.compile_layers else ''}, checkpointing "
          f"{'on' if a.checkpointing else 'off'}: step {wall:.3f} s under the profiler, "
          f"{'GPU' if dev.type == 'cuda' else 'CPU op'} busy {out['busy_ms']:.0f} ms")
    for fam, ms in sorted(families.items(), key=lambda x: -x[1]):
        print(f"   {fam:14s} {ms:10.1f} ms  {ms / out['busy_ms']:6.1%}")
    for k in kernels[:a.top]:
        print(f"   {k['ms']:9.2f} ms {k['calls']:6d}x  [{k['family']}] {k['name']}")
    for op in out.get("ops", []):
        print(f"   {op['ms']:9.2f} ms {op['calls']:6d}x  {op['name']} {op['shapes']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
