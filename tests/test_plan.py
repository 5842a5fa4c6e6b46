"""``ggufswarm plan`` and header-only accounting on synthetic GGUF headers (issue 12, items 3 and 4).

The GGUFs here are written header-only: ``GGUFWriter`` writes the metadata and the tensor table
(``write_header_to_file`` + ``write_kv_data_to_file`` + ``write_ti_data_to_file``) and never the tensor
data, so a file of a few hundred KiB describes hundreds of GB of tensors, as a real model's header does.
Shapes follow the published configurations: DeepSeek-V3 (``deepseek2`` in llama.cpp: 61 blocks, n_embd
7168, MLA with kv_lora_rank 512 + rope 64, 256 experts of 2048, the first 3 blocks dense, one shared
expert), GLM-4.5 (``glm4moe``: 92 blocks + 1 MTP block, n_embd 5120, 96 heads / 8 KV heads of 128,
160 experts of 1536, the first 3 dense) and a Qwen3-Next-class hybrid (gated delta net blocks with
recurrent state, every 4th block full attention).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from identities import signed_ad

from ggufswarm.artifact.accounting import HeaderAccounts
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.cli import main

GiB = 2**30


def nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def write_header_only(
    path: Path, arch: str, kv: dict, tensors: list[tuple[str, tuple[int, ...], Q]], split_max_tensors: int = 0
) -> dict[str, int]:
    """A GGUF with metadata ``kv`` (``{arch}.`` prefixed unless the key has a dot) and the tensor table of
    ``tensors`` (name, numpy-order shape, type), without tensor data. Returns name → encoded bytes."""
    w = GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    for key, value in kv.items():
        key = key if key.startswith("general.") else f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, value)
    sizes = {}
    for name, shape, qtype in tensors:
        sizes[name] = nbytes(shape, qtype)
        w.add_tensor_info(name, shape, np.dtype(np.float32), sizes[name], raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return sizes


def deepseek_v3(path: Path, **writer) -> dict[str, int]:
    d, n_layers, vocab, heads = 7168, 61, 129280, 128
    t = [
        ("token_embd.weight", (vocab, d), Q.Q4_K),
        ("output_norm.weight", (d,), Q.F32),
        ("output.weight", (vocab, d), Q.Q6_K),
    ]
    for i in range(n_layers):
        b = f"blk.{i}."
        t += [
            (b + "attn_norm.weight", (d,), Q.F32),
            (b + "attn_q_a_norm.weight", (1536,), Q.F32),
            (b + "attn_q_a.weight", (1536, d), Q.Q4_K),
            (b + "attn_q_b.weight", (heads * 192, 1536), Q.Q4_K),
            (b + "attn_kv_a_mqa.weight", (512 + 64, d), Q.Q4_K),
            (b + "attn_kv_a_norm.weight", (512,), Q.F32),
            (b + "attn_kv_b.weight", (heads * 256, 512), Q.Q4_K),
            (b + "attn_output.weight", (d, heads * 128), Q.Q4_K),
            (b + "ffn_norm.weight", (d,), Q.F32),
        ]
        if i < 3:
            t += [
                (b + "ffn_gate.weight", (18432, d), Q.Q4_K),
                (b + "ffn_up.weight", (18432, d), Q.Q4_K),
                (b + "ffn_down.weight", (d, 18432), Q.Q6_K),
            ]
        else:
            t += [
                (b + "ffn_gate_inp.weight", (256, d), Q.F32),
                (b + "exp_probs_b.bias", (256,), Q.F32),
                (b + "ffn_gate_exps.weight", (256, 2048, d), Q.Q4_K),
                (b + "ffn_up_exps.weight", (256, 2048, d), Q.Q4_K),
                (b + "ffn_down_exps.weight", (256, d, 2048), Q.Q6_K),
                (b + "ffn_gate_shexp.weight", (2048, d), Q.Q4_K),
                (b + "ffn_up_shexp.weight", (2048, d), Q.Q4_K),
                (b + "ffn_down_shexp.weight", (d, 2048), Q.Q6_K),
            ]
    kv = {
        "general.name": "DeepSeek-V3-class (synthetic header)",
        "block_count": n_layers,
        "context_length": 163840,
        "embedding_length": d,
        "feed_forward_length": 18432,
        "attention.head_count": heads,
        "attention.head_count_kv": heads,
        "attention.key_length": 192,
        "attention.value_length": 128,
        "attention.q_lora_rank": 1536,
        "attention.kv_lora_rank": 512,
        "rope.dimension_count": 64,
        "leading_dense_block_count": 3,
        "expert_count": 256,
        "expert_used_count": 8,
        "expert_feed_forward_length": 2048,
        "expert_shared_count": 1,
    }
    return write_header_only(path, "deepseek2", kv, t, **writer)


def glm45(path: Path) -> dict[str, int]:
    d, n_layers, vocab = 5120, 92, 151552
    t = [
        ("token_embd.weight", (vocab, d), Q.Q4_K),
        ("output_norm.weight", (d,), Q.F32),
        ("output.weight", (vocab, d), Q.Q6_K),
    ]
    for i in range(n_layers + 1):  # + the MTP (nextn) block
        b = f"blk.{i}."
        t += [
            (b + "attn_norm.weight", (d,), Q.F32),
            (b + "attn_q.weight", (96 * 128, d), Q.Q4_K),
            (b + "attn_k.weight", (8 * 128, d), Q.Q4_K),
            (b + "attn_v.weight", (8 * 128, d), Q.Q4_K),
            (b + "attn_output.weight", (d, 96 * 128), Q.Q4_K),
            (b + "post_attention_norm.weight", (d,), Q.F32),
        ]
        if i < 3:
            t += [
                (b + "ffn_gate.weight", (12288, d), Q.Q4_K),
                (b + "ffn_up.weight", (12288, d), Q.Q4_K),
                (b + "ffn_down.weight", (d, 12288), Q.Q6_K),
            ]
        else:
            t += [
                (b + "ffn_gate_inp.weight", (160, d), Q.F32),
                (b + "ffn_gate_exps.weight", (160, 1536, d), Q.Q4_K),
                (b + "ffn_up_exps.weight", (160, 1536, d), Q.Q4_K),
                (b + "ffn_down_exps.weight", (160, d, 1536), Q.Q6_K),
                (b + "ffn_gate_shexp.weight", (1536, d), Q.Q4_K),
                (b + "ffn_up_shexp.weight", (1536, d), Q.Q4_K),
                (b + "ffn_down_shexp.weight", (d, 1536), Q.Q6_K),
            ]
        if i == n_layers:
            t += [
                (b + "nextn.eh_proj.weight", (d, 2 * d), Q.Q4_K),
                (b + "nextn.enorm.weight", (d,), Q.F32),
                (b + "nextn.hnorm.weight", (d,), Q.F32),
            ]
    kv = {
        "block_count": n_layers + 1,
        "nextn_predict_layers": 1,
        "context_length": 131072,
        "embedding_length": d,
        "feed_forward_length": 12288,
        "attention.head_count": 96,
        "attention.head_count_kv": 8,
        "attention.key_length": 128,
        "attention.value_length": 128,
        "rope.dimension_count": 64,
        "leading_dense_block_count": 3,
        "expert_count": 160,
        "expert_used_count": 8,
        "expert_feed_forward_length": 1536,
        "expert_shared_count": 1,
    }
    return write_header_only(path, "glm4moe", kv, t)


def glm5(path: Path) -> dict[str, int]:
    """GLM-5-class (``glm-dsa``): 78 blocks + 1 MTP, n_embd 6144, MLA (kv_lora_rank 512 + rope 64), a DSA
    indexer (32 heads of 128) in every block, 256 experts of 2048, the first 3 blocks dense."""
    d, n_layers, vocab, heads = 6144, 78, 154880, 64
    t = [
        ("token_embd.weight", (vocab, d), Q.Q4_K),
        ("output_norm.weight", (d,), Q.F32),
        ("output.weight", (vocab, d), Q.Q6_K),
    ]
    for i in range(n_layers + 1):
        b = f"blk.{i}."
        t += [
            (b + "attn_norm.weight", (d,), Q.F32),
            (b + "attn_q_a.weight", (2048, d), Q.Q4_K),
            (b + "attn_q_b.weight", (heads * 256, 2048), Q.Q4_K),
            (b + "attn_kv_a_mqa.weight", (512 + 64, d), Q.Q4_K),
            (b + "attn_k_b.weight", (heads, 512, 192), Q.Q8_0),
            (b + "attn_v_b.weight", (heads, 256, 512), Q.Q8_0),
            (b + "attn_output.weight", (d, heads * 256), Q.Q4_K),
            (b + "ffn_norm.weight", (d,), Q.F32),
            (b + "indexer.attn_q_b.weight", (32 * 128, 2048), Q.Q8_0),
            (b + "indexer.attn_k.weight", (128, d), Q.Q8_0),
            (b + "indexer.proj.weight", (32, d), Q.F32),
            (b + "indexer.k_norm.weight", (128,), Q.F32),
        ]
        if i < 3:
            t += [
                (b + "ffn_gate.weight", (12288, d), Q.Q4_K),
                (b + "ffn_up.weight", (12288, d), Q.Q4_K),
                (b + "ffn_down.weight", (d, 12288), Q.Q6_K),
            ]
        else:
            t += [
                (b + "ffn_gate_inp.weight", (256, d), Q.F32),
                (b + "ffn_gate_exps.weight", (256, 2048, d), Q.Q4_K),
                (b + "ffn_up_exps.weight", (256, 2048, d), Q.Q4_K),
                (b + "ffn_down_exps.weight", (256, d, 2048), Q.Q6_K),
            ]
    kv = {
        "block_count": n_layers + 1,
        "nextn_predict_layers": 1,
        "context_length": 202752,
        "embedding_length": d,
        "attention.head_count": heads,
        "attention.head_count_kv": 1,
        "attention.key_length": 576,
        "attention.value_length": 512,
        "attention.key_length_mla": 256,
        "attention.value_length_mla": 256,
        "attention.q_lora_rank": 2048,
        "attention.kv_lora_rank": 512,
        "rope.dimension_count": 64,
        "attention.indexer.head_count": 32,
        "attention.indexer.key_length": 128,
        "attention.indexer.top_k": 2048,
        "leading_dense_block_count": 3,
        "expert_count": 256,
        "expert_used_count": 8,
        "expert_feed_forward_length": 2048,
    }
    return write_header_only(path, "glm-dsa", kv, t)


def hybrid(path: Path) -> dict[str, int]:
    """Qwen3-Next-class: 48 blocks, gated delta net (ssm_*) except every 4th, which is full attention."""
    d, n_layers = 2048, 48
    t = [
        ("token_embd.weight", (151936, d), Q.Q8_0),
        ("output_norm.weight", (d,), Q.F32),
        ("output.weight", (151936, d), Q.Q8_0),
    ]
    for i in range(n_layers):
        b = f"blk.{i}."
        if (i + 1) % 4:
            t += [
                (b + "ssm_in.weight", (12288, d), Q.Q8_0),
                (b + "ssm_conv1d.weight", (8192, 4), Q.F32),
                (b + "ssm_out.weight", (d, 4096), Q.Q8_0),
                (b + "ssm_a", (32,), Q.F32),
            ]
        else:
            t += [
                (b + "attn_q.weight", (16 * 256 * 2, d), Q.Q8_0),
                (b + "attn_k.weight", (2 * 256, d), Q.Q8_0),
                (b + "attn_v.weight", (2 * 256, d), Q.Q8_0),
                (b + "attn_output.weight", (d, 16 * 256), Q.Q8_0),
            ]
        t += [
            (b + "ffn_gate_exps.weight", (512, 512, d), Q.Q4_K),
            (b + "ffn_up_exps.weight", (512, 512, d), Q.Q4_K),
            (b + "ffn_down_exps.weight", (512, d, 512), Q.Q4_K),
        ]
    kv = {
        "block_count": n_layers,
        "context_length": 262144,
        "embedding_length": d,
        "attention.head_count": 16,
        "attention.head_count_kv": 2,
        "attention.key_length": 256,
        "attention.value_length": 256,
        "full_attention_interval": 4,
        "ssm.conv_kernel": 4,
        "ssm.inner_size": 4096,
        "ssm.state_size": 128,
        "ssm.group_count": 16,
        "ssm.time_step_rank": 32,
    }
    return write_header_only(path, "qwen3next", kv, t)


def run_plan(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def per_block(sizes: dict[str, int], n: int) -> list[int]:
    out = [0] * n
    for name, b in sizes.items():
        if name.startswith("blk."):
            out[int(name.split(".")[1])] += b
    return out


def check_placement(plan: dict, n_layers: int, node_memory: int, sizes: dict[str, int]) -> None:
    nodes = plan["placement"]["nodes"]
    assert [n["layers"][0] for n in nodes] == [0] + [n["layers"][1] for n in nodes[:-1]]  # contiguous
    assert nodes[-1]["layers"][1] == n_layers
    assert nodes[0]["embed"] and nodes[-1]["head"] and not any(n["head"] for n in nodes[:-1])
    assert all(n["used_bytes"] <= node_memory for n in nodes)
    blocks = per_block(sizes, plan["n_blocks"])
    globals_ = sum(b for name, b in sizes.items() if not name.startswith("blk."))
    # the nodes' weights are exactly the route's blocks plus the embedding and head tensors (no tied output here)
    assert sum(n["weight_bytes"] for n in nodes) == sum(blocks[:n_layers]) + globals_


def test_deepseek_v3_class_header_plans_on_24gib_nodes(tmp_path, capsys):
    path = tmp_path / "deepseek-v3-class.gguf"
    sizes = deepseek_v3(path)
    total = sum(sizes.values())
    assert total > 300 * 10**9 and path.stat().st_size < 2**20  # ~380 GB described, nothing stored

    rc, out, err = run_plan(capsys, "--model", str(path), "--node-memory", "24GiB", "--context", "131072", "--json")
    assert rc == 0, err
    plan = json.loads(out)
    # byte totals equal the sums over the tensor table
    assert plan["total_bytes"] == total
    assert [b["weight_bytes"] for b in plan["blocks"]] == per_block(sizes, 61)
    assert sum(b["weight_bytes"] for b in plan["blocks"]) + sum(plan["globals"].values()) == total
    assert plan["globals"] == {k: v for k, v in sizes.items() if not k.startswith("blk.")}
    # MLA: only the latent (512 + 64 f16 values) per block and token; no recurrent state
    assert {b["kind"] for b in plan["blocks"]} == {"mla"}
    assert plan["kv_bytes_per_token"] == 61 * (512 + 64) * 2 == 70_272
    assert plan["state_bytes_per_session"] == 0
    assert plan["boundary_bytes_per_token"] == {"f32": 7168 * 4, "f16": 7168 * 2, "bf16": 7168 * 2}
    check_placement(plan, 61, 24 * GiB, sizes)
    p = plan["placement"]
    assert len(p["nodes"]) >= total // (24 * GiB)
    assert p["session_context"] >= 131072
    assert p["wire_bytes_per_token"] == (len(p["nodes"]) - 1) * (48 + 7168 * 4 + 4)

    rc, text, _ = run_plan(capsys, "--model", str(path), "--node-memory", "24GiB")
    assert rc == 0
    assert f"tensor table total {total:>25,}".replace(" ", "") in text.replace(" ", "")
    assert "placement: nodes of 24.00 GiB" in text and f"nodes: {len(p['nodes'])};" in text
    assert "boundary per decode token: n_embd 7168 x 4 = 28,672 B f32" in text
    assert text.count(" mla ") == 61


def test_context_columns_stop_at_the_models_trained_context(capsys):
    """The embedded Gemma (trained context 32,768) on one 1 GiB node: memory would fit ~44K tokens, but the
    "max context" column and the KV line speak of the 32,768 tokens a session can have, not more (or 128K)."""
    rc, text, _ = run_plan(capsys, "--node-memory", "1GiB")
    assert rc == 0
    rows = [line.split() for line in text.splitlines() if line.split()[:3] == ["1", "0:18", "embed+head"]]
    assert len(rows) == 1 and rows[0][-1] == "32,768", text
    assert "at 32,768 tokens" in text and "131" not in text


def test_exactly_n_nodes_are_balanced_and_too_few_is_an_error(tmp_path, capsys):
    path = tmp_path / "dsv3.gguf"
    sizes = deepseek_v3(path)
    rc, out, err = run_plan(
        capsys, "--model", str(path), "--node-memory", "96G", "--nodes", "6", "--context", "32768", "--json"
    )
    assert rc == 0, err
    plan = json.loads(out)
    assert len(plan["placement"]["nodes"]) == 6
    check_placement(plan, 61, 96 * GiB, sizes)
    used = [n["used_bytes"] for n in plan["placement"]["nodes"]]
    assert max(used) - min(used) < 0.25 * max(used)  # balanced, not 5 full nodes and a nearly empty one
    rc, _, err = run_plan(capsys, "--model", str(path), "--node-memory", "96G", "--nodes", "3")
    assert rc == 1 and "3 node(s) of 96.00 GiB cannot hold the model" in err and "at least" in err
    rc, _, err = run_plan(capsys, "--model", str(path), "--node-memory", "2G")
    assert rc == 1 and "alone" in err and "more than a node's 2.00 GiB" in err


def test_glm_class_header_with_mtp_block(tmp_path, capsys):
    path = tmp_path / "glm-4.5-class.gguf"
    sizes = glm45(path)
    total = sum(sizes.values())
    rc, out, err = run_plan(capsys, "--model", str(path), "--node-memory", "48GiB", "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["n_layers"] == 92 and plan["n_blocks"] == 93  # the MTP block is counted, not placed
    assert plan["total_bytes"] == total
    assert [b["weight_bytes"] for b in plan["blocks"]] == per_block(sizes, 93)
    assert plan["kv_bytes_per_token"] == 92 * 8 * (128 + 128) * 2  # GQA: 8 KV heads of 128, K and V, f16
    check_placement(plan, 92, 48 * GiB, sizes)
    rc, text, _ = run_plan(capsys, "--model", str(path), "--node-memory", "48GiB")
    assert "(+1 MTP/nextn blocks no route runs)" in text and "(MTP, not placed)" in text


def test_glm5_class_dsa_header(tmp_path, capsys):
    path = tmp_path / "glm-5-class.gguf"
    sizes = glm5(path)
    total = sum(sizes.values())
    rc, out, err = run_plan(capsys, "--model", str(path), "--node-memory", "96GiB", "--context", "65536", "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["arch"] == "glm-dsa" and plan["n_layers"] == 78 and plan["total_bytes"] == total
    assert [b["weight_bytes"] for b in plan["blocks"]] == per_block(sizes, 79)
    assert plan["kv_bytes_per_token"] == 78 * (512 + 64 + 128) * 2  # MLA latent + indexer key, f16
    check_placement(plan, 78, 96 * GiB, sizes)


def test_hybrid_recurrent_blocks_keep_state_not_kv(tmp_path, capsys):
    path = tmp_path / "hybrid.gguf"
    hybrid(path)
    acc = HeaderAccounts.from_model(GGUFModelFile(path, header_only=True))
    kinds = [b.kind for b in acc.layers]
    assert kinds == ["recurrent", "recurrent", "recurrent", "attention"] * 12
    # src/llama-hparams.cpp: n_embd_r = (d_conv - 1) * (d_inner + 2 * n_group * d_state), n_embd_s = d_state * d_inner
    state = ((4 - 1) * (4096 + 2 * 16 * 128) + 128 * 4096) * 4
    assert {b.state_bytes_per_session for b in acc.layers if b.kind == "recurrent"} == {state}
    assert {b.kv_bytes_per_token for b in acc.layers if b.kind == "recurrent"} == {0}
    assert {b.kv_bytes_per_token for b in acc.layers if b.kind == "attention"} == {2 * (256 + 256) * 2}
    shard = acc.shard(0, 8)  # blocks 0..7: six recurrent, two attention
    assert shard.state_bytes_per_session == 6 * state and shard.kv_bytes_per_token == 2 * 2048
    rc, out, err = run_plan(capsys, "--model", str(path), "--node-memory", "40G", "--json")
    assert rc == 0, err
    assert json.loads(out)["state_bytes_per_session"] == 36 * state


def test_split_set_header_only(tmp_path, capsys):
    """The first file of a split set names the others; every file's header is read, no data needed."""
    sizes = deepseek_v3(tmp_path / "dsv3.gguf", split_max_tensors=300)
    files = sorted(tmp_path.glob("dsv3-*-of-*.gguf"))
    assert len(files) > 1
    rc, out, err = run_plan(capsys, "--model", str(files[0]), "--node-memory", "24GiB", "--json")
    assert rc == 0, err
    assert json.loads(out)["total_bytes"] == sum(sizes.values())
    files[-1].unlink()
    rc, _, err = run_plan(capsys, "--model", str(files[0]), "--node-memory", "24GiB")
    assert rc == 1 and "split set incomplete" in err and files[-1].name in err


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    rc, _, err = run_plan(capsys, "--model", str(tmp_path / "absent.gguf"), "--node-memory", "24G")
    assert rc == 1 and "no such file" in err and err.count("\n") == 1
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model\n")
    rc, _, err = run_plan(capsys, "--model", str(text), "--node-memory", "24G")
    assert rc == 1 and "not a GGUF file" in err
    path = tmp_path / "dsv3.gguf"
    deepseek_v3(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])  # the tensor table ends half-way
    rc, _, err = run_plan(capsys, "--model", str(cut), "--node-memory", "24G")
    assert rc == 1 and "truncated GGUF header" in err
    with pytest.raises(SystemExit):
        main(["plan", "--model", str(path), "--node-memory", "lots"])
    assert "size must be a positive number" in capsys.readouterr().err


def test_header_only_file_is_refused_where_weights_are_needed(tmp_path):
    """Only planning reads header-only files: the ordinary open (what a node uses) still says truncated."""
    path = tmp_path / "dsv3.gguf"
    deepseek_v3(path)
    with pytest.raises(ValueError, match="truncated GGUF: tensor token_embd.weight ends at byte"):
        GGUFModelFile(path)


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    for phrase in ("header", "--node-memory", "--context", "--nodes", "--tracker", "MLA", "recurrent", "examples:"):
        assert phrase in text


def test_published_name_plans_from_manifest_and_a_nodes_header(tmp_path, capsys):
    """``--tracker URL --model NAME``: the tensor table from the tracker's manifest, the metadata from a node
    serving the model (``GET /v1/model/header/0``, here a stand-in app); the same plan as from the file."""
    from aiohttp import web
    from apphost import AppThread
    from tinymodels import write_tiny_model

    from ggufswarm.artifact.manifest import Manifest
    from ggufswarm.swarm.torrent import make_torrent
    from ggufswarm.tracker.app import TrackerConfig, make_app

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_layers=4)
    manifest = Manifest.from_gguf(path, name="tiny")
    header = path.read_bytes()[: manifest.files[0]["header_bytes"]]

    def node_app():
        app = web.Application()

        async def head(request):
            return web.Response(body=header, content_type="application/octet-stream")

        app.router.add_get("/v1/model/header/0", head)
        return app

    with AppThread(lambda: make_app(TrackerConfig(db=":memory:", token=None))) as tracker, AppThread(node_app) as node:
        rc, _, err = run_plan(capsys, "--model", "tiny", "--tracker", tracker, "--node-memory", "1M")
        assert rc == 1 and "no model named 'tiny' is published" in err
        req = urllib.request.Request(
            f"{tracker}/manifests/tiny",
            method="PUT",
            headers={"Content-Type": "application/json"},
            data=json.dumps(
                {"manifest": json.loads(manifest.to_json()), "torrent_hex": make_torrent([path]).hex()}
            ).encode(),
        )
        urllib.request.urlopen(req, timeout=10).read()
        rc, _, err = run_plan(capsys, "--model", "tiny", "--tracker", tracker, "--node-memory", "1M")
        assert rc == 1 and "no node serves it now" in err
        beat = {
            "node_id": "n1",
            "url": node,
            "model": "tiny",
            "layers": [0, 4],
            "embed": True,
            "head": True,
            "state": "ready",
            "free_kv_tokens": 4096,
            "decode_ms": 1.0,
        }
        req = urllib.request.Request(
            f"{tracker}/nodes/heartbeat",
            method="POST",
            data=json.dumps(signed_ad(beat)).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=10).read()
        rc, out, err = run_plan(
            capsys, "--model", "tiny", "--tracker", tracker, "--node-memory", "4M", "--context", "256", "--json"
        )
        assert rc == 0, err
    remote = json.loads(out)
    rc, out, err = run_plan(capsys, "--model", str(path), "--node-memory", "4M", "--context", "256", "--json")
    local = json.loads(out)
    assert "metadata from" in remote.pop("source") and local.pop("source")
    assert remote == local and remote["placement"]["nodes"]


def test_nodes_without_node_memory_is_an_error(tmp_path, capsys):
    path = tmp_path / "glm.gguf"
    glm45(path)
    rc, _, err = run_plan(capsys, "--model", str(path), "--nodes", "4")
    assert rc == 1 and "give both" in err
    rc, out, err = run_plan(capsys, "--model", str(path))  # the per-block table alone
    assert rc == 0 and "tensor table total" in out and "placement" not in out
