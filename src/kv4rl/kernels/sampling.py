"""Fused Gumbel-max sampling for untruncated rows (Triton): noise and argmax in one pass over the row.

The torch sampler (`kv4rl.engine.sampler`) draws a token as

    argmax_v  scores[b, v] (float32 -> float64) + (-log(-log(u(seed_b, step_b, v)))),
    u = ((splitmix64(splitmix64(seed ^ splitmix64(step)) + v * GOLDEN) >>> 11) + 0.5) * 2^-53,

with `scores` the temperature-scaled (truncated) logits, materialising [B, V] int64 and float64
tensors several times over. This kernel computes the same
expression element by element and never stores it, so the tokens are the torch sampler's, bit for bit:

- the hash runs in uint64, where multiplication and addition wrap and `>>` is the logical shift that
  the torch code emulates on int64; the 53 bits left convert to float64 exactly;
- the float64 steps are the same IEEE operations in the same order, and no product of ours feeds an
  addition, so FMA contraction cannot change them; `log` is libdevice's `__nv_log` on the GPU, the
  function CUDA's `::log(double)` (torch's float64 log kernel) compiles to. Its only contractible pair,
  `t + t` with `t = x * y`, rounds to `2t` fused or not. The interpreter uses numpy's log, which may
  differ from torch's CPU log in the last bit (tests there compare the hash bits and the tokens);
- the argmax follows torch.argmax: NaN above everything, ties to the lowest index.

Each program scans one split of a row's vocabulary with a per-lane running best and reduces it at the
end; the few per-split winners are merged by torch.argmax (its tie rule keeps the earliest split).
With `with_log_norm` the same pass keeps a per-lane running max and sum of exp (float32) for the row's
log-sum-exp, so the sampler needs no log_softmax pass over [B, V].

The float32 screen (`screen`, default on): each block first gets float32 noise (`_gumbel_f32`), and only a
block whose float32 scores come within a margin of the program's best float64 score so far (or that holds a
NaN) computes the float64 expression. A block that does not cannot hold the winner, so the tokens are the
same; the margin is far above the float32 noise's tested error.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kv4rl.kernels import cuda_sm_count, interpreting

BLOCK_V = 1024
NUM_WARPS = 8  # 164 against 176 us with 4 at 128 x 151,936 (bench/RESULTS.md)
PROGRAMS_PER_SM = 4  # the default split count fills the GPU this many times over
_NO_INDEX = tl.constexpr(2**31 - 1)  # loses every tie against a real vocabulary index
# The float32 screen's margin over its error: `_gumbel_f32` is within ~2e-5 of the float64 noise (tested at
# the extremes of the uniform), and a float32 sum adds half an ulp of the score
_SCREEN_ABS = tl.constexpr(2.0**-10)
_SCREEN_REL = tl.constexpr(2.0**-16)


@triton.jit
def _splitmix64(x):
    """splitmix64 on uint64 (wrapping multiply, logical shifts), as `sampler.splitmix64` on int64."""
    z = x + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _gumbel_f64(bits, LIBDEVICE: tl.constexpr):
    """The torch sampler's noise -log(-log(u)) in float64 for the 53 hash bits `bits`, bit for bit (the top
    value taken as 2^53 - 2, as `sampler.uniform_noise` takes it, so u stays below 1)."""
    bits = tl.minimum(bits, 0x1FFFFFFFFFFFFE)
    u = (bits.to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2^-53, exact in any float type
    if LIBDEVICE:
        return -libdevice.log(-libdevice.log(u))
    return -tl.log(-tl.log(u))


@triton.jit
def _gumbel_f32(bits):
    """The same noise in float32, within ~2e-5 of it (tests check it at the uniform's extremes). Where u is
    within 2^-8 of 1, -log(u) is the series in t = 1 - u, taken exactly in the integers as float64 has it
    (bits + 0.5 rounds half to even above 2^52; the top value 2^53 - 1 is taken as 2^53 - 2), so the u
    near 1 that make the noise large keep their bits; elsewhere log(u) loses at most 2^-17 of -log(u)."""
    bits = tl.minimum(bits, 0x1FFFFFFFFFFFFE)
    u = (bits.to(tl.float32) + 0.5) * 1.1102230246251565e-16
    t = ((bits ^ 0x1FFFFFFFFFFFFF) + 1 - (bits & 1)).to(tl.float32) * 1.1102230246251565e-16
    series = t * (1.0 + t * (0.5 + t * (0.3333333333333333 + t * 0.25)))  # next term t^5/5: < 2^-33 of it
    w = tl.where(t < 0.00390625, series, -tl.log(u))
    return -tl.log(w)


@triton.jit
def _precedes(v1, i1, v2, i2):
    """Whether (v1, i1) wins torch.argmax over (v2, i2): NaN first, then the larger value, then the
    lower index."""
    nan1 = v1 != v1
    nan2 = v2 != v2
    same = (v1 == v2) | (nan1 & nan2)
    return (nan1 & ~nan2) | (v1 > v2) | (same & (i1 < i2))


@triton.jit
def _keep_best(score, offs, live, best_v, best_i):
    """Each lane's running best (value, index) after this block's `score` (-inf where not `live`)."""
    idx = tl.where(live, offs, _NO_INDEX)
    take = _precedes(score, idx, best_v, best_i)
    return tl.where(take, score, best_v), tl.where(take, idx, best_i)


@triton.jit
def _gumbel_argmax_kernel(
    x_ptr, stride_x, seed_ptr, step_ptr, vocab, blocks_per_split,
    best_v_ptr, best_i_ptr, u_ptr, score_ptr, max_ptr, sum_ptr,
    NOISE: tl.constexpr, LIBDEVICE: tl.constexpr, DEBUG: tl.constexpr, LSE: tl.constexpr, SCREEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    if NOISE:
        # the row key, computed per lane so every value is a uint64 vector (identical in all lanes)
        seed = tl.load(seed_ptr + row + lane * 0).to(tl.uint64, bitcast=True)
        step = tl.load(step_ptr + row + lane * 0).to(tl.uint64, bitcast=True)
        key = _splitmix64(seed ^ _splitmix64(step))
    best_v = tl.full([BLOCK], float("-inf"), tl.float64)
    best_s = tl.max(best_v, 0)  # SCREEN: the program's best float64 score so far (NaN left out)
    best_i = tl.full([BLOCK], _NO_INDEX, tl.int32)
    run_m = tl.full([BLOCK], float("-inf"), tl.float32)  # LSE: per-lane running max and sum of exp(x - max)
    run_s = tl.zeros([BLOCK], tl.float32)
    lo = split * blocks_per_split * BLOCK
    hi = tl.minimum(lo + blocks_per_split * BLOCK, vocab)
    for start in range(lo, hi, BLOCK):
        offs = start + lane
        live = offs < hi
        raw = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=live, other=0.0)
        if LSE:  # the row's log-sum-exp in the same pass, float32 (what log_softmax's own sum uses)
            xl = tl.where(live, raw, float("-inf"))
            m_new = tl.maximum(run_m, xl)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            run_s = run_s * tl.exp(run_m - shift) + tl.exp(xl - shift)
            run_m = m_new
        if SCREEN:  # float32 scores first; float64 only for blocks that may hold the program's winner
            bits = _splitmix64(key + offs.to(tl.uint64) * 0x9E3779B97F4A7C15) >> 11
            approx = raw + _gumbel_f32(bits)
            size = tl.abs(approx)
            margin = _SCREEN_ABS + tl.where(size < float("inf"), _SCREEN_REL * size, 0.0)
            maybe = (approx.to(tl.float64) >= best_s - margin) | (approx != approx)
            if tl.max((maybe & live).to(tl.int32), 0) > 0:
                score = tl.where(live, raw.to(tl.float64) + _gumbel_f64(bits, LIBDEVICE), float("-inf"))
                best_v, best_i = _keep_best(score, offs, live, best_v, best_i)
                best_s = tl.maximum(best_s, tl.max(tl.where(score != score, float("-inf"), score), 0))
        else:
            score = raw.to(tl.float64)
            if NOISE:
                bits = _splitmix64(key + offs.to(tl.uint64) * 0x9E3779B97F4A7C15) >> 11
                u = (bits.to(tl.float64) + 0.5) * 1.1102230246251565e-16
                score = score + _gumbel_f64(bits, LIBDEVICE)  # torch: lp + (-log(-log(u)))
                if DEBUG:
                    out = row.to(tl.int64) * vocab + offs
                    tl.store(u_ptr + out, u, mask=live)
                    tl.store(score_ptr + out, score, mask=live)
            best_v, best_i = _keep_best(tl.where(live, score, float("-inf")), offs, live, best_v, best_i)
    # lanes -> one winner with plain max/min reductions (a custom combine runs per element in the
    # interpreter): the first NaN if any lane holds one, else the lowest index among the largest
    is_nan = best_v != best_v
    any_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    clean = tl.where(is_nan, float("-inf"), best_v)
    top = tl.max(clean, 0)
    winner = tl.where(any_nan, is_nan, clean == top)
    i = tl.min(tl.where(winner, best_i, _NO_INDEX), 0)
    v = tl.where(any_nan, float("nan"), top)
    n_splits = tl.num_programs(1)
    tl.store(best_v_ptr + row * n_splits + split, v)
    tl.store(best_i_ptr + row * n_splits + split, i)
    if LSE:
        m = tl.max(run_m, 0)
        total = tl.sum(run_s * tl.exp(run_m - tl.where(m == float("-inf"), 0.0, m)), 0)
        tl.store(max_ptr + row * n_splits + split, m)
        tl.store(sum_ptr + row * n_splits + split, total)


def _launch(x, seeds, steps, noise: bool, debug: bool, block: int, splits: int | None, num_warps: int = NUM_WARPS,
            lse: bool = False, screen: bool = True):
    rows, vocab = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    n_blocks = triton.cdiv(vocab, block)
    if splits is None:  # enough programs to fill the device a few times over
        wanted = PROGRAMS_PER_SM * cuda_sm_count(x.device) if x.device.type == "cuda" else 1
        splits = triton.cdiv(wanted, max(rows, 1))
    blocks_per_split = triton.cdiv(n_blocks, max(1, min(splits, n_blocks)))
    splits = triton.cdiv(n_blocks, blocks_per_split)
    best_v = torch.empty(rows, splits, dtype=torch.float64, device=x.device)
    best_i = torch.empty(rows, splits, dtype=torch.int32, device=x.device)
    shape = (rows, vocab) if debug else (1,)
    u = torch.empty(shape, dtype=torch.float64, device=x.device)
    scores = torch.empty(shape, dtype=torch.float64, device=x.device)
    lse_shape = (rows, splits) if lse else (1,)  # the kernel writes them only with LSE
    split_max = torch.empty(lse_shape, dtype=torch.float32, device=x.device)
    split_sum = torch.empty(lse_shape, dtype=torch.float32, device=x.device)
    if rows:
        _gumbel_argmax_kernel[(rows, splits)](
            x, x.stride(0), seeds, steps, vocab, blocks_per_split, best_v, best_i, u, scores, split_max, split_sum,
            NOISE=noise, LIBDEVICE=not interpreting(), DEBUG=debug, LSE=lse, SCREEN=screen and noise and not debug,
            BLOCK=block, num_warps=num_warps,
        )
    tokens = best_i.gather(1, best_v.argmax(1, keepdim=True)).squeeze(1).long()
    return tokens, u, scores, (_merge_log_norm(split_max, split_sum) if lse else None)


def _merge_log_norm(split_max: torch.Tensor, split_sum: torch.Tensor) -> torch.Tensor:
    """The row's log-sum-exp [B] from each split's max and sum of exp(x - max), merged and kept in float64:
    rounded to float32 at |x| ~ 10 it would put a 1e-6 error on a log-prob near 0."""
    m, s = split_max.double(), split_sum.double()
    top = m.max(1).values
    shift = torch.where(top == float("-inf"), 0.0, top)
    return shift + (s * torch.exp(m - shift[:, None])).sum(1).log()


def gumbel_argmax(scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, *,
                  block: int = BLOCK_V, splits: int | None = None, num_warps: int = NUM_WARPS,
                  with_log_norm: bool = False, screen: bool = True):
    """The sampler's Gumbel-max tokens [B] for float32 scores [B, V] (scaled logits, or log-probs: a
    row's constant moves no argmax beyond rounding) and int64 seeds, steps [B]. `with_log_norm` also
    returns each row's log-sum-exp of the scores [B] (float64), computed in the same pass, so a caller
    can normalise the sampled token's score without a log_softmax over [B, V].

    `splits` (vocabulary ranges per row; default: enough programs to fill the GPU), `block` and
    `num_warps` change only the work layout, never the tokens.
    """
    assert scores.dtype == torch.float32 and scores.dim() == 2
    seeds, steps = seeds.to(torch.long).contiguous(), steps.to(torch.long).contiguous()
    tokens, _, _, log_norm = _launch(scores, seeds, steps, True, False, block, splits, num_warps, lse=with_log_norm,
                                     screen=screen)
    return (tokens, log_norm) if with_log_norm else tokens


def gumbel_scores(logprobs_all: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, *,
                  block: int = BLOCK_V, splits: int | None = None):
    """(tokens, uniforms [B, V], scores [B, V]) as the kernel computes them, for tests that compare the
    noise itself with `uniform_noise` and the scores with the torch sampler's."""
    seeds, steps = seeds.to(torch.long).contiguous(), steps.to(torch.long).contiguous()
    return _launch(logprobs_all, seeds, steps, True, True, block, splits)[:3]


def rows_argmax(values: torch.Tensor, *, block: int = BLOCK_V, splits: int | None = None) -> torch.Tensor:
    """The kernel's reduction without noise: torch.argmax(values, -1) for float32/float64 [B, V]; lets
    tests check tie-breaking and NaN handling on crafted rows."""
    dummy = torch.zeros(values.shape[0], dtype=torch.long, device=values.device)
    return _launch(values, dummy, dummy, False, False, block, splits)[0]
