"""Header-only accounting (``artifact/accounting.py``) against what llama.cpp actually stores.

llama.cpp serializes a sequence's KV cells (``llama_state_seq_get_data``) as, per cell, 12 bytes of
metadata (``pos``, ``n_seq_id``, ``seq_id``: ``llama_kv_cache::state_write_meta`` in
``src/llama-kv-cache.cpp``) and then, per layer, the cell's K row (and V row, except for MLA). So the state
of a sequence grows by ``kv_bytes_per_token + 12`` bytes per token (``+ 24`` with sliding-window layers:
``llama_kv_cache_iswa`` holds two caches, each with its cell metadata): the header-only number is checked
against llama.cpp's own cache for every architecture the llama.cpp backend runs, MLA included.
"""

from __future__ import annotations

import pytest
import torch
from identities import signed_ad
from tinymodels import write_tiny_model
from tinymoe import write_tiny_moe_model

from ggufswarm.artifact.accounting import HeaderAccounts
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.runtime.llamacpp.backend import LlamaCppShard, kv_bytes_per_token
from ggufswarm.runtime.shard import ShardSpec

CELL_META_BYTES = 12  # pos + n_seq_id + seq_id (int32 each) per cell in a sequence's serialized state


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3moe", "deepseek2", "glm4moe", "gpt-oss"])
def test_kv_bytes_per_token_is_what_llama_cpp_stores(tmp_path, arch):
    path = (
        write_tiny_model(tmp_path / f"{arch}.gguf", arch)
        if arch in ("llama", "qwen3", "gemma3")
        else write_tiny_moe_model(tmp_path / f"{arch}.gguf", arch)
    )
    model = GGUFModelFile(path)
    acc = HeaderAccounts.from_model(model)
    spec = ShardSpec(0, acc.n_layers, True, True)
    shard = LlamaCppShard(model, spec, n_ctx_seq=256, n_seq_max=1, threads=1, cache_dir=tmp_path / "shards")
    try:
        kv = shard.new_session(64)
        sizes = []
        # 2 then 6 tokens: inside gpt-oss's sliding window of 8, where llama.cpp still holds every cell
        for ids in (torch.arange(1, 3), torch.arange(3, 7)):
            shard.forward(kv, ids, logits="last")
            sizes.append(len(shard.state_bytes(kv)))
        n_caches = 2 if arch == "gpt-oss" else 1  # gpt-oss: full + sliding-window cache (src/llama-kv-cache-iswa.cpp)
        per_token = (sizes[1] - sizes[0]) / 4 - n_caches * CELL_META_BYTES
        assert per_token == kv_bytes_per_token(model, spec) == acc.shard(0, acc.n_layers).kv_bytes_per_token
        kinds = {layer.kind for layer in acc.layers}
        assert kinds == ({"mla"} if arch == "deepseek2" else {"attention"})
        assert acc.shard(0, acc.n_layers).state_bytes_per_session == 0
        kv.close()
    finally:
        shard.close()


# -- header-only rules on synthetic metadata (no file, no llama.cpp) ----------------------------------------


def accounts(arch: str, n: int, tensors_per_block=("attn_q.weight", "attn_k.weight"), extra_tensors=(), **kv):
    md = {"general.architecture": arch, f"{arch}.block_count": n, f"{arch}.embedding_length": kv.pop("n_embd", 1024)}
    md |= {f"{arch}.{k.replace('__', '.')}": v for k, v in kv.items()}
    tensors = [(f"blk.{i}.{t}", 100) for i in range(n) for t in tensors_per_block] + list(extra_tensors)
    return HeaderAccounts(md, tensors)


def test_glm_dsa_class_mla_plus_indexer_only_where_the_block_has_one():
    """GLM-5-class (``glm-dsa``): MLA latent (512 + 64) plus the DSA indexer's key (128) per token, f16; a
    block without ``indexer`` tensors (a shared-indexer layer) caches no indexer key."""
    tensors = ("attn_q_a.weight", "attn_kv_a_mqa.weight", "indexer.attn_k.weight", "indexer.proj.weight")
    acc = accounts(
        "glm-dsa",
        4,
        tensors,
        attention__kv_lora_rank=512,
        rope__dimension_count=64,
        attention__head_count=64,
        attention__indexer__key_length=128,
    )
    assert [b.kv_bytes_per_token for b in acc.layers] == [(512 + 64 + 128) * 2] * 4
    shared = HeaderAccounts(
        acc.metadata, [(f"blk.{i}.{t}", 1) for i in range(4) for t in tensors if i % 2 == 0 or "indexer" not in t]
    )
    assert [b.kv_bytes_per_token for b in shared.layers] == [(512 + 64 + 128) * 2, (512 + 64) * 2] * 2


def test_compressed_attention_and_hyper_connections():
    """DeepSeek-V4-class metadata: K-only caches, a block with ratio r keeps raw + 1/r compressed rows (and 1/r
    indexer rows with an indexer) per token plus a compressor state per session; the boundary is n_embd ×
    hyper_connection.count."""
    acc = accounts(
        "deepseek4",
        3,
        ("attn_q_a.weight", "attn_kv.weight"),
        extra_tensors=[("blk.1.indexer.attn_k.weight", 1)],
        n_embd=4096,
        attention__head_count=64,
        attention__head_count_kv=1,
        attention__key_length=512,
        attention__value_length=512,
        attention__indexer__key_length=128,
        attention__sliding_window=128,
        attention__compress_ratios=[0, 4, 128],
        hyper_connection__count=4,
    )
    row = 512 * 2  # K only, f16
    raw, csa, hca = acc.layers  # only block 1 (ratio 4) has an indexer, as in llama-kv-cache-dsv4.cpp's filter_csa
    assert raw.kind == "attention" and raw.kv_bytes_per_token == row and raw.state_bytes_per_session == 0
    assert csa.kind == "compressed" and csa.kv_bytes_per_token == row + row // 4 + 128 * 2 // 4
    assert csa.state_bytes_per_session == 2 * 8 * 1024 * 4 + 2 * 8 * 256 * 4  # overlapping kv+score, f32
    assert hca.kv_bytes_per_token == row + row // 128 and hca.state_bytes_per_session == 2 * 128 * 512 * 4
    assert acc.boundary_width == 4 * 4096 and acc.boundary_bytes_per_token("f32") == 4 * 4096 * 4
    assert (
        acc.shard(0, 2).boundary_bytes_per_token == 4 * 4096 * 4
        and acc.shard(0, 3, head=True).boundary_bytes_per_token == 0
    )


def test_jamba_style_zero_kv_heads_and_rwkv():
    """Per-layer ``head_count_kv`` 0 with ``ssm.*`` metadata marks recurrent blocks (Jamba); ``wkv.head_size``
    (RWKV) gives ``token_shift_count * n_embd + n_embd * head_size`` f32 values of state per block."""
    acc = accounts(
        "jamba",
        4,
        ("attn_norm.weight",),
        attention__head_count=8,
        attention__head_count_kv=[0, 0, 0, 2],
        attention__key_length=128,
        attention__value_length=128,
        ssm__conv_kernel=4,
        ssm__inner_size=2048,
        ssm__state_size=16,
        ssm__group_count=0,
    )
    assert [b.kind for b in acc.layers] == ["recurrent"] * 3 + ["attention"]
    assert acc.layers[0].state_bytes_per_session == (3 * 2048 + 16 * 2048) * 4
    assert acc.layers[3].kv_bytes_per_token == 2 * 256 * 2
    rwkv = accounts("rwkv6", 2, ("time_mix_key.weight",), n_embd=2048, wkv__head_size=64, attention__head_count=0)
    assert [b.kind for b in rwkv.layers] == ["recurrent"] * 2
    assert rwkv.layers[0].state_bytes_per_session == (2 * 2048 + 2048 * 64) * 4


def test_kda_and_lightning_attention_state():
    """Kimi's KDA blocks (``kda.head_dim``) hold Q, K and V convolution states of ``(conv_kernel - 1) x n_head x
    head_dim`` and a ``[head_dim, head_dim]`` state per head, with block 0's head count (``n_embd_r`` / ``n_embd_s``
    in src/llama-hparams.cpp); MiniMax-01's lightning-attention blocks a ``[head_dim, head_dim]`` state per head
    (src/models/minimax-01.cpp: ``n_embd_head_la``). plan counted 0 for both."""
    kimi = accounts(
        "kimi-linear",
        2,
        ("attn_norm.weight",),
        attention__head_count=[32, 0],
        attention__head_count_kv=[32, 0],
        kda__head_dim=128,
        ssm__conv_kernel=4,
    )
    assert [b.kind for b in kimi.layers] == ["attention", "recurrent"]
    assert kimi.layers[1].state_bytes_per_session == (3 * 3 * 32 * 128 + 128 * 128 * 32) * 4
    minimax = accounts(
        "minimax-01", 8, ("attn_norm.weight",), n_embd=2048, attention__head_count=16, attention__key_length=128
    )
    assert minimax.layers[0].kind == "recurrent" and minimax.layers[7].kind == "attention"
    assert minimax.layers[0].state_bytes_per_session == 128 * 128 * 16 * 4


def test_sliding_window_layers_count_full_kv_with_their_own_head_lengths():
    """Sliding-window blocks cost full per-token KV (the backend runs with swa_full); ``key_length_swa`` /
    ``value_length_swa`` apply on them (pattern 2: blocks 0, 2 sliding)."""
    acc = accounts(
        "gemma4",
        4,
        attention__head_count=8,
        attention__head_count_kv=2,
        attention__key_length=512,
        attention__value_length=512,
        attention__key_length_swa=256,
        attention__value_length_swa=256,
        attention__sliding_window=512,
        attention__sliding_window_pattern=2,
    )
    assert [b.kv_bytes_per_token for b in acc.layers] == [2 * 512 * 2, 2 * 1024 * 2] * 2


def test_globals_tied_output_and_totals():
    """The head stage of a model without ``output.weight`` loads the tied ``token_embd``; a one-node shard
    counts it once; ``rope_freqs`` is loaded by every shard; the totals are the tensor table's."""
    glob = [("token_embd.weight", 1000), ("output_norm.weight", 10), ("rope_freqs.weight", 3)]
    acc = accounts("llama", 4, ("attn_q.weight",), extra_tensors=glob, attention__head_count=8)
    assert acc.total_bytes == 4 * 100 + 1013
    assert acc.shard(0, 4, embed=True, head=True).weight_bytes == 4 * 100 + 1013
    assert acc.shard(0, 2, embed=True).weight_bytes == 200 + 1000 + 3
    assert acc.shard(2, 4, head=True).weight_bytes == 200 + 1000 + 10 + 3
    assert acc.shard(1, 3).weight_bytes == 200 + 3


def test_node_advertises_its_accounting_and_the_tracker_routes_with_it(tmp_path):
    """Two llama.cpp deepseek2 (MLA) shards advertise their header-only numbers in ``extra.accounting``; the
    tracker's /route answers with the context the route admits and the wire bytes per token, from those."""
    import json
    import urllib.request

    from apphost import AppThread

    from ggufswarm.artifact.manifest import Manifest
    from ggufswarm.node.advertise import advertisement
    from ggufswarm.node.app import load_executor
    from ggufswarm.node.state import NodeConfig, NodeState
    from ggufswarm.swarm.torrent import make_torrent
    from ggufswarm.tracker.app import TrackerConfig, make_app

    path = write_tiny_moe_model(tmp_path / "ds2.gguf", "deepseek2")
    acc = HeaderAccounts.from_model(GGUFModelFile(path))

    def call(url, body=None, method="GET"):
        req = urllib.request.Request(
            url,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    states = []
    for layers, embed, head in (("0:4", True, False), ("4:6", False, True)):
        config = NodeConfig(
            layers=layers,
            embed=embed,
            head=head,
            model=str(path),
            ctx_size=512,
            max_sessions=2,
            data_dir=str(tmp_path / "data"),
            threads=1,
        )
        states.append(NodeState(config, load_executor(config)))
    try:
        first, last = (advertisement(s) for s in states)
        a = first["extra"]["accounting"]
        assert a["kv_bytes_per_token"] == acc.shard(0, 4).kv_bytes_per_token == 4 * (64 + 16) * 2  # MLA latent
        assert a["state_bytes_per_session"] == 0 and a["free_sessions"] == 2 and a["max_length"] == 512
        assert a["weight_bytes"] == acc.shard(0, 4, embed=True).weight_bytes
        assert a["boundary_bytes_per_token"] == 128 * 4 and last["extra"]["accounting"]["boundary_bytes_per_token"] == 0
        assert a["free_bytes"] == states[0].store.budget_tokens * a["kv_bytes_per_token"]
        with AppThread(lambda: make_app(TrackerConfig(db=":memory:", token=None))) as tracker:
            call(
                f"{tracker}/manifests/ds2",
                {
                    "manifest": json.loads(Manifest.from_gguf(path, name="ds2").to_json()),
                    "torrent_hex": make_torrent([path]).hex(),
                },
                "PUT",
            )
            for ad, url, state in zip((first, last), ("http://a", "http://b"), states):
                call(f"{tracker}/nodes/heartbeat", signed_ad(ad | {"url": url, "model": "ds2"}, state.identity), "POST")
            route = call(f"{tracker}/route?model=ds2&max_length=100")
            assert [hop["url"] for hop in route["route"]] == ["http://a", "http://b"]
            assert route["context"] == 512 and route["wire_bytes_per_token"] == 128 * 4
            bad = first | {"url": "http://c", "model": "ds2", "node_id": "c"}
            bad["extra"] = {**first["extra"], "accounting": {**a, "kv_bytes_per_token": -1}}
            with pytest.raises(urllib.error.HTTPError) as err:
                call(f"{tracker}/nodes/heartbeat", signed_ad(bad), "POST")
            assert err.value.code == 400 and b"kv_bytes_per_token" in err.value.read()
    finally:
        for s in states:
            s.executor.close()
