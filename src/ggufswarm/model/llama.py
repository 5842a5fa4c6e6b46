"""Llama family (``llama`` GGUFs, Mistral-style included): pre-norm blocks, SwiGLU, RoPE on adjacent pairs."""

from __future__ import annotations

from typing import Any

from .blocks import prenorm_block as block
from .config import ModelConfig, base_hparams

ARCHITECTURES = ("llama",)


def config(meta: dict[str, Any], arch: str, n_vocab: int) -> ModelConfig:
    """Hyperparameters of a ``llama`` GGUF (llama.cpp ``LLM_ARCH_LLAMA``, ``LLAMA_ROPE_TYPE_NORM``)."""
    return ModelConfig(**base_hparams(meta, arch, n_vocab), rope_type="norm")


__all__ = ["ARCHITECTURES", "config", "block"]
