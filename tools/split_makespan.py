"""The decode split grid on skewed batches, simulated: for equal contexts and for the rollout bench's
log-normal lengths, the split size of equal pieces and the one `balanced_split_size` picks, each with
its list-scheduled finishing time (pieces in grid order to the first free slot, 64 tokens of overhead
a piece) and the host time of the choice. No GPU; H200 SM count.

    python tools/split_makespan.py [--seed 0]
"""

from __future__ import annotations

import argparse
import heapq
import math
import timeit

import numpy as np

from kv4rl.engine.fast_path import GRID_FACTOR, PIECE_OVERHEAD_TOKENS, balanced_split_size
from kv4rl.kernels import int4_decode_cuda
from kv4rl.kernels.decode_attention import choose_num_splits, wave_pieces

NUM_SMS, NUM_KV_HEADS, MAX_SPLITS, QUANTUM = 132, 8, 32, 64


def makespan(lens, split: int, slots: float) -> int:
    free = [0] * int(slots)
    for n in lens:
        for lo in range(0, int(n), split):
            heapq.heappush(free, heapq.heappop(free) + min(split, int(n) - lo) + PIECE_OVERHEAD_TOKENS)
    return max(free)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    rng = np.random.default_rng(parser.parse_args().seed)
    print(f"{'batch':>5} {'body':>6} {'lengths':>12} {'mean':>5} {'max':>5} {'splits':>6} {'grid':>4} "
          f"{'equal split':>11} {'finish':>6} {'chosen':>6} {'finish':>6} {'host us':>7}")
    for batch in (24, 64, 124, 256):
        for body in ("cuda", "triton"):
            if body == "cuda":
                base = int4_decode_cuda.choose_num_splits(batch, NUM_KV_HEADS, MAX_SPLITS, NUM_SMS)
                slots = int4_decode_cuda.wave_pieces(NUM_KV_HEADS, NUM_SMS)
            else:
                base = choose_num_splits(batch, NUM_KV_HEADS, MAX_SPLITS, NUM_SMS)
                slots = wave_pieces(NUM_KV_HEADS, NUM_SMS)
            grid = min(MAX_SPLITS, GRID_FACTOR * base)
            for name, lens in (("equal 1123", np.full(batch, 1123)),
                               ("log-normal", np.minimum(256 + np.exp(rng.normal(np.log(512), 1.0, batch)).astype(int),
                                                         4352))):
                equal = math.ceil(math.ceil(lens.max() / base) / QUANTUM) * QUANTUM
                chosen = balanced_split_size(lens, base, grid, slots, QUANTUM)
                args = (lens, base, grid, slots, QUANTUM)
                host = timeit.timeit(lambda args=args: balanced_split_size(*args), number=500) / 500
                print(f"{batch:>5} {body:>6} {name:>12} {int(lens.mean()):>5} {lens.max():>5} {base:>6} {grid:>4} "
                      f"{equal:>11} {makespan(lens, equal, slots):>6} {chosen:>6} {makespan(lens, chosen, slots):>6} "
                      f"{host * 1e6:>7.0f}")


if __name__ == "__main__":
    main()
