"""The engine's start-up decisions as data: every `auto` setting resolved, each with its reason.

`make_plan` is pure: from the engine config, the model's shape, its compute dtype and a `Capabilities`
record of the machine it builds a frozen `EnginePlan`, allocating and launching nothing. Only
`probe_capabilities` looks at the real device; tests write the record by hand (a CUDA machine, a CPU,
the Triton interpreter), so each decision is checked without a GPU. The runner carries the plan out
(`kv4rl.engine.runner`), and the start-up summary prints from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from kv4rl.engine.block_manager import blocks_needed
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.fp8_linear import MAX_DECODE_ROWS, describe_fp8_paths, scaled_mm_fits
from kv4rl.engine.kv_formats import KVFormat, kv_format_from_config
from kv4rl.kernels.decode_common import DecodeKind
from kv4rl.kernels import fp8_decode_cuda, int4_decode_cuda
from kv4rl.models.args import ModelArgs

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the machine offers the engine's kernels. `int4_cuda_problem` / `fp8_cuda_problem`: why the CUDA
    INT4 / FP8 decode kernel cannot run on the device whatever the shape (None: it can); `fp8_matmul`: FP8
    tensor-core products."""

    device_type: str
    triton: bool
    interpreter: bool
    int4_cuda_problem: str | None
    fp8_cuda_problem: str | None
    fp8_matmul: bool

    @property
    def kernels_compiled(self) -> bool:
        """Compiled kernels on a CUDA device: what the `auto` settings take (never the interpreter)."""
        return self.device_type == "cuda" and self.triton and not self.interpreter

    @property
    def kernels_usable(self) -> bool:
        """Kernels can run at all: Triton and a CUDA device, or the interpreter (on CPU tensors)."""
        return self.triton and (self.device_type == "cuda" or self.interpreter)


def probe_capabilities(device: torch.device) -> Capabilities:
    """The real device's capabilities (queries CUDA on a CUDA device)."""
    from kv4rl.engine.fp8_linear import fp8_matmul_device
    from kv4rl.kernels import interpreting, triton_importable
    from kv4rl.kernels import fp8_decode_cuda, int4_decode_cuda

    return Capabilities(device_type=device.type, triton=triton_importable(), interpreter=interpreting(),
                        int4_cuda_problem=int4_decode_cuda.device_problem(device),
                        fp8_cuda_problem=fp8_decode_cuda.device_problem(device), fp8_matmul=fp8_matmul_device(device))


@dataclass(frozen=True, slots=True)
class Choice(Generic[T]):
    """One decision: the value the engine runs with and why."""

    value: T
    reason: str


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """What the engine runs. `attention` is "triton" (decode rows through the kernels) or "torch";
    `prefill` the same for rows with several new tokens (the prefill kernel needs the decode kernels);
    `body_kernel` the INT4 or FP8 body's kernel on the Triton path ("cuda"/"triton", None for other formats);
    `pool_blocks` None means measured on the device by the runner."""

    kv_format: KVFormat
    kv_format_name: Choice[str]
    max_model_len: Choice[int]
    fused_ops: Choice[bool]
    sampler: Choice[str]
    attention: Choice[str]
    prefill: Choice[str]
    body_kernel: Choice[str | None]
    cuda_graphs: Choice[bool]
    prefill_graphs: Choice[int]
    weights: Choice[str]
    fp8_gemm: Choice[str | None]
    merge_projections: Choice[bool]
    async_scheduling: Choice[bool]
    pool_blocks: Choice[int | None]
    max_num_seqs: int

    @property
    def fused_fp8_quant(self) -> bool:
        """FP8 linears quantize their inputs in one Triton kernel (with fused ops only)."""
        return self.fused_ops.value and self.weights.value == "fp8"

    @property
    def attention_desc(self) -> str:
        if self.attention.value == "torch":
            return f"attention: torch reference ({self.attention.reason})"
        graphs = "CUDA graphs" if self.cuda_graphs.value else "eager"
        kernels = "Triton decode kernels"
        if self.body_kernel.value == "cuda":
            kernels = f"CUDA {self.kv_format.decode_kind.name} + {kernels}"
        prefill = "fast prefill" if self.prefill.value == "triton" else "reference prefill"
        if self.prefill_graphs.value:
            prefill += f" (CUDA graphs up to {self.prefill_graphs.value} tokens)"
        return f"attention: {kernels} ({graphs}) + {prefill}"

    @property
    def weights_desc(self) -> str:
        return f"fp8 weights: {self.weights.reason}" if self.weights.value == "fp8" else f"weights {self.weights.value}"

    def choices(self) -> dict[str, Choice]:
        return {name: getattr(self, name) for name in ("kv_format_name", "max_model_len", "fused_ops", "sampler",
                                                       "attention", "prefill", "body_kernel", "cuda_graphs", "prefill_graphs",
                                                       "weights", "fp8_gemm",
                                                       "merge_projections", "async_scheduling", "pool_blocks")}

    def explain(self) -> str:
        """Every decision with its reason, one `name=value (reason)` item each."""
        return "; ".join(f"{name}={c.value} ({c.reason})" for name, c in self.choices().items())


def make_plan(config: EngineConfig, args: ModelArgs, dtype: torch.dtype, caps: Capabilities,
              max_num_seqs: int) -> EnginePlan:
    """Resolve the engine's settings for this model and machine; raises ValueError, naming the setting,
    for one that cannot run here (checked in the order: fused ops, KV format, attention, sampler)."""
    fused_ops = _kernel_setting("engine.fused_ops", config.fused_ops, True, False, caps)
    kv_name = _kv_format_name(config, dtype)
    kv_format = kv_format_from_config(config.kv, kv_name.value)
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs (rollout.max_slots) must be >= 1, got {max_num_seqs}")
    if config.max_model_len and config.max_model_len > args.max_position_embeddings:  # RoPE has no rows past it
        raise ValueError(f"engine.max_model_len={config.max_model_len} exceeds the model's context of "
                         f"{args.max_position_embeddings} positions (max_position_embeddings)")
    max_model_len = (Choice(config.max_model_len, "engine.max_model_len") if config.max_model_len
                     else Choice(args.max_position_embeddings, "the model's max_position_embeddings"))
    kv_format.check(args.head_dim, max_model_len.value)
    attention = _attention(config, kv_format, dtype, args.head_dim, caps)
    sampler = _kernel_setting("engine.sampler", config.sampler, "triton", "torch", caps)
    on_kernels = attention.value == "triton"
    prefill, cuda_graphs = _prefill(config, attention, args), _cuda_graphs(config, on_kernels, caps)
    fp8_gemm = _fp8_gemm(config, fused_ops.value, dtype, caps)
    return EnginePlan(
        kv_format=kv_format, kv_format_name=kv_name, max_model_len=max_model_len, fused_ops=fused_ops,
        sampler=sampler, attention=attention, prefill=prefill, body_kernel=_body_kernel(on_kernels, kv_format, args, config, caps),
        cuda_graphs=cuda_graphs, prefill_graphs=_prefill_graphs(config, prefill, cuda_graphs), weights=_weights(config, args, dtype, caps, fp8_gemm.value == "triton"), fp8_gemm=fp8_gemm,
        merge_projections=_merge_projections(config), async_scheduling=_async_scheduling(config, caps),
        pool_blocks=_pool_blocks(config, caps, max_num_seqs, max_model_len.value), max_num_seqs=max_num_seqs,
    )


def check_kernel_settings(config: EngineConfig, caps: Capabilities) -> None:
    """Before any model loads: refuse a setting that asks for the Triton kernels where none can run (without
    the model, the rest of `make_plan`'s checks wait for the engine; these were refused there too, after the
    learner had loaded: minutes at 8B)."""
    for key, setting, on in (("engine.fused_ops", config.fused_ops, True),
                             ("engine.attention_backend", config.attention_backend, "triton"),
                             ("engine.prefill_backend", config.prefill_backend, "triton"),
                             ("engine.sampler", config.sampler, "triton"),
                             ("engine.fp8_gemm", config.fp8_gemm if config.weight_format == "fp8" else None, "triton")):
        _refuse_forced_kernels(key, setting, on, caps)


def _refuse_forced_kernels(key: str, setting, on, caps: Capabilities) -> None:
    if setting == on and not caps.kernels_usable:
        raise ValueError(f"{key}={str(on).lower()} cannot run here: it needs Triton and a CUDA device")


def _kernel_setting(key: str, setting, on, off, caps: Capabilities) -> Choice:
    """A setting whose `auto` takes the compiled kernels where they exist; `on` fails where none can run."""
    if setting == "auto":
        if caps.kernels_compiled:
            return Choice(on, f"{key}=auto: compiled Triton kernels on CUDA")
        return Choice(off, f"{key}=auto: no compiled kernels on {caps.device_type}" +
                      (" (Triton interpreter)" if caps.interpreter else ""))
    _refuse_forced_kernels(key, setting, on, caps)
    return Choice(setting, f"{key}={str(setting).lower()}")


def _kv_format_name(config: EngineConfig, dtype: torch.dtype) -> Choice[str]:
    if config.kv.format != "auto":
        return Choice(config.kv.format, f"engine.kv.format={config.kv.format}")
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    return Choice(name, f"engine.kv.format=auto: the model computes in {str(dtype).removeprefix('torch.')}")


def fast_path_problem(kv_format: KVFormat, dtype: torch.dtype, head_dim: int, caps: Capabilities) -> str | None:
    """Why the Triton decode path cannot serve this engine, or None when it can."""
    if caps.device_type != "cuda" and not caps.interpreter:
        return "no CUDA device"
    if not caps.triton:
        return "Triton is not installed"
    problem = kv_format.fast_path_problem(head_dim)
    if problem is not None:
        return problem
    if dtype != torch.bfloat16:
        return f"the kernels run bf16 models, this one is {dtype}"
    if head_dim < 32 or head_dim & (head_dim - 1):
        return f"head_dim must be a power of two >= 32, got {head_dim}"
    return None


def _attention(config: EngineConfig, kv_format: KVFormat, dtype: torch.dtype, head_dim: int,
               caps: Capabilities) -> Choice[str]:
    backend = config.attention_backend
    if backend == "torch":
        return Choice("torch", "engine.attention_backend=torch")
    problem = fast_path_problem(kv_format, dtype, head_dim, caps)
    if problem is None:
        return Choice("triton", f"engine.attention_backend={backend}: the decode kernels serve {kv_format.name}")
    if backend == "triton":
        raise ValueError(f"engine.attention_backend=triton cannot run here: {problem}")
    return Choice("torch", problem)


def _prefill(config: EngineConfig, attention: Choice[str], args: ModelArgs) -> Choice[str]:
    """The prefill kernel serves the formats and devices the decode kernels serve, for up to MAX_PREFILL_GROUP
    query heads per KV head (one query's heads share a tile)."""
    from kv4rl.kernels.prefill_plan import MAX_PREFILL_GROUP

    backend = config.prefill_backend
    if backend == "torch":
        return Choice("torch", "engine.prefill_backend=torch")
    group = args.num_heads // args.num_kv_heads
    if attention.value == "triton" and group > MAX_PREFILL_GROUP:
        problem = (f"the prefill kernel holds up to {MAX_PREFILL_GROUP} query heads per KV head in a tile, "
                   f"this model has {group}")
        if backend == "triton":
            raise ValueError(f"engine.prefill_backend=triton cannot run here: {problem}")
        return Choice("torch", problem)
    if attention.value == "triton":
        return Choice("triton", f"engine.prefill_backend={backend}: the varlen prefill kernel reads the cache as stored")
    if backend == "triton":
        raise ValueError(f"engine.prefill_backend=triton cannot run here: the decode kernels do not ({attention.reason})")
    return Choice("torch", f"no kernels: {attention.reason}")


def _body_kernel(on_kernels: bool, kv_format: KVFormat, args: ModelArgs, config: EngineConfig,
                 caps: Capabilities) -> Choice[str | None]:
    kind = kv_format.decode_kind
    if not on_kernels or kind not in (DecodeKind.INT4, DecodeKind.FP8):
        return Choice(None, "no INT4 or FP8 body on the decode kernels")
    module, problem = ((int4_decode_cuda, caps.int4_cuda_problem) if kind == DecodeKind.INT4
                       else (fp8_decode_cuda, caps.fp8_cuda_problem))
    kernel, why = module.body_kernel(problem, args.head_dim, args.num_heads // args.num_kv_heads, args.num_kv_heads,
                                     config.kv.block_size, interpreter=caps.interpreter)
    return Choice(kernel, "the CUDA kernel serves this shape" if why is None else f"not CUDA: {why}")


def _prefill_graphs(config: EngineConfig, prefill: Choice[str], cuda_graphs: Choice[bool]) -> Choice[int]:
    """The largest prefill (in new tokens) replayed as a CUDA graph; 0: prefills run eagerly."""
    if not config.prefill_graph_tokens:
        return Choice(0, "engine.prefill_graph_tokens=0")
    if prefill.value != "triton" or not cuda_graphs.value:
        return Choice(0, "prefill graphs replay the prefill kernel, with the decode graphs")
    return Choice(config.prefill_graph_tokens, "engine.prefill_graph_tokens: small prefills replay per token bucket")


def _cuda_graphs(config: EngineConfig, on_kernels: bool, caps: Capabilities) -> Choice[bool]:
    if not config.cuda_graphs:
        return Choice(False, "engine.cuda_graphs=false")
    if not on_kernels:
        return Choice(False, "graphs replay the decode kernels only")
    if caps.device_type != "cuda":
        return Choice(False, f"no graphs on {caps.device_type}")
    return Choice(True, "engine.cuda_graphs=true: decode steps replay per batch bucket")


def _fp8_gemm(config: EngineConfig, fused_ops: bool, dtype: torch.dtype, caps: Capabilities) -> Choice[str | None]:
    """The FP8 linears' product at decode sizes: the Triton e4m3 GEMM needs the Triton kernels on
    (`engine.fused_ops`), FP8 tensor cores and bf16 compute; `scaled_mm` otherwise."""
    if config.weight_format != "fp8":
        return Choice(None, f"engine.weight_format={config.weight_format}")
    if config.fp8_gemm == "scaled_mm":
        return Choice("scaled_mm", "engine.fp8_gemm=scaled_mm")
    problem = ("engine.fused_ops is off" if not fused_ops else "no FP8 tensor cores" if not caps.fp8_matmul
               else f"compute dtype {dtype}, not bfloat16" if dtype != torch.bfloat16 else None)
    if problem is None:
        return Choice("triton", f"engine.fp8_gemm={config.fp8_gemm}: up to {MAX_DECODE_ROWS} tokens")
    if config.fp8_gemm == "triton":
        raise ValueError(f"engine.fp8_gemm=triton cannot run here: {problem}")
    return Choice("scaled_mm", f"engine.fp8_gemm=auto: {problem}")


def _weights(config: EngineConfig, args: ModelArgs, dtype: torch.dtype, caps: Capabilities,
             decode_gemm: bool = False) -> Choice[str]:
    """`fp8`: the reason is the products its linears take (`fp8_weights.fp8_path` of the built model)."""
    if config.weight_format != "fp8":
        return Choice(config.weight_format, f"engine.weight_format={config.weight_format}")
    q_out, kv_out = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    hidden, inter = args.hidden_size, args.intermediate_size
    if config.merge_projections:  # q|k|v, o, gate|up, down
        per_layer = [(hidden, q_out + 2 * kv_out), (q_out, hidden), (hidden, 2 * inter), (inter, hidden)]
    else:
        per_layer = [(hidden, q_out), (hidden, kv_out), (hidden, kv_out), (q_out, hidden),  # q, k, v, o
                     (hidden, inter), (hidden, inter), (inter, hidden)]  # gate, up, down
    fast = sum(scaled_mm_fits(n_in, n_out, dtype, caps.fp8_matmul) for n_in, n_out in per_layer) * args.num_layers
    return Choice("fp8", describe_fp8_paths(fast, len(per_layer) * args.num_layers, decode_gemm and fast > 0))


def _merge_projections(config: EngineConfig) -> Choice[bool]:
    if config.merge_projections:
        return Choice(True, "engine.merge_projections=true: one GEMM for q|k|v and one for gate|up per layer")
    return Choice(False, "engine.merge_projections=false: seven GEMMs per layer")


def _async_scheduling(config: EngineConfig, caps: Capabilities) -> Choice[bool]:
    """`auto`: on a CUDA device with one engine rank, where the host's part of a step (2-4 ms at the
    Qwen3-1.7B shape) would otherwise leave the device idle: 1.23-2.09x tokens/s (bench/RESULTS.md, ninth
    session). Off on a CPU, where the host and the device are one."""
    setting = config.async_scheduling
    if setting != "auto":
        return Choice(setting, f"engine.async_scheduling={str(setting).lower()}")
    if caps.device_type != "cuda":
        return Choice(False, f"engine.async_scheduling=auto: no overlap to win on {caps.device_type}")
    if config.tensor_parallel > 1:
        return Choice(False, "engine.async_scheduling=auto: not with engine.tensor_parallel > 1 yet")
    return Choice(True, "engine.async_scheduling=auto: the next step launches before this one's tokens are read")


def _pool_blocks(config: EngineConfig, caps: Capabilities, max_num_seqs: int, max_model_len: int
                 ) -> Choice[int | None]:
    if config.num_kv_blocks is not None:
        return Choice(config.num_kv_blocks, "engine.num_kv_blocks")
    if caps.device_type != "cuda":
        return Choice(max_num_seqs * blocks_needed(max_model_len, config.kv.block_size), "max_num_seqs x max_model_len")
    return Choice(None, f"engine.gpu_memory_fraction={config.gpu_memory_fraction:g}, measured on the device")
