"""The rollout engine's own settings (the run config composes them under `engine`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True, slots=True)
class KVConfig:
    """How the paged KV cache stores keys and values.

    `format: auto` stores KV in the model's compute dtype (fp32 on CPU, bf16 on CUDA).
    """

    format: str = "auto"
    block_size: int = 16

    def validate(self) -> None:
        from kv4rl.engine.kv_formats import KV_FORMATS

        if self.format != "auto" and self.format not in KV_FORMATS:
            raise ValueError(
                f"engine.kv.format: unknown KV format '{self.format}' "
                f"(known: auto, {', '.join(sorted(KV_FORMATS))})"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"engine.kv.block_size must be a power of two, got {self.block_size}")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Capacity and backend of the rollout engine.

    `num_kv_blocks: null` sizes the pool so every slot can hold `max_model_len` tokens.
    """

    kv: KVConfig = field(default_factory=KVConfig)
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int = 16384
    attention_backend: Literal["auto", "torch"] = "auto"

    def validate(self) -> None:
        self.kv.validate()
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"engine.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("engine.max_num_batched_tokens must be >= 1")
