"""The rollout engine's own settings (the run config composes them under `engine`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args, get_type_hints


@dataclass(kw_only=True, slots=True)
class KVConfig:
    """How the paged KV cache stores keys and values (docs/kv-cache.md).

    `format: auto` stores KV in the model's compute dtype (fp32 on CPU, bf16 on CUDA); the others are
    bf16, fp32, fp8, int4, kv4, nvfp4, mxfp4. `group_size` applies to int4/kv4. `rotate: auto` means
    the format's default: `k` for kv4, `none` for the rest. `n_sink`/`n_recent` are kv4's INT8-protected
    positions per sequence. Checks that need the model (head_dim, context limit) run when the engine
    starts.
    """

    format: str = "auto"
    block_size: int = 16
    group_size: int = 128
    rotate: Literal["auto", "none", "k", "kv"] = "auto"
    n_sink: int = 16
    n_recent: int = 128

    def validate(self) -> None:
        from kv4rl.engine.kv_formats import KV_FORMATS, kv_format_from_config

        if self.format != "auto" and self.format not in KV_FORMATS:
            raise ValueError(
                f"engine.kv.format: unknown KV format '{self.format}' "
                f"(known: auto, {', '.join(sorted(KV_FORMATS))})"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"engine.kv.block_size must be a power of two, got {self.block_size}")
        if self.format != "auto":
            kv_format_from_config(self)  # option checks that need no model


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Capacity and backend of the rollout engine.

    `num_kv_blocks: null` sizes the pool from device memory on CUDA: what is left of
    `gpu_memory_fraction` of the device after the weights, the activation peak of the largest step and
    the CUDA graphs' logits buffers (float32 [max_num_seqs, vocab] for decode, [8, vocab] for prefill),
    at most enough for every slot to hold `max_model_len` tokens (on CPU: exactly that).
    `prefix_sharing` lets requests with the same prompt (a GRPO group) hold one copy of its KV blocks
    and skip its prefill (see the scheduler); off, every request prefills and holds its own prompt.
    `admit_siblings_together` (with prefix sharing) admits a queued group only when the free slots hold
    all of it (up to an eighth of the slots; a larger group enters in parts that size), so its
    requests fork one prefill even when slots free one at a time (partial rollout); off, each is
    admitted as a slot frees and prefills the prompt again.
    `attention_backend: auto` runs decode rows through the Triton kernels on CUDA when the KV format has
    them (bf16, fp8, int4 and kv4 with group_size = head_dim) and the torch reference path otherwise;
    `torch` forces the reference path, `triton` fails at start when the kernels cannot run.
    `cuda_graphs` replays decode steps as CUDA graphs (fast path only).
    `prefill_graph_tokens` > 0 also replays prefills of up to that many new tokens (and up to
    `prefill_graphs.MAX_ROWS` rows) as CUDA graphs, one per bucket of 64, 128, 256, ... tokens (with
    `cuda_graphs` and the fast prefill): an admitted prompt then costs the host one replay instead of
    some thirty launches a layer. Larger prefills run eagerly. 0: every prefill is eager.
    `prefill_backend: auto` runs the rows with several new tokens (prompts, prompt chunks, recomputes)
    through the Triton varlen prefill kernel whenever decode rows use the kernels, reading the cache as
    stored like the reference path; `torch` keeps the reference prefill (gather, dequantize, SDPA);
    `triton` fails at start when the kernels cannot run.
    `max_num_batched_tokens` caps the new tokens of one step. With `chunked_prefill` (default) a prompt
    that does not fit what is left after the step's decodes is split over several steps, its later chunks
    attending to the earlier ones through the cache; off, such a prompt waits, and one longer than the
    whole cap runs alone in a step.
    `sampler: triton` draws the tokens of untruncated batches (top-k off, top-p = 1) with a fused Triton
    Gumbel-max kernel, the same tokens as `torch` without its [B, V] noise tensors; truncated batches
    keep the torch path, and it fails at start off CUDA. `auto` (default): triton on CUDA, torch
    elsewhere (tests/gpu/test_sampling_kernel_gpu.py checks the tokens bit for bit on the GPU).
    `fused_ops` runs the model's norms (with the residual adds), q/k norm + RoPE and SiLU * up through
    fused Triton kernels (`kv4rl.models.fused`): per layer four launches instead of some sixty small
    ones, which dominate a CUDA-graph decode step of a small model; the eager ops are repeated in their
    dtypes, so only the norms' summation order differs. With `weight_format: fp8` it also quantizes each
    FP8 linear's input (scaled_mm path) in one Triton kernel (`kv4rl.kernels.fp8_quant`) instead of
    ~8 torch ones, with `quantize_fp8`'s codes and scales bit for bit; for q|k|v, gate|up and down that
    happens inside the norm or SwiGLU kernel before them (`kv4rl.models.fused.enable_fp8_inputs`). `true` fails at start off CUDA;
    `auto` (default) is on on CUDA and off elsewhere (bench/RESULTS.md has the speed-ups).
    `fp8_gemm` picks the FP8 linears' product at up to 128 tokens (decode steps, small prefills):
    `triton` the e4m3 x e4m3 Triton kernel with the weight as the tensor cores' wide operand
    (`kv4rl.kernels.fp8_weight_gemm`), `scaled_mm` cuBLAS's `torch._scaled_mm`; both compute the same
    function, and larger products always take `scaled_mm`. `auto` (default): triton where it can run
    (fused ops on, FP8 tensor cores, bf16), which the start line names.
    `merge_projections` (default on) runs each layer's q, k, v projections as one GEMM and gate, up as
    one, split after (`kv4rl.engine.merged_linears`, as vLLM does): fewer, larger products at decode
    sizes. The weights still load under their Hugging Face names (the merged rows are written in
    place, FP8 ones quantized per output channel as before); off, seven GEMMs per layer.
    `tensor_parallel: N` shards the model over N ranks of torch.distributed (started by torchrun):
    each holds 1/N of the heads, KV heads (and so of the KV pool, in any format) and MLP
    (`kv4rl.models.tensor_parallel`); consecutive blocks of N ranks form one engine.
    `sleep_between_rollouts` frees the KV pool and the decode CUDA graphs while the learner updates
    (engine and learner on one device) and allocates them again after the weight refresh
    (`Engine.sleep`/`Engine.wake`): a pool sized from memory is re-sized then, from what the learner
    leaves free. Unfinished responses lose their KV and are re-prefilled, so partial rollout needs
    `rollout.carry: recompute` with it. Off, a run's engine sizes its pool leaving free what the
    learner's update will allocate, measured by the learner at start (`Engine(reserve_bytes=...)`).
    `gpu_memory_scope` says whose memory counts as in use when the pool is sized: `device` (default)
    everything on the device, other processes included, so a pool never takes memory that is gone;
    `process` only this process's (torch's reserved bytes plus `memory.CONTEXT_ALLOWANCE` for its CUDA
    context and libraries), for several runs that share one device, each in its own
    `gpu_memory_fraction`, started together (`kv4rl train --seeds` sets it): with `device` the ones
    that start last see the others' memory as theirs and get no pool.
    `async_scheduling` launches the next step before the host reads this step's tokens whenever the
    batch continues (pure decode, nothing to admit, blocks free; requests that stop by length with this
    step's token left out), its input ids taken on the device, so the host's part of a step overlaps the
    device's (`kv4rl.engine.run_ahead`). The same
    tokens as without it; a stopped request is returned by `step` one call later. `auto` (default): on
    a CUDA device with `tensor_parallel = 1` (`kv4rl.engine.plan`); `true` is refused with
    `tensor_parallel > 1`.
    """

    kv: KVConfig = field(default_factory=KVConfig)
    weight_format: Literal["auto", "fp8"] = "auto"  # fp8: e4m3 block linears, re-quantized at each refresh
    fp8_gemm: Literal["auto", "triton", "scaled_mm"] = "auto"
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int = 16384
    gpu_memory_fraction: float = 0.9
    gpu_memory_scope: Literal["device", "process"] = "device"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    prefill_backend: Literal["auto", "torch", "triton"] = "auto"
    chunked_prefill: bool = True
    cuda_graphs: bool = True
    prefill_graph_tokens: int = 512
    sampler: Literal["auto", "torch", "triton"] = "auto"
    fused_ops: Literal["auto"] | bool = "auto"
    merge_projections: bool = True
    prefix_sharing: bool = True
    admit_siblings_together: bool = True
    tensor_parallel: int = 1
    sleep_between_rollouts: bool = False
    async_scheduling: Literal["auto"] | bool = "auto"

    def validate(self) -> None:
        self.kv.validate()
        hints = get_type_hints(EngineConfig)
        for key in ("weight_format", "fp8_gemm"):  # the config loader checks these; code building an
            allowed = get_args(hints[key])  # EngineConfig directly did not ("FP8" ran full precision)
            if getattr(self, key) not in allowed:
                raise ValueError(f"engine.{key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        if self.tensor_parallel < 1:
            raise ValueError(f"engine.tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.async_scheduling not in ("auto", True, False):
            raise ValueError(f"engine.async_scheduling must be auto, true or false, got {self.async_scheduling!r}")
        if self.async_scheduling is True and self.tensor_parallel > 1:
            raise ValueError("engine.async_scheduling runs one engine process ahead of its tokens; with "
                             f"engine.tensor_parallel={self.tensor_parallel} it is not supported yet: set one of them "
                             "back (async_scheduling=false or tensor_parallel=1)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"engine.max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv.format != "auto" and self.max_model_len is not None:
            from kv4rl.engine.kv_formats import kv_format_from_config

            kv_format_from_config(self.kv).check(head_dim=None, max_model_len=self.max_model_len)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"engine.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"engine.prefill_graph_tokens must be >= 0 (0: eager prefill), got {self.prefill_graph_tokens}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("engine.max_num_batched_tokens must be >= 1")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"engine.gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
