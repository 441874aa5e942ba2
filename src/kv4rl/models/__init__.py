"""The engine's own decoder (Qwen3 / Qwen2 / Llama) and its Hugging Face checkpoint loader."""

from kv4rl.models.args import ModelArgs
from kv4rl.models.decoder import AttentionFn, Decoder
from kv4rl.models.hf_weights import ModelFolderError, check_model_folder, load_model

__all__ = ["AttentionFn", "Decoder", "ModelArgs", "ModelFolderError", "check_model_folder", "load_model"]
