"""KV-cache formats in the engine: caches against the quant primitives, KV4's protection as its window
slides, the reference attention against float64 brute force, engine runs per format, the fidelity
bench, and the errors for bad settings."""

import numpy as np
import pytest
import torch

from kv4rl.bench.fidelity import Variant, kl_and_top1, parse_allocations, run_fidelity
from kv4rl.engine.attention import AttnMetadata, reference_paged_attention
from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.kv_formats import get_kv_format
from kv4rl.engine.kv_formats.fp4 import NVFP4_HEADROOM
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams
from kv4rl.quant import (
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    hadamard_matrix,
    nvfp4_tensor_scale,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantize_mxfp4,
    quantize_nvfp4,
    rotate,
)

HKV, HQ, D, BLOCK = 2, 4, 32, 4


# ---- a scripted cache: sequences with scattered blocks, fed random k/v step by step -----------------
class Scripted:
    """Sequences with shuffled block tables and their own running slots, all tokens' q/k/v kept.

    `k_rot`/`v_rot` hold what the cache should quantize: the step's keys/values rotated as one batch,
    like the engine does (a float32 matmul's rounding can depend on the batch shape).
    """

    def __init__(self, fmt, tables, seq_slots, seed=0, num_blocks=32):
        self.fmt, self.tables, self.seq_slots = fmt, tables, seq_slots
        self.cache = fmt.allocate(num_blocks * BLOCK, HKV, D, "cpu", num_seq_slots=max(seq_slots) + 1)
        self.gen = torch.Generator().manual_seed(seed)
        self.q = [[] for _ in tables]
        self.k = [[] for _ in tables]
        self.v = [[] for _ in tables]
        self.k_rot = [[] for _ in tables]
        self.v_rot = [[] for _ in tables]

    def step(self, new_counts):
        """Append new_counts[i] tokens to sequence i; returns (meta, out[N, HQ, D])."""
        qs, ks, vs = [], [], []
        for i, n in enumerate(new_counts):
            for _ in range(n):
                channel_scale = torch.linspace(0.2, 3.0, D)  # uneven channels, as real keys have
                self.q[i].append(torch.randn(HQ, D, generator=self.gen))
                self.k[i].append(torch.randn(HKV, D, generator=self.gen) * channel_scale)
                self.v[i].append(torch.randn(HKV, D, generator=self.gen))
                qs.append(self.q[i][-1])
                ks.append(self.k[i][-1])
                vs.append(self.v[i][-1])
        meta = AttnMetadata.build(
            query_lens=list(new_counts), context_lens=[len(k) for k in self.k], block_tables=self.tables,
            block_size=BLOCK, seq_ids=list(range(len(self.tables))), device=torch.device("cpu"),
            seq_slots=self.seq_slots,
        )
        k_step, v_step = torch.stack(ks), torch.stack(vs)
        k_rot = rotate(k_step) if self.fmt.rotate != "none" else k_step
        v_rot = rotate(v_step) if self.fmt.rotate == "kv" else v_step
        for i, rows in zip(range(len(self.tables)), k_rot.split(list(new_counts))):
            self.k_rot[i] += list(rows)
        for i, rows in zip(range(len(self.tables)), v_rot.split(list(new_counts))):
            self.v_rot[i] += list(rows)
        out = reference_paged_attention(torch.stack(qs), k_step, v_step, self.cache, self.fmt, meta)
        return meta, out


def attention64(q, keys, values, rotation):
    """float64 causal-free attention of one query q[HQ, D] over keys/values[L, HKV, D] (already the
    cache's rotated copies); `rotation` in {"none", "k", "kv"} rotates q and un-rotates the output."""
    h64 = hadamard_matrix(D, torch.float64)
    q = q.double() @ h64 if rotation != "none" else q.double()
    group = HQ // HKV
    out = torch.empty(HQ, D, dtype=torch.float64)
    for h in range(HQ):
        scores = keys[:, h // group].double() @ q[h] / D**0.5
        out[h] = scores.softmax(0) @ values[:, h // group].double()
    return out @ h64 if rotation == "kv" else out


def kv4_copies(x, group_size=32):
    """(INT8 path, INT4 path) of one rotated k or v [HKV, D], from the quant primitives."""
    return dequantize_int8(*quantize_int8(x)), dequantize_int4(*quantize_int4(x, group_size), group_size)


# ---- round trip and attention per format ---------------------------------------------------------
def nvfp4_round_trip(x, scale):
    return dequantize_nvfp4(*quantize_nvfp4(x, scale), scale)


ROUND_TRIPS = {
    "fp32": lambda x, s: x,
    "bf16": lambda x, s: x.to(torch.bfloat16).float(),
    "fp8": lambda x, s: dequantize_fp8(*quantize_fp8(x)),
    "int4": lambda x, s: dequantize_int4(*quantize_int4(x, 32), 32),
    "mxfp4": lambda x, s: dequantize_mxfp4(*quantize_mxfp4(x)),
    "nvfp4": lambda x, s: nvfp4_round_trip(x, s),
}
CASES = [(name, "none") for name in ROUND_TRIPS] + [("int4", "k"), ("fp8", "kv"), ("nvfp4", "kv")]


@pytest.mark.parametrize("name,rotation", CASES)
def test_cache_round_trip_and_attention_match_primitives(name, rotation):
    options = {"group_size": 32} if name == "int4" else {}
    fmt = get_kv_format(name, rotate=rotation, **options)
    run = Scripted(fmt, tables=[[9, 2, 30, 5], [1, 17, 4]], seq_slots=[0, 1])
    for counts in ([7, 3], [1, 1], [1, 1], [5, 1]):  # prefill, decodes, a chunk across a block boundary
        meta, out = run.step(counts)
        keys, values = fmt.gather(run.cache, meta, torch.float32)
        tensor_scale = {p: float(run.cache.get(f"{p}_tensor_scale", torch.tensor(0.0))) for p in "kv"}
        row = 0
        for b in range(2):
            length = len(run.k[b])
            want_k = ROUND_TRIPS[name](torch.stack(run.k_rot[b]), tensor_scale["k"])
            want_v = ROUND_TRIPS[name](torch.stack(run.v_rot[b]), tensor_scale["v"])
            assert torch.equal(keys[b, :length], want_k) and torch.equal(values[b, :length], want_v)
            for pos in range(length - counts[b], length):  # every query of the step, causal context
                ref = attention64(run.q[b][pos], want_k[: pos + 1], want_v[: pos + 1], rotation)
                torch.testing.assert_close(out[row].double(), ref, atol=2e-5, rtol=1e-5)
                row += 1
    if name == "nvfp4":  # calibrated once, on the first write: later tokens reuse the scale
        first_k = torch.stack(run.k_rot[0][:7] + run.k_rot[1][:3])  # the prefill step's keys
        assert tensor_scale["k"] == pytest.approx(nvfp4_tensor_scale(first_k) * NVFP4_HEADROOM, rel=1e-6)


def test_nvfp4_calibrates_on_the_first_write_holding_a_non_zero_value():
    """A first write of zeros stores zeros at any scale; calibrating on it fixed the scale at the all-zero
    fallback (8.0), and later keys of ~0.05 came back with half their size lost. Reference: the primitives
    with the scale of the second write."""
    fmt = get_kv_format("nvfp4", rotate="none")
    cache = fmt.allocate(8, HKV, D, "cpu")
    fmt.store(cache, "k", torch.tensor([0]), torch.zeros(1, HKV, D))
    assert float(cache["k_tensor_scale"]) == 0.0  # still uncalibrated
    small = torch.randn(2, HKV, D, generator=torch.Generator().manual_seed(3)) * 0.02
    fmt.store(cache, "k", torch.tensor([1, 2]), small)
    scale = nvfp4_tensor_scale(small) * NVFP4_HEADROOM
    assert float(cache["k_tensor_scale"]) == pytest.approx(scale, rel=1e-6)
    stored = fmt.load(cache, "k", torch.tensor([0, 1, 2]), torch.float32)
    assert torch.equal(stored[0], torch.zeros(HKV, D))
    assert torch.equal(stored[1:], nvfp4_round_trip(small, float(cache["k_tensor_scale"])))
    assert (stored[1:] - small).norm() / small.norm() < 0.2


def test_rotation_leaves_attention_unchanged():
    outs = {}
    for rotation in ("none", "k", "kv"):
        fmt = get_kv_format("fp32", rotate=rotation)
        run = Scripted(fmt, tables=[[3, 0, 7], [5, 1]], seq_slots=[0, 1], seed=4)
        outs[rotation] = torch.cat([run.step(c)[1] for c in ([6, 2], [1, 1], [1, 1])])
    torch.testing.assert_close(outs["k"], outs["none"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["kv"], outs["none"], atol=1e-5, rtol=1e-5)


# ---- KV4 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_sink,n_recent", [(3, 5), (0, 4), (4, 0), (16, 128)])
def test_kv4_decode_side_rows_on_the_host_follow_the_formats_rules(n_sink, n_recent):
    """The host's numpy side rows of decode tokens (`decode_side_rows`) equal the torch rules: a row's new
    token at position p, read by a query at p, goes to `side_rows` when `is_protected(p, p)`, else -1."""
    fmt = get_kv_format("kv4", group_size=32, n_sink=n_sink, n_recent=n_recent)
    gen = torch.Generator().manual_seed(7)
    positions = torch.cat([torch.arange(40), torch.randint(0, 100_000, (200,), generator=gen)])
    slots = torch.randint(0, 256, (len(positions),), generator=gen)
    want = torch.where(fmt.is_protected(positions, positions), fmt.side_rows(slots, positions), -1)
    got = fmt.decode_side_rows(slots.numpy(), positions.numpy())
    assert got.dtype == np.int64 and np.array_equal(got, want.numpy())


def test_kv4_protected_positions_use_int8_and_the_rest_int4_as_the_window_slides():
    n_sink, n_recent = 3, 5
    fmt = get_kv_format("kv4", group_size=32, n_sink=n_sink, n_recent=n_recent)  # rotate: k by default
    assert fmt.rotate == "k"
    run = Scripted(fmt, tables=[[7, 2, 11, 5, 0, 9, 13], [3, 14, 1, 8, 12, 6]], seq_slots=[2, 0])
    # A's prefill exceeds the budget; then decodes, one multi-token chunk per sequence on top of cached
    # tokens (its early queries need ring rows the chunk overwrites), more decodes past block edges
    schedule = [[11, 2]] + [[1, 1]] * 5 + [[3, 6]] + [[1, 1]] * 6
    int8_used = int4_used = 0
    for counts in schedule:
        meta, out = run.step(counts)
        keys, values = fmt.gather(run.cache, meta, torch.float32)
        row = 0
        for b in range(2):
            copies_k = [kv4_copies(k) for k in run.k_rot[b]]
            copies_v = [kv4_copies(v) for v in run.v_rot[b]]
            length = len(copies_k)
            for p in range(length):  # the decode view after the step
                protected = p < n_sink or p >= length - n_recent
                int8_used += protected
                int4_used += not protected
                assert torch.equal(keys[b, p], copies_k[p][0 if protected else 1])
                assert torch.equal(values[b, p], copies_v[p][0 if protected else 1])
            for q in range(length - counts[b], length):  # each query picks per key
                pick = [0 if (p < n_sink or q - p < n_recent) else 1 for p in range(q + 1)]
                want_k = torch.stack([copies_k[p][c] for p, c in enumerate(pick)])
                want_v = torch.stack([copies_v[p][c] for p, c in enumerate(pick)])
                torch.testing.assert_close(out[row].double(), attention64(run.q[b][q], want_k, want_v, "k"),
                                           atol=2e-5, rtol=1e-5)
                row += 1
    assert int8_used and int4_used
    assert not torch.equal(*kv4_copies(run.k_rot[0][5]))  # the two paths really differ


def test_kv4_prefill_computes_what_token_by_token_decoding_does():
    # no rotation, so both caches quantize bit-identical inputs (a batched matmul may round differently)
    fmt = get_kv_format("kv4", group_size=32, n_sink=2, n_recent=4, rotate="none")
    whole = Scripted(fmt, tables=[[4, 1, 6, 3, 0]], seq_slots=[1], seed=7)
    _, out_whole = whole.step([19])
    stepped = Scripted(fmt, tables=[[2, 5, 7, 0, 1]], seq_slots=[0], seed=7)
    out_steps = torch.cat([stepped.step([1])[1] for _ in range(19)])
    torch.testing.assert_close(out_whole, out_steps, atol=1e-5, rtol=1e-5)
    meta_whole, _ = whole.step([1])
    meta_steps, _ = stepped.step([1])
    for a, b in zip(fmt.gather(whole.cache, meta_whole, torch.float32),
                    fmt.gather(stepped.cache, meta_steps, torch.float32)):
        assert torch.equal(a, b)


def test_bytes_per_token():
    bf16 = get_kv_format("bf16").bytes_per_token(8, 128)
    assert bf16 == 2 * 8 * 128 * 2
    assert get_kv_format("fp8").bytes_per_token(8, 128) == 2 * 8 * (128 + 4)
    assert get_kv_format("int4", group_size=32).bytes_per_token(8, 128) == 2 * 8 * (64 + 4 * 4)
    assert get_kv_format("nvfp4").bytes_per_token(8, 128) == 2 * 8 * (64 + 8)
    assert get_kv_format("mxfp4").bytes_per_token(8, 128) == 2 * 8 * (64 + 4)
    kv4 = get_kv_format("kv4").bytes_per_token(8, 128, 8192)  # 16 + 128 INT8 rows over 8192 tokens
    assert kv4 == pytest.approx(2 * 8 * (64 + 4 + (128 + 4) * 144 / 8192))
    assert kv4 / bf16 <= 0.30


@pytest.mark.parametrize("name", ["bf16", "fp32", "fp8", "int4", "kv4", "nvfp4", "mxfp4"])
def test_part_bytes_is_what_a_slot_allocates(name):
    """A format's byte cost per token and head (one of K or V) equals the bytes one more cache slot holds
    in its own allocation (per-sequence rows and per-layer scales excluded by the difference)."""
    fmt = get_kv_format(name, group_size=32) if name in ("int4", "kv4") else get_kv_format(name)

    def held(num_slots: int) -> int:
        cache = fmt.allocate(num_slots, 3, 64, torch.device("meta"), num_seq_slots=2)
        return sum(t.numel() * t.element_size() for t in cache.values())

    assert fmt.part_bytes(64) == (held(5) - held(4)) / (2 * 3)


def test_formats_name_their_decode_kernels_and_hand_them_their_tensors():
    from kv4rl.kernels.decode_common import DecodeKind

    formats = {name: get_kv_format(name, group_size=64) if name in ("int4", "kv4") else get_kv_format(name)
               for name in ("bf16", "fp32", "fp8", "int4", "kv4", "nvfp4", "mxfp4")}
    kinds = {name: fmt.decode_kind for name, fmt in formats.items()}
    assert kinds == {"bf16": DecodeKind.BF16, "fp32": None, "fp8": DecodeKind.FP8, "int4": DecodeKind.INT4,
                     "kv4": DecodeKind.INT4, "nvfp4": None, "mxfp4": None}
    problems = {name: fmt.fast_path_problem(64) for name, fmt in formats.items()}
    assert problems["bf16"] is problems["fp8"] is problems["int4"] is problems["kv4"] is None
    assert problems["mxfp4"] == "no decode kernel for KV format 'mxfp4' (kernels: bf16, fp8, int4, kv4)"
    assert "group_size must equal head_dim=128, got 64" in formats["int4"].fast_path_problem(128)
    for name, fmt in formats.items():
        if fmt.decode_kind is None:
            continue
        cache = fmt.allocate(4, 2, 64, "cpu", num_seq_slots=1)
        pages, scale, zero = fmt.paged_tensors(cache, "v")
        assert pages.shape[0] == 4 and (scale is None) == (name == "bf16") and (zero is None) != (name in ("int4", "kv4"))
        assert pages is cache["v" if name == "bf16" else "v_codes"]
        side = fmt.side_tensors(cache)
        assert (side is not None) == fmt.has_side_rows == (name == "kv4")
    kv4 = formats["kv4"]
    side = kv4.side_tensors(kv4.allocate(4, 2, 64, "cpu", num_seq_slots=3))
    assert side["k"].shape == (3 * kv4.budget, 2, 64) and (side["n_sink"], side["n_recent"]) == (16, 128)
    assert get_kv_format("kv4", n_sink=0, n_recent=0).has_side_rows is False


# ---- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("hd32")
    model = make_checkpoint(path, head_dim=D, max_position_embeddings=128)
    return path, model


def make_engine(path, fmt, dtype="float32", **kw):
    options = {"group_size": 32, "n_sink": 2, "n_recent": 6} | kw.pop("kv", {})
    config = EngineConfig(kv=KVConfig(format=fmt, block_size=BLOCK, **options),
                          max_model_len=kw.pop("max_model_len", 64),
                          num_kv_blocks=kw.pop("num_kv_blocks", None))
    return Engine(path, config, max_num_seqs=kw.pop("max_num_seqs", 8), device="cpu", dtype=dtype)


def prompts(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4", "kv4", "nvfp4", "mxfp4"])
def test_engine_generates_with_each_format_and_teacher_forcing_agrees(ckpt, fmt):
    path, _ = ckpt
    engine = make_engine(path, fmt)
    ps = prompts(5, seed=1)
    outs = engine.generate(ps, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in outs)
    logits = engine.score_tokens(ps, [c.token_ids for c in outs])
    agree = torch.cat([lg.argmax(-1) == torch.tensor(c.token_ids) for lg, c in zip(logits, outs)])
    assert agree.double().mean() >= 0.95  # greedy tokens are the argmax of the teacher-forced logits
    layers, kv_heads, seqs, budget = 2, 2, 8, 2 + 6
    per_head = {"bf16": 64, "fp8": 36, "int4": 20, "nvfp4": 18, "mxfp4": 17, "kv4": 20}[fmt]  # hand-counted
    # per layer: K and V pages; nvfp4's two fp32 tensor scales; kv4's INT8 rows (D codes + fp32 scale)
    extra = {"nvfp4": 2 * 4, "kv4": 2 * seqs * budget * kv_heads * (D + 4)}.get(fmt, 0)
    assert engine.pool_tokens == seqs * 64
    assert engine.pool_bytes == layers * (engine.pool_tokens * 2 * kv_heads * per_head + extra)
    reserve = 2 * kv_heads * (D + 4) * budget / 64 if fmt == "kv4" else 0  # spread over max_model_len
    assert engine.bytes_per_token == pytest.approx(layers * (2 * kv_heads * per_head + reserve))


def test_score_tokens_matches_transformers(ckpt):
    path, hf = ckpt
    engine = make_engine(path, "fp32", num_kv_blocks=12)  # small pool: scoring preempts and recomputes
    ps = prompts(6, seed=2)
    forced = prompts(6, seed=3)
    logits = engine.score_tokens(ps, forced)
    assert engine.num_preemptions > 0
    for p, f, got in zip(ps, forced, logits):
        with torch.no_grad():
            want = hf(torch.tensor([p + f])).logits[0, len(p) - 1 : -1]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_kv4_preemption_and_weight_update_keep_the_outputs(ckpt):
    path, hf = ckpt
    ps = prompts(6, seed=5)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    roomy = make_engine(path, "kv4", dtype=torch.float64)
    want = [c.token_ids for c in roomy.generate(ps, params)]
    tight = make_engine(path, "kv4", dtype=torch.float64, num_kv_blocks=24)
    assert [c.token_ids for c in tight.generate(ps, params)] == want
    assert tight.num_preemptions > 0
    carried = make_engine(path, "kv4", dtype=torch.float64)
    seqs = [carried.add_request(p, params) for p in ps]
    for _ in range(12):
        carried.step()
    carried.load_weights(hf.state_dict(), version=1)  # same weights: carried sequences just continue
    while carried.has_unfinished():
        carried.step()
    assert [s.output_ids for s in seqs] == want
    assert all(set(s.output_versions) == {0, 1} for s in seqs)


# ---- fidelity bench ------------------------------------------------------------------------------
def test_kl_and_top1_against_hand_computation():
    ref = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    other = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    p = ref.double().softmax(-1)
    q = other.double().softmax(-1)
    want = sum(p[0, i] * (p[0, i] / q[0, i]).log() for i in range(3))
    kl, agree = kl_and_top1(ref, other)
    assert kl[0].item() == pytest.approx(want.item(), rel=1e-12) and kl[1].item() == 0.0
    assert agree.tolist() == [False, True]


def test_fidelity_is_zero_for_the_reference_itself_and_positive_for_kv4(ckpt):
    path, _ = ckpt
    res = run_fidelity(path, prompts(4, seed=6), [Variant("fp32"), Variant("kv4", 2, 6)], reference="fp32",
                       kv=KVConfig(group_size=32, block_size=BLOCK), max_new_tokens=20, device="cpu",
                       dtype="float32", batch_size=3)
    same, kv4 = res["results"]
    assert same["kl_mean"] == 0.0 and same["top1_agree"] == 1.0 and same["num_positions"] == 80
    assert kv4["kl_mean"] > 0 and kv4["allocation"] == "2+6"
    assert set(same["kl_by_position"]) == {"0-15", "16-31"}
    assert kv4["bytes_per_token"] < same["bytes_per_token"]


def test_a_kv4_reference_takes_the_default_allocation_of_a_short_context(ckpt):
    """The engine's 16 + 128 protected rows exceed a short context, and nothing set the reference's: a kv4
    reference could never run there. It takes `default_allocation` of the context, and is then exactly itself."""
    from kv4rl.bench.fidelity import default_allocation

    path, _ = ckpt
    ps = prompts(2, seed=7)
    res = run_fidelity(path, ps, [Variant("kv4", *default_allocation(max(map(len, ps)) + 8))], reference="kv4",
                       kv=KVConfig(group_size=32, block_size=BLOCK), max_new_tokens=8, device="cpu",
                       dtype="float32", batch_size=2)
    (same,) = res["results"]
    assert res["reference_allocation"] == same["allocation"] and same["kl_mean"] == 0.0 and same["top1_agree"] == 1.0


def test_parse_allocations():
    assert parse_allocations("16+128, 0+144") == [(16, 128), (0, 144)]
    for bad in ("16-128", "a+1", "16+"):
        with pytest.raises(ValueError, match="--allocations"):
            parse_allocations(bad)


# ---- bad settings --------------------------------------------------------------------------------
def test_bad_settings_name_the_key(ckpt):
    path, _ = ckpt
    cases = [
        (lambda: KVConfig(format="int3").validate(), "engine.kv.format"),
        (lambda: KVConfig(format="int4", group_size=48).validate(), "engine.kv.group_size"),
        (lambda: KVConfig(format="kv4", n_sink=-1).validate(), "engine.kv.n_sink"),
        (lambda: EngineConfig(kv=KVConfig(format="kv4"), max_model_len=64).validate(), "engine.kv.n_sink"),
        (lambda: get_kv_format("fp8", rotate="q"), "engine.kv.rotate"),
        (lambda: get_kv_format("fp8", rotate="k").check(24, 64), "engine.kv.rotate"),
        (lambda: get_kv_format("nvfp4").check(24, 64), "engine.kv.format"),
        (lambda: make_engine(path, "int4", kv={"group_size": 64}), "engine.kv.group_size"),
        (lambda: make_engine(path, "kv4", kv={"n_sink": 16, "n_recent": 128}, max_model_len=None),
         "engine.kv.n_sink"),
    ]
    for build, key in cases:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            build()
    assert get_kv_format("fp8").check(24, 64) is None  # no rotation: any head_dim is fine


def test_int4_group_size_messages_say_what_fits_the_model():
    """A head_dim-64 model (SmolLM2, Llama-3.2-1B, Qwen2.5-0.5B) under the default group_size 128 was refused
    without saying which group sizes fit; at head_dim 256 the fallback reason asked for a group size the
    format refuses. Reference: the divisors of head_dim among the allowed group sizes, enumerated by hand."""
    from kv4rl.engine.kv_formats.int4 import check_group_size

    with pytest.raises(ValueError, match=r"head_dim=64: set engine.kv.group_size to 32 or 64 \(64 = head_dim"):
        check_group_size(128, 64)
    with pytest.raises(ValueError, match=r"head_dim=96: set engine.kv.group_size to 32$"):
        check_group_size(64, 96)
    with pytest.raises(ValueError, match="head_dim=40: no INT4 group size fits it"):
        check_group_size(32, 40)
    problem = get_kv_format("kv4", group_size=128).fast_path_problem(256)
    assert "group sizes stop at 128: head_dim=256 has no INT4 decode kernel" in problem
    assert "must equal" not in problem


def test_the_cuda_tiling_names_why_a_shape_falls_back():
    """The reason for a page of 8 tokens said 'not a power of two', which 8 is. Reference: the tiling's limits
    (head_dim 128, at most 8 query heads per KV head, pages of whole 16-token tiles)."""
    from kv4rl.kernels.cuda_source import tile_shape_problem

    assert tile_shape_problem(128, 8, 16) is None and tile_shape_problem(128, 1, 64) is None
    assert tile_shape_problem(64, 4, 16) == "head_dim 64 != 128"
    assert tile_shape_problem(128, 16, 16) == "16 query heads per KV head > 8"
    assert tile_shape_problem(128, 4, 8).startswith("block_size 8 is not a multiple of 16")
    assert tile_shape_problem(128, 4, 48).startswith("block_size 48 is not a power of two")
