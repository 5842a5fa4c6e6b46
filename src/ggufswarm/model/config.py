"""Model hyperparameters read from GGUF metadata, shared by every architecture family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..artifact.accounting import MAX_CONTEXT


class UnsupportedArchitecture(ValueError):
    """The GGUF's ``general.architecture`` has no family module here."""


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts FFN settings, as llama.cpp reads them (``llama-model.cpp``) and applies them
    (``llm_graph_context::build_moe_ffn`` in ``src/llama-graph.cpp``).

    The router scores ``probs = gating(x @ ffn_gate_inp)`` (``"softmax"`` over the experts or ``"sigmoid"``
    per expert), picks the ``n_expert_used`` best (by ``probs + exp_probs_b`` when the layer has that
    selection bias; with ``n_groups > 1`` only among the ``n_group_used`` groups of consecutive experts
    whose two best scores sum highest, DeepSeek-V3's group-limited routing), weights each picked expert by its
    unbiased prob, divided by the picked probs' sum when
    ``weights_norm`` and multiplied by ``weights_scale`` when that is neither 0 nor 1. Blocks
    ``il < n_dense_lead`` have a dense FFN (``n_ff``) instead. ``n_expert_shared`` shared experts (one
    FFN of ``n_ff_shexp`` rows) are added to every token's MoE output.
    """

    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    gating: str = "softmax"  # "softmax" or "sigmoid" (llama.cpp expert_gating_func 1 / 2)
    weights_norm: bool = False
    weights_scale: float = 0.0  # 0 or 1: no scaling
    n_dense_lead: int = 0
    n_expert_shared: int = 0
    n_ff_shexp: int = 0
    n_groups: int = 0  # expert_group_count; 0 or 1: no groups
    n_group_used: int = 0  # expert_group_used_count


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, llama.cpp ``src/models/deepseek2.cpp``).

    Per token the cache holds the normed latent ``kv_lora_rank`` values and the RoPE'd shared key part
    ``rope_dim`` values (one "head" of ``kv_lora_rank + rope_dim``) instead of per-head keys and values.
    Queries have ``nope_dim + rope_dim`` values per head (via the ``q_lora_rank`` LoRA when it is non-zero);
    values are ``v_head_dim`` per head after ``attn_v_b``.
    """

    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling as ggml applies it (``rope_yarn`` in ``ggml/src/ggml-cpu/ops.cpp``,
    ``ggml_rope_yarn_corr_dims`` in ``ggml.c``): rotation pair ``j`` turns by
    ``pos * inv_freq_j * (freq_scale * (1 - mix_j) + mix_j)``, ``mix_j = ramp_j * ext_factor`` with ``ramp_j``
    falling from 1 to 0 between the correction dims of ``beta_fast`` and ``beta_slow`` for ``n_ctx_orig``;
    cos/sin are multiplied by ``magnitude``."""

    freq_scale: float  # 1 / rope.scaling.factor
    ext_factor: float
    beta_fast: float
    beta_slow: float
    n_ctx_orig: int
    magnitude: float


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
    rope_base: tuple[float, ...]  # per layer
    rope_scale: tuple[float, ...]  # per layer: positions are multiplied by this (1/linear factor)
    sliding_window: tuple[int, ...]  # per layer, 0 = full attention
    attn_scale: float  # multiplies q·k (usually 1/sqrt(head_dim))
    embed_scale: float = 1.0  # multiplies the token embedding (gemma: sqrt(n_embd))
    ffn_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3, gemma3: RMSNorm over head_dim on q and k
    post_norms: bool = False  # gemma: norm after attention and after the FFN
    final_logit_softcap: float = 0.0  # 0 = none
    rope_dim: int = 0  # dimensions RoPE rotates per head; 0 = head_dim
    moe: MoEConfig | None = None  # mixture-of-experts FFN (qwen3moe, deepseek2, ...)
    mla: MLAConfig | None = None  # multi-head latent attention (deepseek2)
    yarn: YarnConfig | None = None  # YaRN RoPE scaling (deepseek2); rope_scale is then 1

    @property
    def n_rot(self) -> int:
        """Dimensions RoPE rotates per head (llama.cpp ``n_rot``, ``rope.dimension_count``)."""
        return self.rope_dim or self.head_dim

    @property
    def cache_dims(self) -> tuple[int, int, int]:
        """``(n_head_kv, k_dim, v_dim)`` of one token's cache entry in one layer: the keys are
        ``[n_head_kv, k_dim]``, the values ``[n_head_kv, v_dim]``. MLA caches only the latent
        ``[1, kv_lora_rank + rope_dim]`` (as llama.cpp's K-only cache for it), no values."""
        if self.mla is not None:
            return 1, self.mla.kv_lora_rank + self.mla.rope_dim, 0
        return self.n_head_kv, self.head_dim, self.head_dim

    @property
    def max_length(self) -> int:
        """Longest session this model allows: min(trained context, 128K cap)."""
        return min(self.context_length, MAX_CONTEXT)

    def width_at(self, cut: int) -> int:
        """Values per token of the hidden states crossing a cut before block ``cut``: ``n_embd`` at every cut (as
        ``ShardModelInfo.width_at``, whose kimi-k3 grows)."""
        return self.n_embd


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


def base_hparams(meta: dict[str, Any], arch: str, n_vocab: int, yarn: bool = False) -> dict[str, Any]:
    """The hyperparameters every family reads the same way (llama.cpp ``llm_load_hparams``). With ``yarn``
    the family implements YaRN scaling itself (``yarn_factor`` below): its positions are not scaled here."""
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
    if scaling not in ("none", "linear") and factor > 0 and not (yarn and scaling == "yarn"):
        raise UnsupportedArchitecture(
            f"{arch}: RoPE scaling type {scaling!r} (factor {factor:g}) is not implemented "
            f"by the torch backend (it takes none and linear); use --backend llama.cpp"
        )
    scale = 1.0 / factor if scaling == "linear" and factor > 0 else 1.0
    return dict(
        arch=arch,
        n_layers=n_layers,
        n_embd=n_embd,
        n_ff=int(per_layer(meta_get(meta, arch, "feed_forward_length"), n_layers)[0]),
        n_head=int(n_head),
        n_head_kv=int(n_head_kv),
        head_dim=head_dim,
        n_vocab=n_vocab,
        rms_eps=float(meta_get(meta, arch, "attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(meta_get(meta, arch, "context_length", 4096)),
        rope_base=(rope_base,) * n_layers,
        rope_scale=(scale,) * n_layers,
        sliding_window=(0,) * n_layers,
        attn_scale=head_dim**-0.5,
    )


# llama.cpp's llama_expert_gating_func_type: 0 (none) means the architecture's default
EXPERT_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


def moe_hparams(
    meta: dict[str, Any],
    arch: str,
    *,
    default_gating: str = "softmax",
    weights_norm: bool | None = None,
    read_weights_scale: bool = True,
) -> MoEConfig:
    """The MoE settings of a GGUF (llama.cpp ``llama-model.cpp`` keys ``{arch}.expert_*``,
    ``leading_dense_block_count``). ``weights_norm`` fixes the normalisation where the architecture's graph
    does (qwen3moe: always; qwen2moe: never) instead of reading ``expert_weights_norm``; without
    ``read_weights_scale`` the weights are not scaled, as for the architectures whose llama.cpp hparams
    loader does not read ``expert_weights_scale`` (it stays 0 there).

    UnsupportedArchitecture for a gating function the torch backend does not implement or a per-layer expert
    count; ValueError for inconsistent counts.
    """
    n_expert = int(meta_get(meta, arch, "expert_count"))
    n_used = meta_get(meta, arch, "expert_used_count")
    if isinstance(n_used, list):
        if len(set(n_used)) != 1:
            raise UnsupportedArchitecture(
                f"{arch}: a per-layer expert_used_count is not implemented by the torch "
                f"backend; use --backend llama.cpp"
            )
        n_used = n_used[0]
    n_used = int(n_used)
    if not 0 < n_used <= n_expert:
        raise ValueError(f"{arch}: expert_used_count {n_used} must be in 1..expert_count {n_expert}")
    func = int(meta.get(f"{arch}.expert_gating_func", 0) or 0)
    gating = EXPERT_GATING_FUNCS.get(func, default_gating if func == 0 else None)
    if gating is None:
        raise UnsupportedArchitecture(
            f"{arch}: expert_gating_func {func} is not implemented by the torch backend "
            f"(it takes 1 softmax, 2 sigmoid); use --backend llama.cpp"
        )
    n_groups = int(meta.get(f"{arch}.expert_group_count", 0) or 0)
    n_group_used = int(meta.get(f"{arch}.expert_group_used_count", 0) or 0)
    if n_groups > 1 and not (n_expert % n_groups == 0 and n_expert // n_groups >= 2 and 0 < n_group_used < n_groups):
        raise ValueError(
            f"{arch}: {n_expert} experts in expert_group_count {n_groups} groups (at least 2 each), "
            f"expert_group_used_count {n_group_used} of them: inconsistent"
        )
    ff = meta.get(f"{arch}.feed_forward_length", 0)
    n_ff = int(max(ff) if isinstance(ff, list) else ff or 0)
    n_ff_exp = int(meta.get(f"{arch}.expert_feed_forward_length", 0) or 0) or (n_ff // n_used if n_ff else 0)
    n_shared = int(meta.get(f"{arch}.expert_shared_count", 0) or 0)
    n_ff_shexp = int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0) or n_ff_exp * n_shared
    return MoEConfig(
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=n_ff_exp,
        gating=gating,
        weights_norm=bool(meta.get(f"{arch}.expert_weights_norm", False)) if weights_norm is None else weights_norm,
        weights_scale=float(meta.get(f"{arch}.expert_weights_scale", 0.0) or 0.0) if read_weights_scale else 0.0,
        n_dense_lead=int(meta.get(f"{arch}.leading_dense_block_count", 0) or 0),
        n_expert_shared=n_shared,
        n_ff_shexp=n_ff_shexp,
        n_groups=n_groups if n_groups > 1 else 0,
        n_group_used=n_group_used if n_groups > 1 else 0,
    )
