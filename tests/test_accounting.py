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

from tinymodels import write_tiny_model
from tinymoe import write_tiny_moe_model

from ggufswarm.artifact.accounting import HeaderAccounts
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.runtime.llamacpp.backend import LlamaCppShard, kv_bytes_per_token
from ggufswarm.runtime.shard import ShardSpec

CELL_META_BYTES = 12  # pos + n_seq_id + seq_id (int32 each) per cell in a sequence's serialized state


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3moe", "deepseek2", "glm4moe", "gpt-oss"])
def test_kv_bytes_per_token_is_what_llama_cpp_stores(tmp_path, arch):
    path = (write_tiny_model(tmp_path / f"{arch}.gguf", arch) if arch in ("llama", "qwen3", "gemma3")
            else write_tiny_moe_model(tmp_path / f"{arch}.gguf", arch))
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
