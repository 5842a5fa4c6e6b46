"""Gemma 3 family: sandwich norms, GeGLU, q/k RMSNorm, interleaved sliding-window and global layers.

Reference: llama.cpp ``src/models/gemma3.cpp`` (graph) and ``src/llama-model.cpp`` (hparams).
GGUF norm weights already hold Gemma's ``1 + w`` (the converter adds 1), so norms are plain RMSNorm.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .blocks import StepTables, gated_ffn, rms_norm, self_attention
from .config import ModelConfig, base_hparams, meta_get

ARCHITECTURES = ("gemma3",)
SWA_PATTERN = 6  # every 6th layer is global, the other 5 use the sliding window
ROPE_BASE_SWA = 10000.0  # local layers' RoPE base (llama.cpp rope_freq_base_train_swa)


def config(meta: dict[str, Any], arch: str, n_vocab: int) -> ModelConfig:
    """Hyperparameters of a ``gemma3`` GGUF. Layer ``il`` is local when ``il % 6 < 5``."""
    hp = base_hparams(meta, arch, n_vocab)
    n = hp["n_layers"]
    window = int(meta_get(meta, arch, "attention.sliding_window", 0) or 0)
    local = [window > 0 and il % SWA_PATTERN < SWA_PATTERN - 1 for il in range(n)]
    hp["sliding_window"] = tuple(window if is_local else 0 for is_local in local)
    hp["rope_base"] = tuple(ROPE_BASE_SWA if is_local else hp["rope_base"][il] for il, is_local in enumerate(local))
    hp["rope_scale"] = tuple(1.0 if is_local else hp["rope_scale"][il] for il, is_local in enumerate(local))
    # Gemma 3 27B (62 layers) scales queries by 1/sqrt(n_embd/n_head); the others by 1/sqrt(head_dim).
    hp["attn_scale"] = (hp["n_embd"] / hp["n_head"]) ** -0.5 if n == 62 else hp["head_dim"] ** -0.5
    return ModelConfig(
        **hp,
        rope_type="neox",
        embed_scale=math.sqrt(hp["n_embd"]),
        ffn_act="gelu_tanh",
        qk_norm=True,
        post_norms=True,
        final_logit_softcap=float(meta.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
    )


def block(
    cfg: ModelConfig,
    il: int,
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    kv,
    positions: torch.Tensor,
    rope: StepTables,
) -> torch.Tensor:
    """``h = x + post_attn_norm(attn(norm(x))); out = h + post_ffw_norm(ffn(ffn_norm(h)))``; x ``[T, n_embd]``."""
    eps = cfg.rms_eps
    attn = self_attention(cfg, il, rms_norm(x, w["attn_norm"], eps), w, kv, positions, rope)
    h = x + rms_norm(attn, w["post_attention_norm"], eps)
    ffn = gated_ffn(rms_norm(h, w["ffn_norm"], eps), w, cfg.ffn_act)
    return h + rms_norm(ffn, w["post_ffw_norm"], eps)
