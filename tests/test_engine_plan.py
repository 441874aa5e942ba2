"""The engine's start-up plan (`kv4rl.engine.plan`): every `auto` setting resolved, with its reason, for a
CUDA machine, a CPU and the Triton interpreter, from hand-written capabilities (no GPU needed)."""

import pytest
import torch

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.plan import Capabilities, make_plan
from kv4rl.models.args import ModelArgs

CUDA = Capabilities(device_type="cuda", triton=True, interpreter=False, int4_cuda_problem=None,
                    fp8_cuda_problem=None, fp8_matmul=True)
CPU = Capabilities(device_type="cpu", triton=True, interpreter=False, int4_cuda_problem="not a CUDA device",
                   fp8_cuda_problem="not a CUDA device", fp8_matmul=False)
INTERPRETER = Capabilities(device_type="cpu", triton=True, interpreter=True, int4_cuda_problem="not a CUDA device",
                           fp8_cuda_problem="not a CUDA device", fp8_matmul=False)
CUDA_NO_TRITON = Capabilities(device_type="cuda", triton=False, interpreter=False, int4_cuda_problem=None,
                              fp8_cuda_problem=None, fp8_matmul=True)


def _args(**overrides) -> ModelArgs:
    """Qwen3-8B's attention shape (32 query heads over 8 KV heads of 128), two small layers."""
    config = {"model_type": "qwen3", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "eos_token_id": 1}
    return ModelArgs.from_hf_config({**config, **overrides})


def _plan(caps, dtype=torch.bfloat16, args=None, max_num_seqs=4, **settings):
    kv = settings.pop("kv", {})
    return make_plan(EngineConfig(kv=KVConfig(**kv), **settings), args or _args(), dtype, caps, max_num_seqs)


def test_auto_settings_on_cuda_take_the_compiled_kernels():
    plan = _plan(CUDA, kv={"format": "kv4"})
    assert plan.fused_ops.value is True and "compiled Triton kernels on CUDA" in plan.fused_ops.reason
    assert plan.sampler.value == "triton" and plan.sampler.reason.startswith("engine.sampler=auto")
    assert plan.attention.value == "triton" and "kv4" in plan.attention.reason
    assert plan.body_kernel.value == "cuda"
    assert plan.cuda_graphs.value is True
    assert plan.pool_blocks.value is None and "gpu_memory_fraction=0.9" in plan.pool_blocks.reason
    assert plan.attention_desc == "attention: CUDA INT4 + Triton decode kernels (CUDA graphs) + fast prefill (CUDA graphs up to 512 tokens)"
    assert plan.kv_format_name.value == "kv4" and plan.kv_format.name == "kv4"
    assert plan.max_model_len.value == 4096 and "max_position_embeddings" in plan.max_model_len.reason
    assert plan.async_scheduling.value is True and plan.async_scheduling.reason.startswith("engine.async_scheduling=auto")


def test_async_scheduling_auto_is_on_only_for_one_cuda_engine_rank():
    assert _plan(CPU, dtype=torch.float32).async_scheduling.value is False
    assert _plan(INTERPRETER).async_scheduling.value is False
    tp = _plan(CUDA, tensor_parallel=2).async_scheduling
    assert tp.value is False and "tensor_parallel > 1" in tp.reason
    assert _plan(CUDA, async_scheduling=False).async_scheduling.value is False
    forced = _plan(CPU, dtype=torch.float32, async_scheduling=True).async_scheduling
    assert forced.value is True and forced.reason == "engine.async_scheduling=true"
    with pytest.raises(ValueError, match="async_scheduling.*tensor_parallel=2"):
        EngineConfig(async_scheduling=True, tensor_parallel=2).validate()
    with pytest.raises(ValueError, match="must be auto, true or false"):
        EngineConfig(async_scheduling="yes").validate()


def test_auto_settings_on_a_cpu_keep_the_reference_path():
    plan = _plan(CPU, dtype=torch.float32, max_num_seqs=3, max_model_len=40)
    assert plan.fused_ops.value is False and "no compiled kernels on cpu" in plan.fused_ops.reason
    assert plan.sampler.value == "torch"
    assert plan.kv_format_name.value == "fp32" and "float32" in plan.kv_format_name.reason
    assert plan.attention.value == "torch" and plan.attention.reason == "no CUDA device"
    assert plan.attention_desc == "attention: torch reference (no CUDA device)"
    assert plan.body_kernel.value is None and plan.cuda_graphs.value is False
    assert plan.pool_blocks.value == 3 * 3 and plan.pool_blocks.reason == "max_num_seqs x max_model_len"  # 40 -> 3 x 16
    assert plan.max_model_len.value == 40 and plan.max_model_len.reason == "engine.max_model_len"


def test_the_interpreter_runs_the_decode_kernels_but_never_the_auto_ones():
    plan = _plan(INTERPRETER, kv={"format": "kv4"})
    assert plan.fused_ops.value is False and "(Triton interpreter)" in plan.fused_ops.reason
    assert plan.sampler.value == "torch"
    assert plan.attention.value == "triton"
    assert plan.body_kernel.value == "triton" and "Triton interpreter" in plan.body_kernel.reason
    assert plan.cuda_graphs.value is False and "cpu" in plan.cuda_graphs.reason
    assert plan.attention_desc == "attention: Triton decode kernels (eager) + fast prefill"
    # explicit kernel settings may run in the interpreter
    explicit = _plan(INTERPRETER, fused_ops=True, sampler="triton")
    assert explicit.fused_ops.value is True and explicit.fused_ops.reason == "engine.fused_ops=true"
    assert explicit.sampler.value == "triton" and explicit.kv_format_name.value == "bf16"


@pytest.mark.parametrize("caps", [CPU, CUDA_NO_TRITON], ids=["cpu", "cuda-without-triton"])
@pytest.mark.parametrize("setting,message", [
    ({"fused_ops": True}, "engine.fused_ops=true cannot run here: it needs Triton and a CUDA device"),
    ({"sampler": "triton"}, "engine.sampler=triton cannot run here: it needs Triton and a CUDA device"),
])
def test_kernel_settings_fail_where_no_kernel_can_run(caps, setting, message):
    with pytest.raises(ValueError, match=message):
        _plan(caps, **setting)


@pytest.mark.parametrize("caps,kv,dtype,args,reason", [
    (CUDA_NO_TRITON, {"format": "bf16"}, torch.bfloat16, None, "Triton is not installed"),
    (CUDA, {"format": "nvfp4"}, torch.bfloat16, None,
     "no decode kernel for KV format 'nvfp4' (kernels: bf16, fp8, int4, kv4)"),
    (CUDA, {"format": "int4", "group_size": 64}, torch.bfloat16, None,
     "engine.kv.group_size must equal head_dim=128, got 64"),
    (CUDA, {"format": "bf16"}, torch.float16, None, "the kernels run bf16 models, this one is torch.float16"),
    (CUDA, {"format": "fp8"}, torch.bfloat16, {"head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2},
     "head_dim must be a power of two >= 32, got 16"),
])
def test_attention_falls_back_to_torch_and_says_why(caps, kv, dtype, args, reason):
    plan = _plan(caps, dtype=dtype, kv=kv, args=_args(**(args or {})))
    assert plan.attention.value == "torch" and reason in plan.attention.reason
    assert plan.cuda_graphs.value is False and plan.body_kernel.value is None
    assert plan.prefill.value == "torch" and plan.prefill.reason == f"no kernels: {plan.attention.reason}"
    with pytest.raises(ValueError) as refused:
        _plan(caps, dtype=dtype, kv=kv, args=_args(**(args or {})), attention_backend="triton")
    assert str(refused.value) == f"engine.attention_backend=triton cannot run here: {plan.attention.reason}"


def test_explicit_backend_and_graph_settings_are_kept_with_their_reason():
    plan = _plan(CUDA, kv={"format": "kv4"}, attention_backend="torch", cuda_graphs=True)
    assert plan.attention.value == "torch" and plan.attention.reason == "engine.attention_backend=torch"
    assert plan.cuda_graphs.value is False and plan.body_kernel.value is None
    plan = _plan(CUDA, kv={"format": "bf16"}, cuda_graphs=False, num_kv_blocks=7)
    assert plan.cuda_graphs.value is False and plan.cuda_graphs.reason == "engine.cuda_graphs=false"
    assert plan.attention_desc == "attention: Triton decode kernels (eager) + fast prefill"
    assert (plan.pool_blocks.value, plan.pool_blocks.reason) == (7, "engine.num_kv_blocks")


def test_prefill_graphs_need_the_fast_prefill_and_the_decode_graphs():
    plan = _plan(CUDA, kv={"format": "kv4"})  # on by default, up to 512 tokens
    assert plan.prefill_graphs.value == 512
    assert plan.attention_desc.endswith("fast prefill (CUDA graphs up to 512 tokens)")
    plan = _plan(CUDA, kv={"format": "kv4"}, prefill_graph_tokens=256)
    assert plan.attention_desc.endswith("fast prefill (CUDA graphs up to 256 tokens)")
    plan = _plan(CUDA, kv={"format": "kv4"}, prefill_graph_tokens=0)
    assert (plan.prefill_graphs.value, plan.prefill_graphs.reason) == (0, "engine.prefill_graph_tokens=0")
    assert plan.attention_desc.endswith("fast prefill")
    for settings in ({"cuda_graphs": False}, {"prefill_backend": "torch"}, {"attention_backend": "torch"}):
        plan = _plan(CUDA, kv={"format": "kv4"}, prefill_graph_tokens=512, **settings)
        assert plan.prefill_graphs.value == 0 and "decode graphs" in plan.prefill_graphs.reason
        assert "CUDA graphs up to" not in plan.attention_desc


@pytest.mark.parametrize("args,why", [
    ({"head_dim": 64}, "head_dim 64 != 128"),
    ({"num_key_value_heads": 2}, "16 query heads per KV head > 8"),
])
def test_int4_body_leaves_the_cuda_kernel_for_shapes_it_cannot_take(args, why):
    plan = _plan(CUDA, kv={"format": "kv4", "group_size": 64 if args.get("head_dim") == 64 else 128},
                 args=_args(**args))
    assert plan.attention.value == "triton"
    assert plan.body_kernel.value == "triton" and plan.body_kernel.reason == f"not CUDA: {why}"
    assert plan.attention_desc.startswith("attention: Triton decode kernels (CUDA graphs)")
    unable = Capabilities(device_type="cuda", triton=True, interpreter=False, fp8_matmul=True,
                          int4_cuda_problem="needs sm_80 or newer (mma.sync m16n8k16)", fp8_cuda_problem=None)
    reason = _plan(unable, kv={"format": "int4"}).body_kernel.reason
    assert reason == "not CUDA: needs sm_80 or newer (mma.sync m16n8k16)"


def test_fp8_body_takes_its_cuda_kernel_where_the_device_can_run_it():
    plan = _plan(CUDA, kv={"format": "fp8"})
    assert plan.body_kernel.value == "cuda" and plan.body_kernel.reason == "the CUDA kernel serves this shape"
    assert plan.attention_desc == "attention: CUDA FP8 + Triton decode kernels (CUDA graphs) + fast prefill (CUDA graphs up to 512 tokens)"
    ampere = Capabilities(device_type="cuda", triton=True, interpreter=False, fp8_matmul=False, int4_cuda_problem=None,
                          fp8_cuda_problem="needs sm_89 or newer (cvt.rn.f16x2.e4m3x2)")
    plan = _plan(ampere, kv={"format": "fp8"})
    assert plan.body_kernel.value == "triton"
    assert plan.body_kernel.reason == "not CUDA: needs sm_89 or newer (cvt.rn.f16x2.e4m3x2)"
    assert plan.attention_desc.startswith("attention: Triton decode kernels")
    assert _plan(ampere, kv={"format": "kv4"}).body_kernel.value == "cuda"  # INT4 bodies need only sm_80
    assert _plan(CUDA, kv={"format": "bf16"}).body_kernel.value is None


@pytest.mark.parametrize("merge", [False, True])
def test_fp8_weight_path_matches_the_built_model(monkeypatch, merge):
    """Two layers of q/k/v/o (multiples of 16) and gate/up/down (intermediate 40 is not): 8 of 14 linears
    take scaled_mm on an FP8 GPU in bf16; merged, gate|up (80 outputs) does too: 6 of 8. The plan, from
    the shapes alone, says what the swapped (and merged) model does."""
    from kv4rl.engine import fp8_linear
    from kv4rl.engine.fp8_weights import apply_fp8_weights, fp8_path
    from kv4rl.engine.merged_linears import merge_projections
    from kv4rl.models.decoder import Decoder

    args = _args(hidden_size=64, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    expected = (f"scaled_mm (Hopper) for {'6 of 8' if merge else '8 of 14'} linears, "
                "dequantized fallback for the rest")
    plan = _plan(CUDA, args=args, weight_format="fp8", merge_projections=merge, fp8_gemm="scaled_mm")
    assert plan.weights.value == "fp8" and plan.weights.reason == expected
    assert plan.weights_desc == f"fp8 weights: {expected}"
    assert plan.merge_projections.value is merge
    assert plan.merge_projections.reason.startswith(f"engine.merge_projections={str(merge).lower()}")
    model = Decoder(args, dtype=torch.bfloat16)
    apply_fp8_weights(model)
    if merge:
        merge_projections(model)
    monkeypatch.setattr(fp8_linear, "fp8_matmul_device", lambda device: True)  # as on an H200
    assert fp8_path(model, torch.bfloat16, torch.device("cpu")) == expected
    assert _plan(CUDA, args=args, weight_format="fp8", dtype=torch.float32).weights.reason == "dequantized fallback"
    assert _plan(CPU, args=args, weight_format="fp8").weights.reason == "dequantized fallback"
    assert _plan(CUDA, weight_format="fp8", fp8_gemm="scaled_mm").weights.reason == "scaled_mm (Hopper)"
    assert _plan(CUDA).weights_desc == "weights auto"
    # with the Triton decode GEMM (the default on CUDA) the model's linears report it once enabled
    triton = _plan(CUDA, args=args, weight_format="fp8", merge_projections=merge)
    assert triton.weights.reason == expected.replace("scaled_mm (Hopper)", fp8_linear.DECODE_GEMM_PATH, 1)
    from kv4rl.engine.fp8_weights import set_fused_quant

    set_fused_quant(model, decode_gemm=True)
    assert fp8_path(model, torch.bfloat16, torch.device("cpu")) == triton.weights.reason


def test_fp8_gemm_takes_triton_where_it_can_run():
    plan = _plan(CUDA, weight_format="fp8")
    assert plan.fp8_gemm.value == "triton" and plan.fp8_gemm.reason.startswith("engine.fp8_gemm=auto")
    assert plan.weights_desc == "fp8 weights: e4m3 GEMM (Triton) up to 128 tokens, scaled_mm (Hopper) above"
    assert _plan(CUDA).fp8_gemm.value is None  # no FP8 weights
    off = _plan(CUDA, weight_format="fp8", fused_ops=False).fp8_gemm
    assert off.value == "scaled_mm" and "engine.fused_ops is off" in off.reason
    assert _plan(CUDA, weight_format="fp8", dtype=torch.float32).fp8_gemm.value == "scaled_mm"
    assert _plan(CUDA, weight_format="fp8", fp8_gemm="scaled_mm").fp8_gemm.reason == "engine.fp8_gemm=scaled_mm"
    assert _plan(CUDA, weight_format="fp8", fp8_gemm="triton").fp8_gemm.value == "triton"
    with pytest.raises(ValueError, match="engine.fp8_gemm=triton cannot run here: engine.fused_ops is off"):
        _plan(CUDA, weight_format="fp8", fp8_gemm="triton", fused_ops=False)
    with pytest.raises(ValueError, match="engine.fp8_gemm=triton cannot run here: no FP8 tensor cores"):
        _plan(INTERPRETER, weight_format="fp8", fp8_gemm="triton", fused_ops=True)


def test_fused_fp8_quant_needs_both_fused_ops_and_fp8_weights():
    assert _plan(CUDA, weight_format="fp8").fused_fp8_quant is True
    assert _plan(CUDA).fused_fp8_quant is False
    assert _plan(CUDA, weight_format="fp8", fused_ops=False).fused_fp8_quant is False


def test_kv_format_checks_run_on_the_planned_format():
    with pytest.raises(ValueError, match="exceed the context limit engine.max_model_len=100"):
        _plan(CPU, kv={"format": "kv4", "n_sink": 16, "n_recent": 128}, max_model_len=100)


def test_explain_lists_every_decision_with_its_reason():
    plan = _plan(CUDA, kv={"format": "kv4"})
    text = plan.explain()
    for name, choice in plan.choices().items():
        assert f"{name}={choice.value} ({choice.reason})" in text
    assert len(plan.choices()) == 14


def test_prefill_backend_follows_the_decode_kernels_unless_set():
    """auto: the prefill kernel wherever decode rows run the kernels; torch keeps the reference prefill;
    triton fails where the decode kernels cannot run, naming why."""
    plan = _plan(CUDA, kv={"format": "kv4"})
    assert plan.prefill.value == "triton" and plan.prefill.reason.startswith("engine.prefill_backend=auto")
    plan = _plan(CUDA, kv={"format": "kv4"}, prefill_backend="torch")
    assert plan.prefill.value == "torch" and plan.attention.value == "triton"
    assert plan.attention_desc == "attention: CUDA INT4 + Triton decode kernels (CUDA graphs) + reference prefill"
    assert _plan(CUDA, attention_backend="torch").prefill.value == "torch"
    with pytest.raises(ValueError, match="engine.prefill_backend=triton cannot run here: .*no CUDA device"):
        _plan(CPU, dtype=torch.float32, prefill_backend="triton")
    assert "prefill=triton" in _plan(INTERPRETER, kv={"format": "bf16"}).explain()


@pytest.mark.parametrize("kv", ["bf16", "fp8", "int4", "kv4"])
def test_more_query_heads_per_kv_head_than_a_prefill_tile_holds_prefill_on_the_reference_path(kv):
    """66 query heads over one KV head started on the kernels and failed at the first prefill ("exceed
    BLOCK_M=64", QA); the plan now sends such a model's prefill to the reference path, or refuses a forced
    kernel at start. 64 per KV head (the smallest tile's M rows) keeps the kernel."""
    wide = _args(num_attention_heads=66, num_key_value_heads=1, head_dim=64, hidden_size=66 * 64)
    kv = {"format": kv, **({"group_size": 64} if kv in ("int4", "kv4") else {})}
    plan = _plan(CUDA, args=wide, kv=kv)
    assert plan.attention.value == "triton" and plan.prefill.value == "torch"
    assert plan.prefill.reason == "the prefill kernel holds up to 64 query heads per KV head in a tile, this model has 66"
    with pytest.raises(ValueError, match="engine.prefill_backend=triton cannot run here: the prefill kernel holds up to 64"):
        _plan(CUDA, args=wide, kv=kv, prefill_backend="triton")
    edge = _args(num_attention_heads=64, num_key_value_heads=1, head_dim=64, hidden_size=64 * 64)
    assert _plan(CUDA, args=edge, kv=kv).prefill.value == "triton"


def test_an_engine_refuses_a_context_past_the_models_positions_and_no_slots():
    """max_model_len=600 over 512 positions sized and printed a pool, then failed mid-generation indexing
    RoPE's table; max_num_seqs=0 built an empty pool and blamed engine.num_kv_blocks."""
    with pytest.raises(ValueError, match="engine.max_model_len=5000 exceeds the model's context of 4096"):
        _plan(CPU, max_model_len=5000)
    assert _plan(CPU, max_model_len=4096).max_model_len.value == 4096
    for bad in (0, -1):
        with pytest.raises(ValueError, match=r"max_num_seqs \(rollout.max_slots\) must be >= 1"):
            _plan(CPU, max_num_seqs=bad)


def test_the_pool_leaves_room_for_the_logits_every_captured_graph_keeps(monkeypatch):
    """The decode graphs' buckets share one float32 [slots, V] logits buffer and the prefill graphs' one
    [8, V] (each bucket kept its own before: 1.24 GiB at 256 slots and Qwen3's vocabulary, uncounted)."""
    from types import SimpleNamespace

    from kv4rl.engine import memory
    from kv4rl.engine.pool_profile import PoolProfile

    assert memory.graph_output_bytes(16, 128, 1000) == (16 + 8) * 1000 * 4
    assert memory.graph_output_bytes(256, 0, 151_936) == 256 * 151_936 * 4
    assert memory.graph_output_bytes(0, 0, 1000) == 0
    gib = 2**30
    monkeypatch.setattr(memory, "in_use_bytes", lambda device, scope: (100 * gib, 10 * gib))
    monkeypatch.setattr(memory, "measure_step_peak", lambda run, device: gib)
    args = _args()
    sizes = {}
    for graphs in (True, False):
        config = EngineConfig(kv=KVConfig(format="bf16"), max_model_len=4096, prefill_graph_tokens=128,
                              gpu_memory_fraction=0.12, cuda_graphs=graphs)
        plan = make_plan(config, args, torch.bfloat16, CUDA, 64)
        profile = PoolProfile(SimpleNamespace(args=args), plan, config, torch.device("cpu"), None)
        sizes[graphs] = profile.pool_blocks()
    held = memory.graph_output_bytes(64, 128, args.vocab_size)
    assert held == (64 + 8) * args.vocab_size * 4
    per_block = 2 * 2 * args.num_kv_heads * args.head_dim * 16 * args.num_layers  # K and V, bf16, 16 tokens
    room = int(0.12 * 100 * gib) - 10 * gib - gib  # below the cap of 64 x 4096 tokens
    assert sizes[False][0] == room // per_block
    assert sizes[True][0] == (room - held) // per_block < sizes[False][0]
    assert "CUDA graph outputs" in sizes[True][1] and "CUDA graph outputs" not in sizes[False][1]


def test_a_tensor_parallel_rank_whose_cap_is_not_the_pool_does_not_say_capped(monkeypatch):
    """Each rank labelled its own sizing 'capped' before the minimum over the ranks was taken: the start
    line said capped for a pool another rank's memory had made smaller."""
    from types import SimpleNamespace

    from kv4rl.engine import pool_profile

    sizing = "engine.gpu_memory_fraction=0.9 of 80 GiB" + pool_profile.CAPPED
    profile = SimpleNamespace(pool_blocks=lambda: (12, sizing))
    model = SimpleNamespace(tp=object())
    monkeypatch.setattr(pool_profile, "smallest_over", lambda tp, blocks, device: 5)
    blocks, text = pool_profile.memory_sized(profile, model, torch.device("cpu"))
    assert blocks == 5 and "capped" not in text and text.endswith("smallest over the TP ranks")
    monkeypatch.setattr(pool_profile, "smallest_over", lambda tp, blocks, device: blocks)  # this rank is the smallest
    blocks, text = pool_profile.memory_sized(profile, model, torch.device("cpu"))
    assert blocks == 12 and pool_profile.CAPPED in text
