"""Model hyperparameters read from GGUF metadata, shared by every architecture family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_CONTEXT = 131072  # product hard cap on a session's max_length (128K tokens)


class UnsupportedArchitecture(ValueError):
    """The GGUF's ``general.architecture`` has no family module here."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder-only transformer, as llama.cpp reads them (``llama-model.cpp``).

    Per-layer lists have ``n_layers`` entries. ``rope_type`` is ``"norm"`` (rotate adjacent pairs,
    llama.cpp ``LLAMA_ROPE_TYPE_NORM``) or ``"neox"`` (rotate halves). ``sliding_window[il]`` is the
    window in tokens for a local-attention layer (a query at position p sees keys at
    ``p - window < k <= p``, llama.cpp ``LLAMA_SWA_TYPE_STANDARD``), or 0 for full attention.
    """

    arch: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    rms_eps: float
    context_length: int
    rope_type: str
    rope_base: tuple[float, ...]         # per layer
    rope_scale: tuple[float, ...]        # per layer: positions are multiplied by this (1/linear factor)
    sliding_window: tuple[int, ...]      # per layer, 0 = full attention
    attn_scale: float                    # multiplies q·k (usually 1/sqrt(head_dim))
    embed_scale: float = 1.0             # multiplies the token embedding (gemma: sqrt(n_embd))
    ffn_act: str = "silu"                # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qkv_bias: bool = False               # qwen2
    qk_norm: bool = False                # qwen3, gemma3: RMSNorm over head_dim on q and k
    post_norms: bool = False             # gemma: norm after attention and after the FFN
    final_logit_softcap: float = 0.0     # 0 = none

    @property
    def max_length(self) -> int:
        """Longest session this model allows: min(trained context, 128K cap)."""
        return min(self.context_length, MAX_CONTEXT)


def meta_get(meta: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    """``meta[f"{arch}.{key}"]``; KeyError naming the key when it is missing and no default is given."""
    full = f"{arch}.{key}"
    if full in meta:
        return meta[full]
    if default is None:
        raise KeyError(f"GGUF metadata lacks {full}")
    return default


def per_layer(value: Any, n_layers: int) -> list:
    """A scalar or a per-layer array from GGUF metadata as a list of ``n_layers`` values."""
    if isinstance(value, list):
        if len(value) != n_layers:
            raise ValueError(f"per-layer metadata has {len(value)} entries, model has {n_layers} layers")
        return list(value)
    return [value] * n_layers


def base_hparams(meta: dict[str, Any], arch: str, n_vocab: int) -> dict[str, Any]:
    """The hyperparameters every family reads the same way (llama.cpp ``llm_load_hparams``)."""
    n_layers = int(meta_get(meta, arch, "block_count"))
    n_embd = int(meta_get(meta, arch, "embedding_length"))
    n_head = per_layer(meta_get(meta, arch, "attention.head_count"), n_layers)[0]
    n_head_kv = per_layer(meta_get(meta, arch, "attention.head_count_kv", n_head), n_layers)[0]
    head_dim = int(meta_get(meta, arch, "attention.key_length", n_embd // n_head))
    rope_base = float(meta_get(meta, arch, "rope.freq_base", 10000.0))
    # as llama.cpp (llama-model.cpp): the type is linear when the key is absent, the factor falls back to the
    # legacy rope.scale_linear key, and an absent or 0 factor means none
    scaling = meta.get(f"{arch}.rope.scaling.type", "linear")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear", 0.0)) or 0.0)
    if scaling not in ("none", "linear") and factor > 0:
        raise UnsupportedArchitecture(f"{arch}: RoPE scaling type {scaling!r} (factor {factor:g}) is not implemented "
                                      f"by the torch backend (it takes none and linear); use --backend llama.cpp")
    scale = 1.0 / factor if scaling == "linear" and factor > 0 else 1.0
    return dict(
        arch=arch, n_layers=n_layers, n_embd=n_embd,
        n_ff=int(per_layer(meta_get(meta, arch, "feed_forward_length"), n_layers)[0]),
        n_head=int(n_head), n_head_kv=int(n_head_kv), head_dim=head_dim, n_vocab=n_vocab,
        rms_eps=float(meta_get(meta, arch, "attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(meta_get(meta, arch, "context_length", 4096)),
        rope_base=(rope_base,) * n_layers, rope_scale=(scale,) * n_layers,
        sliding_window=(0,) * n_layers, attn_scale=head_dim ** -0.5,
    )
