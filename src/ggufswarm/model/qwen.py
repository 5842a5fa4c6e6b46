"""Qwen family: ``qwen2`` (q/k/v biases) and ``qwen3`` (RMSNorm on q and k); NeoX RoPE, SwiGLU."""

from __future__ import annotations

from typing import Any

from .blocks import prenorm_block as block
from .config import ModelConfig, base_hparams

ARCHITECTURES = ("qwen2", "qwen3")


def config(meta: dict[str, Any], arch: str, n_vocab: int) -> ModelConfig:
    """Hyperparameters of a ``qwen2``/``qwen3`` GGUF (llama.cpp ``LLAMA_ROPE_TYPE_NEOX``)."""
    return ModelConfig(
        **base_hparams(meta, arch, n_vocab), rope_type="neox", qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3"
    )


__all__ = ["ARCHITECTURES", "config", "block"]
