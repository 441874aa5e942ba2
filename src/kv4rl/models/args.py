"""Architecture hyper-parameters read from a Hugging Face ``config.json``.

One frozen dataclass covers the supported families because they differ only in a few
switches: Qwen2 has biases on q/k/v, Qwen3 normalises q and k per head, Llama may carry biases on
all four attention projections, Mistral is Llama without them (and without a sliding window, where it
has one it is refused). Anything the decoder cannot reproduce exactly (sliding windows,
MLP biases, other activations, other RoPE variants) is rejected here, at load time, instead of
producing silently different log-probs from the learner's ``transformers`` model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# transformers' per-family defaults for keys a config.json may omit.
_DEFAULT_MAX_POSITIONS = {"qwen3": 32768, "qwen2": 32768, "llama": 2048, "mistral": 4096 * 32}
_MISTRAL_DEFAULT_SLIDING_WINDOW = 4096
# where config.json leaves num_key_value_heads out (null: as many as the query heads, in every family)
_DEFAULT_KV_HEADS = {"qwen3": 32, "qwen2": 32, "mistral": 8}
_QWEN3_DEFAULT_HEAD_DIM = 128
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True, slots=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else {"rope_type": "linear" | "llama3", <that type's parameters>}.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    model_type: str
    eos_token_id: int | tuple[int, ...] | None
    # Llama/Qwen3 `attention_bias` also puts a bias on o_proj; Qwen2's o_proj never has one.
    o_bias: bool = False

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return self.eos_token_id

    def with_stop_ids(self, extra: tuple[int, ...]) -> ModelArgs:
        """These args with `extra` EOS ids after the config's own, each id once, in order."""
        ids = tuple(dict.fromkeys(self.eos_token_ids + tuple(extra)))
        if ids == self.eos_token_ids:
            return self
        return replace(self, eos_token_id=ids[0] if len(ids) == 1 else ids)

    @staticmethod
    def parse_eos_ids(eos: Any) -> tuple[int, ...]:
        """An `eos_token_id` value (None, an int, or a list of ints) as a tuple of ids."""
        parsed = _parse_eos(eos)
        if parsed is None:
            return ()
        return (parsed,) if isinstance(parsed, int) else parsed

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArgs:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _reject_unsupported_features(config, model_type)
        missing = [
            key
            for key in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if config.get(key) is None
        ]
        if missing:
            raise ValueError(f"config.json lacks required keys: {', '.join(missing)}")
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        if "num_key_value_heads" in config:
            num_kv_heads = int(config["num_key_value_heads"] or num_heads)
        else:
            num_kv_heads = _DEFAULT_KV_HEADS.get(model_type, num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        head_dim = config.get("head_dim")
        if head_dim is None:
            head_dim = _QWEN3_DEFAULT_HEAD_DIM if model_type == "qwen3" else hidden_size // num_heads
        attention_bias = model_type != "mistral" and bool(config.get("attention_bias", False))
        rope_theta, rope_scaling = parse_rope(config)
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(
                config.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[model_type]
            ),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            qk_norm=model_type == "qwen3",
            model_type=model_type,
            eos_token_id=_parse_eos(config.get("eos_token_id")),
            o_bias=False if model_type == "qwen2" else attention_bias,
        )


def _reject_unsupported_features(config: dict[str, Any], model_type: str) -> None:
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"{model_type}: hidden_act {hidden_act!r} is not supported (only 'silu')")
    if config.get("mlp_bias"):
        raise ValueError(f"{model_type}: mlp_bias=true is not supported")
    if config.get("use_sliding_window"):
        raise ValueError(f"{model_type}: use_sliding_window=true is not supported")
    if model_type == "mistral":
        # transformers' Mistral attends within `sliding_window` tokens (4096 where config.json leaves it out);
        # the engine attends over the whole context, so a window shorter than the context is refused
        window = config.get("sliding_window", _MISTRAL_DEFAULT_SLIDING_WINDOW)
        context = config.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS["mistral"]
        if window is not None and window < context:
            raise ValueError(f"mistral: sliding_window={window} below max_position_embeddings={context} is not "
                             f"supported (the engine attends over the whole context)")


def parse_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either the transformers-5 ``rope_parameters`` dict or the older
    top-level ``rope_theta`` + ``rope_scaling`` pair, read with transformers' precedence where a config sets a
    value twice (the learner's model is transformers', so the engine must rotate as it does): a non-empty
    ``rope_scaling`` replaces ``rope_parameters``, the dict's own ``rope_theta`` wins over the top-level one, and
    llama3's top-level ``original_max_position_embeddings`` over the dict's."""
    source = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    given = config.get(source)
    if given is not None and not isinstance(given, dict):
        raise ValueError(f"{source} must be a dict, got {type(given).__name__}")
    params = dict(given or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta") or _DEFAULT_ROPE_THETA
    # Old configs spell the key "type"; transformers accepts both.
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    # refused wherever it is set: transformers moves a top-level one into the rope dict when it saves, so a
    # run that ignored it would be refused at its first resume
    partial = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial is not None and partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        # As transformers' model does: the top-level value first, then the dict's, then the context length.
        params["original_max_position_embeddings"] = config.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings") or config.get("max_position_embeddings")
    missing = [key for key in _ROPE_REQUIRED_KEYS[rope_type] if params.get(key) is None]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} lacks parameters: {', '.join(missing)}")
    scaling = {"rope_type": rope_type}
    scaling.update({key: params[key] for key in _ROPE_REQUIRED_KEYS[rope_type]})
    return float(theta), scaling


def _parse_eos(eos: Any) -> int | tuple[int, ...] | None:
    if eos is None or isinstance(eos, int):
        return eos
    if isinstance(eos, list | tuple) and all(isinstance(token, int) for token in eos):
        return tuple(eos)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
