"""Header-only GGUFs with the published shapes of DeepSeek-V4-Flash, GLM-5.2 and Ornith-1.0-397B, and the
``ggufswarm plan`` output the audits in this folder quote.

    .venv/bin/python docs/models/make_headers.py                 # all three models, Q4_K_M and Q8_0
    .venv/bin/python docs/models/make_headers.py --model glm-5.2 --recipe Q4_K_M --keep /tmp/headers

Each file holds the metadata and the tensor table a real conversion would have (``GGUFWriter`` header,
key/values and tensor infos; no tensor data, as ``tests/test_plan.py`` does), so a few hundred KiB
describe hundreds of GB. The tensor shapes follow the tensor-creation code of the architecture in
llama.cpp (the copy llama-cpp-python 0.3.36 vendors: ``src/models/deepseek4.cpp``, ``glm-dsa.cpp``,
``qwen35moe.cpp``); the numbers in them are the published configurations (sources in the audits).

The tensor types are what ``llama-quantize`` would pick for the two common file types, restated from
``src/llama-quant.cpp`` (``tensor_allows_quantization``, ``llama_tensor_get_type_impl``,
``tensor_type_fallback``), simplified to the rules that touch these models:

* only tensors of 2+ dimensions whose name ends in ``weight`` are quantized, and never ``*_norm.weight``,
  ``ffn_gate_inp.weight`` (routers), ``ffn_gate_tid2eid`` (DeepSeek-V4's I32 hash-routing table) or
  ``ssm_conv1d``; those keep the converter's type (F32 here; I32 for the routing table);
* Q8_0: every quantized tensor is Q8_0;
* Q4_K_M: Q4_K by default; ``output.weight`` Q6_K; ``attn_v`` / ``attn_qkv`` / ``attn_kv_b`` and every
  ``ffn_down*`` (dense, routed and shared experts alike) Q6_K on the "more bits" layers (the first and last
  eighth of the layers and every third one between, ``use_more_bits``), Q4_K elsewhere;
* a row length not divisible by the block size falls back (Q4_K to Q5_0, Q6_K to Q8_0, then F16).

Real published files often deviate (Unsloth "UD", ``-XL`` pins, MXFP4 experts): the audits say where.
``tests/test_model_audits.py`` checks that the numbers the audits quote are still what this prints.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q

from ggufswarm.cli import main as cli_main

GiB = 2 ** 30
MEMORIES = ("24GiB", "48GiB", "96GiB")
CONTEXT = 131072


@dataclass
class Model:
    """A model's GGUF: ``arch``, metadata ``kv`` (``{arch}.`` prefixed unless it starts with ``general.``),
    ``tensors`` as (name, ggml shape ``ne0, ne1, ...``, kind) where kind is ``float`` (converted to BF16 and
    quantizable), ``f32`` or ``i32`` (kept as is)."""

    key: str
    title: str
    arch: str
    n_layer_all: int
    kv: dict
    tensors: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)

    def add(self, name: str, *ne: int, kind: str | None = None) -> None:
        self.tensors.append((name, tuple(ne), kind or ("f32" if len(ne) == 1 else "float")))


# -- DeepSeek-V4-Flash (llama.cpp arch deepseek4) -------------------------------------------------------

def deepseek_v4_flash() -> Model:
    """43 blocks, n_embd 4096, hyper-connections x4, K-only attention of one 512-wide head (64 query heads),
    compress ratios 0,0 then 4/128 alternating, a lightning indexer (64 heads of 128) on the ratio-4 blocks,
    256 routed experts of 2048 (top 6) + 1 shared, the first 3 blocks hash-routed. The MTP block is not in the
    main GGUF (convert_hf_to_gguf writes it to a separate mtp-*.gguf)."""
    d, n_layer, vocab, heads, hd, q_rank, o_rank, o_groups = 4096, 43, 129280, 64, 512, 1024, 1024, 8
    hc, n_exp, n_used, ff_exp, idx_heads, idx_dim, n_hash = 4, 256, 6, 2048, 64, 128, 3
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, n_layer)]
    m = Model("deepseek-v4-flash", "DeepSeek-V4-Flash", "deepseek4", n_layer, {
        "general.name": "DeepSeek-V4-Flash (header only, published shapes)",
        "block_count": n_layer, "context_length": 1048576, "embedding_length": d,
        "attention.head_count": heads, "attention.head_count_kv": 1, "attention.key_length": hd,
        "attention.value_length": hd, "rope.dimension_count": 64, "attention.q_lora_rank": q_rank,
        "attention.sliding_window": 128, "attention.output_group_count": o_groups,
        "attention.output_lora_rank": o_rank, "attention.compress_ratios": ratios,
        "attention.indexer.head_count": idx_heads, "attention.indexer.key_length": idx_dim,
        "attention.indexer.top_k": 512, "hyper_connection.count": hc, "hash_layer_count": n_hash,
        "expert_count": n_exp, "expert_used_count": n_used, "expert_feed_forward_length": ff_exp,
        "expert_shared_count": 1})
    m.add("token_embd.weight", d, vocab)
    m.add("output_norm.weight", d)
    m.add("output.weight", d, vocab)
    m.add("output_hc_fn.weight", hc * d, hc, kind="f32")
    m.add("output_hc_base.weight", hc)
    m.add("output_hc_scale.weight", 1)
    mix = (2 + hc) * hc
    for i in range(n_layer):
        b = f"blk.{i}."
        m.add(b + "attn_norm.weight", d)
        m.add(b + "attn_sinks.weight", heads)
        m.add(b + "attn_q_a.weight", d, q_rank)
        m.add(b + "attn_q_a_norm.weight", q_rank)
        m.add(b + "attn_q_b.weight", q_rank, heads * hd)
        m.add(b + "attn_kv.weight", d, hd)
        m.add(b + "attn_kv_a_norm.weight", hd)
        m.add(b + "attn_output_a.weight", heads * hd // o_groups, o_rank * o_groups)
        m.add(b + "attn_output_b.weight", o_groups * o_rank, d)
        for part in ("attn", "ffn"):  # stored F32 by the converter; 2D ones are still quantizable by name
            m.add(b + f"hc_{part}_fn.weight", hc * d, mix)
            m.add(b + f"hc_{part}_base.weight", mix)
            m.add(b + f"hc_{part}_scale.weight", 3)
        r = ratios[i]
        if r:
            coff = 2 if r == 4 else 1
            m.add(b + "attn_compressor_kv.weight", d, coff * hd)
            m.add(b + "attn_compressor_gate.weight", d, coff * hd)
            m.add(b + "attn_compressor_ape.weight", coff * hd, r, kind="f32")
            m.add(b + "attn_compressor_norm.weight", hd)
            if r == 4:
                m.add(b + "indexer.proj.weight", d, idx_heads)
                m.add(b + "indexer.attn_q_b.weight", q_rank, idx_heads * idx_dim)
                m.add(b + "indexer_compressor_kv.weight", d, 2 * idx_dim)
                m.add(b + "indexer_compressor_gate.weight", d, 2 * idx_dim)
                m.add(b + "indexer_compressor_ape.weight", 2 * idx_dim, r, kind="f32")
                m.add(b + "indexer_compressor_norm.weight", idx_dim)
        m.add(b + "ffn_gate_inp.weight", d, n_exp, kind="f32")
        if i < n_hash:
            m.add(b + "ffn_gate_tid2eid.weight", n_used, vocab, kind="i32")
        else:
            m.add(b + "exp_probs_b.bias", n_exp)
        m.add(b + "ffn_norm.weight", d)
        m.add(b + "ffn_gate_exps.weight", d, ff_exp, n_exp)
        m.add(b + "ffn_up_exps.weight", d, ff_exp, n_exp)
        m.add(b + "ffn_down_exps.weight", ff_exp, d, n_exp)
        m.add(b + "ffn_gate_shexp.weight", d, ff_exp)
        m.add(b + "ffn_up_shexp.weight", d, ff_exp)
        m.add(b + "ffn_down_shexp.weight", ff_exp, d)
    return m


# -- GLM-5.2 (llama.cpp arch glm-dsa) -------------------------------------------------------------------

def glm_5_2() -> Model:
    """78 blocks + 1 MTP block, n_embd 6144, MLA (64 heads, q_lora 2048, kv_lora 512 + rope 64, qk 256 / v 256),
    DSA indexer (32 heads of 128, top 2048) with IndexShare: a full indexer on blocks 0, 1, 2, 6, 10, ..., 74
    (llama.cpp's GLM_5_2_DEFAULT_INDEXER_TYPES) and none on the blocks that reuse it; 3 dense blocks
    (12288), then 256 experts of 2048 (top 8) + 1 shared."""
    d, n_layer, vocab, heads, q_rank, kv_rank, rope, k_mla, v_mla = 6144, 78, 154880, 64, 2048, 512, 64, 256, 256
    n_exp, ff_exp, ff, idx_heads, idx_dim, n_dense = 256, 2048, 12288, 32, 128, 3
    full = [i < 2 or (i - 2) % 4 == 0 for i in range(n_layer)] + [True]  # + the MTP block (always full)
    m = Model("glm-5.2", "GLM-5.2", "glm-dsa", n_layer + 1, {
        "general.name": "GLM-5.2 (header only, published shapes)",
        "block_count": n_layer + 1, "nextn_predict_layers": 1, "context_length": 1048576, "embedding_length": d,
        "feed_forward_length": ff, "attention.head_count": heads, "attention.head_count_kv": 1,
        "attention.key_length": kv_rank + rope, "attention.value_length": kv_rank,
        "attention.key_length_mla": k_mla, "attention.value_length_mla": v_mla,
        "attention.q_lora_rank": q_rank, "attention.kv_lora_rank": kv_rank, "rope.dimension_count": rope,
        "attention.indexer.head_count": idx_heads, "attention.indexer.key_length": idx_dim,
        "attention.indexer.top_k": 2048, "leading_dense_block_count": n_dense, "expert_count": n_exp,
        "expert_used_count": 8, "expert_feed_forward_length": ff_exp, "expert_shared_count": 1})
    m.add("token_embd.weight", d, vocab)
    m.add("output_norm.weight", d)
    m.add("output.weight", d, vocab)
    for i in range(n_layer + 1):
        b = f"blk.{i}."
        m.add(b + "attn_norm.weight", d)
        m.add(b + "attn_q_a_norm.weight", q_rank)
        m.add(b + "attn_kv_a_norm.weight", kv_rank)
        m.add(b + "attn_q_a.weight", d, q_rank)
        m.add(b + "attn_q_b.weight", q_rank, heads * k_mla)
        m.add(b + "attn_kv_a_mqa.weight", d, kv_rank + rope)
        m.add(b + "attn_k_b.weight", k_mla - rope, kv_rank, heads)
        m.add(b + "attn_v_b.weight", kv_rank, v_mla, heads)
        m.add(b + "attn_output.weight", heads * v_mla, d)
        m.add(b + "ffn_norm.weight", d)
        if full[i]:
            m.add(b + "indexer.k_norm.weight", idx_dim)
            m.add(b + "indexer.k_norm.bias", idx_dim)
            m.add(b + "indexer.proj.weight", d, idx_heads, kind="f32")
            m.add(b + "indexer.attn_k.weight", d, idx_dim)
            m.add(b + "indexer.attn_q_b.weight", q_rank, idx_heads * idx_dim)
        if i < n_dense:
            m.add(b + "ffn_gate.weight", d, ff)
            m.add(b + "ffn_up.weight", d, ff)
            m.add(b + "ffn_down.weight", ff, d)
        else:
            m.add(b + "ffn_gate_inp.weight", d, n_exp, kind="f32")
            m.add(b + "exp_probs_b.bias", n_exp)
            m.add(b + "ffn_gate_exps.weight", d, ff_exp, n_exp)
            m.add(b + "ffn_up_exps.weight", d, ff_exp, n_exp)
            m.add(b + "ffn_down_exps.weight", ff_exp, d, n_exp)
            m.add(b + "ffn_gate_shexp.weight", d, ff_exp)
            m.add(b + "ffn_up_shexp.weight", d, ff_exp)
            m.add(b + "ffn_down_shexp.weight", ff_exp, d)
        if i == n_layer:
            m.add(b + "nextn.eh_proj.weight", 2 * d, d)
            m.add(b + "nextn.enorm.weight", d)
            m.add(b + "nextn.hnorm.weight", d)
            m.add(b + "nextn.shared_head_norm.weight", d)
    return m


# -- Ornith-1.0-397B (post-trained Qwen3.5-397B-A17B; llama.cpp arch qwen35moe) ------------------------

def ornith_397b() -> Model:
    """60 blocks, n_embd 4096; every 4th block gated full attention (32 heads, 2 KV heads of 256), the others
    gated delta net (16 key heads / 64 value heads of 128, conv kernel 4); 512 experts of 1024 (top 10) + a
    gated shared expert of 1024. No MTP block: the config declares one, but no route runs it."""
    d, n_layer, vocab, heads, kv_heads, hd = 4096, 60, 248320, 32, 2, 256
    n_exp, ff_exp, ff_sh, k_heads, v_heads, dk, conv = 512, 1024, 1024, 16, 64, 128, 4
    key_dim, value_dim = dk * k_heads, dk * v_heads
    m = Model("ornith", "Ornith-1.0-397B", "qwen35moe", n_layer, {
        "general.name": "Ornith-1.0-397B (header only, Qwen3.5-397B-A17B shapes)",
        "block_count": n_layer, "context_length": 262144, "embedding_length": d,
        "attention.head_count": heads, "attention.head_count_kv": kv_heads, "attention.key_length": hd,
        "attention.value_length": hd, "rope.dimension_count": 64, "full_attention_interval": 4,
        "ssm.conv_kernel": conv, "ssm.inner_size": value_dim, "ssm.state_size": dk, "ssm.group_count": k_heads,
        "ssm.time_step_rank": v_heads, "expert_count": n_exp, "expert_used_count": 10,
        "expert_feed_forward_length": ff_exp, "expert_shared_feed_forward_length": ff_sh})
    m.add("token_embd.weight", d, vocab)
    m.add("output_norm.weight", d)
    m.add("output.weight", d, vocab)
    for i in range(n_layer):
        b = f"blk.{i}."
        m.add(b + "attn_norm.weight", d)
        m.add(b + "post_attention_norm.weight", d)
        if (i + 1) % 4 == 0:
            m.add(b + "attn_q.weight", d, hd * heads * 2)  # query + output gate
            m.add(b + "attn_k.weight", d, hd * kv_heads)
            m.add(b + "attn_v.weight", d, hd * kv_heads)
            m.add(b + "attn_output.weight", hd * heads, d)
            m.add(b + "attn_q_norm.weight", hd)
            m.add(b + "attn_k_norm.weight", hd)
        else:
            m.add(b + "attn_qkv.weight", d, 2 * key_dim + value_dim)
            m.add(b + "attn_gate.weight", d, value_dim)
            m.add(b + "ssm_conv1d.weight", conv, 2 * key_dim + value_dim, kind="f32")
            m.add(b + "ssm_dt.bias", v_heads)
            m.add(b + "ssm_a", v_heads)
            m.add(b + "ssm_beta.weight", d, v_heads)
            m.add(b + "ssm_alpha.weight", d, v_heads)
            m.add(b + "ssm_norm.weight", dk)
            m.add(b + "ssm_out.weight", value_dim, d)
        m.add(b + "ffn_gate_inp.weight", d, n_exp, kind="f32")
        m.add(b + "ffn_gate_exps.weight", d, ff_exp, n_exp)
        m.add(b + "ffn_up_exps.weight", d, ff_exp, n_exp)
        m.add(b + "ffn_down_exps.weight", ff_exp, d, n_exp)
        m.add(b + "ffn_gate_inp_shexp.weight", d)
        m.add(b + "ffn_gate_shexp.weight", d, ff_sh)
        m.add(b + "ffn_up_shexp.weight", d, ff_sh)
        m.add(b + "ffn_down_shexp.weight", ff_sh, d)
    return m


MODELS = {f().key: f for f in (deepseek_v4_flash, glm_5_2, ornith_397b)}
RECIPES = ("Q4_K_M", "Q8_0")


# -- llama-quantize's type choice (see the module docstring) ---------------------------------------------

def _quantizable(name: str, ne: tuple[int, ...], kind: str) -> bool:
    return (kind != "i32" and len(ne) >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name and "ffn_gate_tid2eid" not in name and "ssm_conv1d" not in name)


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0, Q.Q5_K: Q.Q5_1}


def types_for(model: Model, recipe: str) -> list[Q]:
    """The tensor type of each of ``model.tensors`` in a ``recipe`` file."""
    n_wv = sum(1 for n, _, _ in model.tensors
               if any(s in n for s in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")))
    i_wv, out = 0, []
    for name, ne, kind in model.tensors:
        if not _quantizable(name, ne, kind):
            out.append({"i32": Q.I32}.get(kind, Q.F32))
            continue
        if recipe == "Q8_0":
            t = Q.Q8_0
        elif name == "output.weight":
            t = Q.Q6_K
        elif any(s in name for s in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")):
            t = Q.Q6_K if _more_bits(i_wv, n_wv) else Q.Q4_K
            i_wv += 1
        elif "ffn_down" in name:
            t = Q.Q6_K if _more_bits(int(name.split(".")[1]), model.n_layer_all) else Q.Q4_K
        else:
            t = Q.Q4_K
        if ne[0] % GGML_QUANT_SIZES[t][0]:
            t = _FALLBACK.get(t, Q.F16)
            if ne[0] % GGML_QUANT_SIZES[t][0]:
                t = Q.F16
        out.append(t)
    return out


def nbytes(ne: tuple[int, ...], t: Q) -> int:
    block, size = GGML_QUANT_SIZES[t]
    return int(np.prod(ne)) // block * size


def write_header(model: Model, recipe: str, path: Path) -> dict[str, tuple[Q, int]]:
    """Write ``model`` as a header-only ``recipe`` GGUF at ``path``; name -> (type, encoded bytes)."""
    w = GGUFWriter(str(path), model.arch)
    for key, value in model.kv.items():
        key = key if key.startswith("general.") else f"{model.arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, value)
    w.add_uint32("general.file_type", {"Q4_K_M": 15, "Q8_0": 7}[recipe])  # llama_ftype values
    out = {}
    for (name, ne, _), t in zip(model.tensors, types_for(model, recipe)):
        out[name] = (t, nbytes(ne, t))
        w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), out[name][1], raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return out


def kind_of(name: str) -> str:
    """A tensor kind for the type table: the name without ``blk.N.`` and the ``.weight``/``.bias`` suffix."""
    return re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")


def type_table(sizes: dict[str, tuple[Q, int]]) -> str:
    """Per tensor kind: the types used (with how many tensors) and the total bytes, largest kinds first."""
    kinds: dict[str, dict] = {}
    for name, (t, n) in sizes.items():
        k = kinds.setdefault(kind_of(name), {"types": {}, "bytes": 0})
        k["types"][t.name] = k["types"].get(t.name, 0) + 1
        k["bytes"] += n
    total = sum(k["bytes"] for k in kinds.values())
    rows = ["| tensor kind | type(s) (tensors) | GiB | share |", "|---|---|---:|---:|"]
    small = 0
    for kind, k in sorted(kinds.items(), key=lambda kv: -kv[1]["bytes"]):
        if k["bytes"] < total * 0.002:
            small += k["bytes"]
            continue
        types = ", ".join(f"{t} ({c})" for t, c in sorted(k["types"].items()))
        rows.append(f"| `{kind}` | {types} | {k['bytes'] / GiB:.2f} | {100 * k['bytes'] / total:.1f}% |")
    rows.append(f"| everything else (norms, biases, small projections) | F32 / quantized | {small / GiB:.2f} | "
                f"{100 * small / total:.1f}% |")
    rows.append(f"| **total** | | **{total / GiB:.2f}** ({total / 1e9:.1f} GB) | |")
    return "\n".join(rows)


def run_plan(*args: str) -> tuple[int, str]:
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = cli_main(["plan", *args])
    return rc, buf.getvalue() + err.getvalue()


def trimmed(text: str) -> str:
    """``plan``'s text without the per-block and per-tensor tables: the totals, boundary and placement."""
    keep, on = [], False
    for line in text.splitlines():
        if line.startswith(("architecture", "KV cache per token", "recurrent state", "boundary per",
                            "placement:", "nodes:", "wire bytes")) or "tensor table total" in line:
            on = line.startswith("placement:")
            keep.append(line.strip() if "tensor table total" in line else line)
        elif on and line.strip():
            keep.append(line)
    return "\n".join(keep)


def report(model: Model, recipe: str, out_dir: Path) -> str:
    path = out_dir / f"{model.key}-{recipe}.gguf"
    sizes = write_header(model, recipe, path)
    parts = [f"## {model.title} ({model.arch}), {recipe}: {path.name}, {path.stat().st_size:,} bytes on disk, "
             f"{sum(n for _, n in sizes.values()) / GiB:.2f} GiB of tensors described", "", type_table(sizes), ""]
    for mem in MEMORIES:
        rc, text = run_plan("--model", str(path), "--node-memory", mem, "--context", str(CONTEXT))
        parts += [f"### plan --node-memory {mem} --context {CONTEXT}" + ("" if rc == 0 else f" (exit {rc})"),
                  "```", trimmed(text) if rc == 0 else text.strip(), "```", ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), action="append", help="default: all")
    p.add_argument("--recipe", choices=RECIPES, action="append", help="default: all")
    p.add_argument("--keep", type=Path, help="write the headers here and keep them (default: a temp dir)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.keep or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        for key in args.model or MODELS:
            for recipe in args.recipe or RECIPES:
                print(report(MODELS[key](), recipe, out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
