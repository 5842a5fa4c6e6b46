"""Tiny random-weight GGUFs of every supported architecture, written with the ``gguf`` writer.

llama.cpp loads them (a small SentencePiece-style vocabulary is included), so the tests can
compare our shard executor against llama.cpp on architectures we cannot download.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, RopeScalingType, TokenType
from gguf.quants import quantize

N_VOCAB = 384


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    words = [
        "▁the",
        "▁a",
        "▁of",
        "▁and",
        "▁to",
        "▁in",
        "▁is",
        "▁it",
        "▁that",
        "▁was",
        "▁for",
        "▁on",
        "▁are",
        "▁with",
        "▁as",
        "▁I",
        "▁his",
        "▁they",
        "▁be",
        "▁at",
        "▁one",
        "▁have",
        "▁this",
        "▁from",
    ]
    letters = [f"▁{c}" for c in "abcdefghijklmnopqrstuvwxyz"] + list("abcdefghijklmnopqrstuvwxyz")
    pieces = list(dict.fromkeys(words + letters))  # unique: llama.cpp rejects duplicate tokens
    i = 0
    while len(tokens) < N_VOCAB:
        tokens.append(pieces[i] if i < len(pieces) else f"▁w{i}")
        types.append(TokenType.NORMAL)
        i += 1
    scores = [0.0] * 3 + [0.0] * 256 + [-float(j) for j in range(N_VOCAB - 259)]
    return tokens, scores, [int(t) for t in types]


def add_test_vocab(w: GGUFWriter) -> None:
    """The tests' SentencePiece-style ``llama`` vocabulary of ``N_VOCAB`` tokens (bos 1, eos 2, unk 0) into ``w``."""
    tokens, scores, types = _vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def _random_q4_k(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random but valid Q4_K blocks (144 bytes per 256 values): small finite f16 scales, random nibbles."""
    n_blocks = rows * cols // 256
    raw = rng.integers(0, 256, size=(n_blocks, 144), dtype=np.uint8)
    d = rng.uniform(0.001, 0.004, n_blocks).astype(np.float16)
    dmin = rng.uniform(0.0005, 0.002, n_blocks).astype(np.float16)
    raw[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    raw[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // 256 * 144)


def write_tiny_model(
    path: Path,
    arch: str,
    *,
    n_layers: int = 4,
    n_embd: int = 256,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 64,
    n_ff: int = 512,
    quant: bool = False,
    seed: int = 0,
    sliding_window: int = 0,
    split_max_tensors: int = 0,
    context_length: int = 4096,
    rope_linear_factor: float = 0.0,
    rope_freqs: bool = False,
    final_logit_softcap: float = 0.0,
    rope_scaling_style: str = "typed",
) -> Path:
    """Write a random-weight ``arch`` GGUF (``llama``, ``qwen2``, ``qwen3`` or ``gemma3``) to ``path``.

    With ``quant``, attention q/o projections are Q8_0 and FFN up/down are Q4_K; the rest is F32.
    With ``split_max_tensors``, writes a split set ``NAME-0000K-of-0000N.gguf`` and returns its first file.
    ``rope_linear_factor`` (> 0): ``{arch}.rope.scaling.type = linear`` and ``rope.scaling.factor``
    (``rope_scaling_style`` ``"typed"``), the factor alone (``"untyped"``: llama.cpp's type defaults to linear) or the
    legacy ``{arch}.rope.scale_linear`` (``"legacy"``), or the factor typed as YaRN (``"yarn"``);
    ``rope_freqs``: a llama 3.1-style ``rope_freqs.weight`` (``head_dim / 2`` frequency divisors, random in
    [1, 8), written last from their own generator); ``final_logit_softcap`` (> 0):
    ``{arch}.final_logit_softcapping``. The other weights are the same with or without these options.
    """
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_block_count(n_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if rope_linear_factor:
        if rope_scaling_style == "legacy":
            w.add_float32(f"{arch}.rope.scale_linear", rope_linear_factor)
        else:
            if rope_scaling_style in ("typed", "yarn"):
                w.add_rope_scaling_type(
                    RopeScalingType.LINEAR if rope_scaling_style == "typed" else RopeScalingType.YARN
                )
            w.add_rope_scaling_factor(rope_linear_factor)
    if final_logit_softcap:
        w.add_final_logit_softcapping(final_logit_softcap)
    w.add_file_type(1 if not quant else 7)
    if arch == "gemma3" and sliding_window:
        w.add_sliding_window(sliding_window)
    add_test_vocab(w)

    def f32(name: str, *shape: int, scale: float = 0.05, offset: float = 0.0) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale + offset).astype(np.float32))

    def matrix(name: str, rows: int, cols: int, qtype: QT | None = None) -> None:
        data = (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32)
        if qtype == QT.Q8_0:
            w.add_tensor(name, quantize(data, QT.Q8_0), raw_dtype=QT.Q8_0)
        elif qtype == QT.Q4_K:
            w.add_tensor(name, _random_q4_k(rng, rows, cols), raw_dtype=QT.Q4_K)
        else:
            w.add_tensor(name, data)

    f32("token_embd.weight", N_VOCAB, n_embd, scale=0.5)
    f32("output_norm.weight", n_embd, scale=0.1, offset=1.0)
    if arch != "gemma3":
        matrix("output.weight", N_VOCAB, n_embd)
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    for il in range(n_layers):
        p = f"blk.{il}."
        f32(p + "attn_norm.weight", n_embd, scale=0.1, offset=1.0)
        matrix(p + "attn_q.weight", q_dim, n_embd, QT.Q8_0 if quant else None)
        matrix(p + "attn_k.weight", kv_dim, n_embd)
        matrix(p + "attn_v.weight", kv_dim, n_embd)
        matrix(p + "attn_output.weight", n_embd, q_dim, QT.Q8_0 if quant else None)
        if arch == "qwen2":
            for n, d in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                f32(p + n + ".bias", d, scale=0.1)
        if arch in ("qwen3", "gemma3"):
            f32(p + "attn_q_norm.weight", head_dim, scale=0.1, offset=1.0)
            f32(p + "attn_k_norm.weight", head_dim, scale=0.1, offset=1.0)
        if arch == "gemma3":
            f32(p + "post_attention_norm.weight", n_embd, scale=0.1, offset=1.0)
            f32(p + "post_ffw_norm.weight", n_embd, scale=0.1, offset=1.0)
        f32(p + "ffn_norm.weight", n_embd, scale=0.1, offset=1.0)
        matrix(p + "ffn_gate.weight", n_ff, n_embd)
        matrix(p + "ffn_up.weight", n_ff, n_embd, QT.Q4_K if quant else None)
        matrix(p + "ffn_down.weight", n_embd, n_ff, QT.Q4_K if quant else None)
    if rope_freqs:
        factors = np.random.default_rng(seed + 1000).uniform(1.0, 8.0, head_dim // 2)
        w.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return sorted(path.parent.glob(path.stem + "-00001-of-*.gguf"))[0]
    return path
