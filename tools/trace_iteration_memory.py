"""Device memory at each phase of a `kv4rl` command (CUDA): allocated, peak (reset at each phase),
reserved and free GiB, the allocator's retries (a failed cudaMalloc, the cache freed and the call
repeated) and each call's seconds and batch, when the learner measures its update memory, the engine
sizes its pool, the learner steps or runs a no-grad pass, and the engine loads weights; an OOM names
the phase it hit; dynamo's recompiles are logged with their reasons. Why: the Qwen3-4B awake arm ran
out of memory without saying which term of its reserve was short (bench/RESULTS.md, ninth session,
found AdamW's moments uncounted with it). Usage, the arguments of `kv4rl`:
    python tools/trace_iteration_memory.py bench iteration --shape qwen3-4b --arms ...  | grep MEM
"""
import functools
import sys
import time

import torch

from kv4rl.cli import app
from kv4rl.engine.llm import Engine
from kv4rl.trainer.learner import Learner

GIB = 2**30


def report(tag: str) -> None:
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    print(f"MEM {time.strftime('%T')} {tag}: alloc {torch.cuda.memory_allocated() / GIB:.2f} "
          f"peak {torch.cuda.max_memory_allocated() / GIB:.2f} reserved {torch.cuda.memory_reserved() / GIB:.2f} "
          f"free {free / GIB:.2f} GiB, allocator retries {stats.get('num_alloc_retries', 0)} "
          f"cudaFree {stats.get('num_device_free', 0)}", flush=True)


def traced(cls, name: str) -> None:
    """Report around `cls.name`, its peak counted from the call; an int it returns printed in GiB."""
    method = getattr(cls, name)

    @functools.wraps(method)
    def call(*args, **kwargs):
        torch.cuda.reset_peak_memory_stats()
        report(f"{cls.__name__}.{name} in")
        batch = next((a for a in args[1:] if hasattr(a, "attention_mask")), None)
        if batch is not None:  # what the call's time scales with: tokens, and attention's sum of squares
            lengths = batch.attention_mask.sum(1).double()
            print(f"MEM   batch {len(lengths)} rows, {int(lengths.sum())} tokens, longest {int(lengths.max())}, "
                  f"sum of squared lengths {float((lengths**2).sum()) / 1e9:.2f}e9", flush=True)
        start = time.perf_counter()
        try:
            out = method(*args, **kwargs)
        except torch.OutOfMemoryError:
            report(f"{cls.__name__}.{name} OOM")
            raise
        report(f"{cls.__name__}.{name} out after {time.perf_counter() - start:.2f} s")
        if isinstance(out, int):
            print(f"MEM   returns {out / GIB:.2f} GiB", flush=True)
        return out

    setattr(cls, name, call)


def traced_engine_init() -> None:
    init = Engine.__init__

    @functools.wraps(init)
    def call(self, *args, **kwargs):
        report(f"Engine.__init__ in reserve={kwargs.get('reserve_bytes', 0) / GIB:.2f}")
        init(self, *args, **kwargs)
        report(f"Engine.__init__ out pool={self.pool_bytes / GIB:.2f}")
        print("MEM  ", self.pool_sizing, flush=True)

    Engine.__init__ = call


if __name__ == "__main__":
    torch._logging.set_logs(recompiles=True)  # a compile inside a timed update names its guard here
    for method in ("update_memory_bytes", "step", "_logprobs"):
        traced(Learner, method)
    traced(Engine, "load_weights")
    traced_engine_init()
    sys.argv = ["kv4rl", *sys.argv[1:]]
    app()
