"""A tiny random-weight Gemma 4 GGUF (llama.cpp arch ``gemma4``), written with the ``gguf`` writer.

llama.cpp's own ``test-llama-archs`` skips ``gemma4``, so this is our only loadable small one. The defaults follow
the layout of Gemma 4 31B (the "dense sizes"; 26B-A4B is the same with ``n_expert`` > 0), scaled down: every key
and tensor below is one llama.cpp reads in ``src/models/gemma4.cpp`` (``load_arch_hparams``, ``load_arch_tensors``)
as bundled with llama-cpp-python 0.3.36.

* 8 blocks; ``attention.sliding_window_pattern`` is a per-layer bool array (``layer_types`` of the HF config): the
  default ``swa_layers`` makes blocks 2, 5 and 7 full attention (the last one full, as in 31B), the others
  sliding-window (window 32).
* Different heads for the two kinds, as the real models (31B: 32 query heads; 16 KV heads of 256 on sliding-window
  blocks, 4 of 512 on full ones): sliding-window blocks 8 query heads of 32 with 4 KV heads
  (``attention.key_length_swa`` / ``value_length_swa``, ``rope.dimension_count_swa``, ``rope.freq_base_swa``), full
  blocks 8 query heads of 64 with 1 KV head (``attention.key_length`` / ``value_length``; ``attention.head_count_kv``
  is the per-layer array). Full blocks have no ``attn_v`` (``attention_k_eq_v``: V is K before its norm) and rotate a
  quarter of their head: ``rope_freqs`` holds ``head_dim_full / 2`` divisors, 1.0 for the rotated pairs and 1e30
  for the others ("proportional" RoPE, as ``convert_hf_to_gguf.py`` writes it); only full blocks use it.
* Per block: q/k norms, V RMS-normalised without weight, post-attention and post-FFN norms, GELU-gated FFN of 256,
  a scalar ``layer_output_scale``. Tied output head, ``final_logit_softcapping`` 30.
* ``embedding_length_per_layer_input`` 0 and ``attention.shared_kv_layers`` 0 (31B / 26B). ``n_embd_per_layer`` > 0
  writes E2B/E4B's per-layer token embeddings (``per_layer_token_embd``, ``per_layer_model_proj``,
  ``per_layer_proj_norm``, per block ``inp_gate`` / ``proj`` / ``post_norm``); ``shared_kv_layers`` > 0 makes the
  last blocks reuse the KV of earlier ones (no ``attn_k`` / ``attn_v`` / ``attn_k_norm`` of their own).

The vocabulary is ``tinymodels``' 384-token SentencePiece-style one; all weights F32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter
from tinymodels import N_VOCAB, add_test_vocab
from tinymoe import weight_writers

GEMMA4_DEFAULTS: dict[str, Any] = dict(
    n_embd=128,
    n_head=8,
    n_ff=256,
    swa_layers=(True, True, False, True, True, False, True, False),
    head_dim_swa=32,
    n_head_kv_swa=4,
    head_dim_full=64,
    n_head_kv_full=1,
    rotary_fraction_full=0.25,
    sliding_window=32,
    rope_freq_base=1_000_000.0,
    rope_freq_base_swa=10_000.0,
    rms_eps=1e-6,
    final_logit_softcap=30.0,
    context_length=4096,
    k_eq_v=True,
    layer_scale=True,
    n_embd_per_layer=0,
    shared_kv_layers=0,
    n_expert=0,
    n_expert_used=2,
    n_ff_exp=64,
)


def write_tiny_gemma4_model(path: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight ``gemma4`` GGUF to ``path`` and return ``path``; one block per entry of ``swa_layers``.

    ``overrides`` replace entries of ``GEMMA4_DEFAULTS`` (unknown names raise ``TypeError``). Tensors are F32, numpy
    shape ``(n_out, n_in)`` for matrices (ggml ``{n_in, n_out}``), ``(n_expert, n_out, n_in)`` for expert stacks.
    """
    cfg = dict(GEMMA4_DEFAULTS)
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise TypeError(f"unknown settings for gemma4: {sorted(unknown)}")
    cfg.update(overrides)
    swa = [bool(s) for s in cfg["swa_layers"]]
    n_layers = len(swa)
    e, n_head, hd_swa, hd_full = cfg["n_embd"], cfg["n_head"], cfg["head_dim_swa"], cfg["head_dim_full"]
    n_kv = [cfg["n_head_kv_swa"] if s else cfg["n_head_kv_full"] for s in swa]
    n_pl, n_shared = cfg["n_embd_per_layer"], cfg["shared_kv_layers"]
    arch = "gemma4"
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)

    def u32(key: str, value: int) -> None:
        w.add_uint32(f"{arch}.{key}", int(value))

    def f32k(key: str, value: float) -> None:
        w.add_float32(f"{arch}.{key}", float(value))

    w.add_block_count(n_layers)
    w.add_context_length(cfg["context_length"])
    w.add_embedding_length(e)
    w.add_feed_forward_length(cfg["n_ff"])
    w.add_head_count(n_head)
    w.add_array(f"{arch}.attention.head_count_kv", n_kv)
    u32("attention.key_length", hd_full)
    u32("attention.value_length", hd_full)
    u32("attention.key_length_swa", hd_swa)
    u32("attention.value_length_swa", hd_swa)
    u32("rope.dimension_count", hd_full)  # all of the head: the unrotated part is in rope_freqs
    u32("rope.dimension_count_swa", hd_swa)
    w.add_layer_norm_rms_eps(cfg["rms_eps"])
    w.add_rope_freq_base(cfg["rope_freq_base"])
    f32k("rope.freq_base_swa", cfg["rope_freq_base_swa"])
    u32("attention.sliding_window", cfg["sliding_window"])
    w.add_array(f"{arch}.attention.sliding_window_pattern", swa)
    u32("embedding_length_per_layer_input", n_pl)
    u32("attention.shared_kv_layers", n_shared)
    if cfg["final_logit_softcap"]:
        f32k("final_logit_softcapping", cfg["final_logit_softcap"])
    if cfg["n_expert"]:
        u32("expert_count", cfg["n_expert"])
        u32("expert_used_count", cfg["n_expert_used"])
        u32("expert_feed_forward_length", cfg["n_ff_exp"])
    w.add_file_type(0)  # all F32
    add_test_vocab(w)
    f32, norm, matrix = weight_writers(w, rng)
    f32("token_embd.weight", N_VOCAB, e, scale=0.5)
    norm("output_norm.weight", e)
    n_rot_pairs = int(hd_full * cfg["rotary_fraction_full"] / 2)
    freqs = [1.0] * n_rot_pairs + [1e30] * (hd_full // 2 - n_rot_pairs)
    w.add_tensor("rope_freqs.weight", np.asarray(freqs, dtype=np.float32))
    if n_pl:
        f32("per_layer_token_embd.weight", N_VOCAB, n_pl * n_layers, scale=0.5)
        matrix("per_layer_model_proj.weight", n_pl * n_layers, e)
        norm("per_layer_proj_norm.weight", n_pl)
    first_shared = n_layers - n_shared
    for il, is_swa in enumerate(swa):
        p = f"blk.{il}."
        hd = hd_swa if is_swa else hd_full
        norm(p + "attn_norm.weight", e)
        matrix(p + "attn_q.weight", n_head * hd, e)
        if il < first_shared:
            matrix(p + "attn_k.weight", n_kv[il] * hd, e)
            if is_swa or not cfg["k_eq_v"]:
                matrix(p + "attn_v.weight", n_kv[il] * hd, e)
            norm(p + "attn_k_norm.weight", hd)
        norm(p + "attn_q_norm.weight", hd)
        matrix(p + "attn_output.weight", e, n_head * hd)
        norm(p + "post_attention_norm.weight", e)
        norm(p + "ffn_norm.weight", e)
        matrix(p + "ffn_gate.weight", cfg["n_ff"], e)
        matrix(p + "ffn_up.weight", cfg["n_ff"], e)
        matrix(p + "ffn_down.weight", e, cfg["n_ff"])
        norm(p + "post_ffw_norm.weight", e)
        if cfg["n_expert"]:  # 26B-A4B: the dense FFN above is the shared expert
            n_x, f = cfg["n_expert"], cfg["n_ff_exp"]
            matrix(p + "ffn_gate_inp.weight", n_x, e, scale=2.0)
            norm(p + "ffn_gate_inp.scale", e)
            norm(p + "pre_ffw_norm_2.weight", e)
            norm(p + "post_ffw_norm_1.weight", e)
            norm(p + "post_ffw_norm_2.weight", e)
            matrix(p + "ffn_gate_up_exps.weight", n_x, 2 * f, e)
            matrix(p + "ffn_down_exps.weight", n_x, e, f)
            norm(p + "ffn_down_exps.scale", n_x)
        if n_pl:
            matrix(p + "inp_gate.weight", n_pl, e)
            matrix(p + "proj.weight", e, n_pl)
            norm(p + "post_norm.weight", e)
        if cfg["layer_scale"]:
            f32(p + "layer_output_scale.weight", 1, scale=0.1, offset=0.8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
