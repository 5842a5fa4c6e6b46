"""The numbers quoted in docs/models/*.md come from docs/models/make_headers.py: header-only GGUFs with the
published shapes of DeepSeek-V4-Flash, GLM-5.2 and Ornith-1.0-397B, planned with ``ggufswarm plan``. This
keeps the audits honest: if the accounting or the planner changes, the quoted numbers fail here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "docs" / "models" / "make_headers.py"


@pytest.fixture(scope="module")
def mh():
    spec = importlib.util.spec_from_file_location("make_headers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# model -> (KV bytes/token, state bytes/session, boundary bytes/token f32, Q4_K_M nodes at 24/48/96 GiB, Q8_0 nodes);
# None: no placement respects the model's cut rules (GLM-5.2: shards start at full-indexer blocks)
QUOTED = {
    "deepseek-v4-flash": (50_912, 12_206_080, 65_536, (8, 4, 2), (15, 7, 4)),
    "glm-5.2": (95_232, 0, 24_576, (None, 10, 5), (None, 19, 10)),
    "ornith": (30_720, 195_379_200, 16_384, (11, 6, 3), (20, 9, 5)),
}


@pytest.mark.parametrize("key", sorted(QUOTED))
def test_quoted_numbers(mh, key, tmp_path):
    kv, state, boundary, q4_nodes, q8_nodes = QUOTED[key]
    model = mh.MODELS[key]()
    for recipe, nodes in (("Q4_K_M", q4_nodes), ("Q8_0", q8_nodes)):
        path = tmp_path / f"{key}-{recipe}.gguf"
        sizes = mh.write_header(model, recipe, path)
        assert path.stat().st_size < 2**20  # header only
        got = []
        for mem, want in zip(mh.MEMORIES, nodes):
            rc, out = mh.run_plan("--model", str(path), "--node-memory", mem, "--context", "131072", "--json")
            if want is None:
                assert rc == 1 and "cut rules" in out, out
                got.append(None)
                continue
            assert rc == 0, out
            plan = json.loads(out)
            assert plan["total_bytes"] == sum(n for _, n in sizes.values())
            assert (plan["kv_bytes_per_token"], plan["state_bytes_per_session"]) == (kv, state)
            assert plan["boundary_bytes_per_token"]["f32"] == boundary
            got.append(len(plan["placement"]["nodes"]))
        assert tuple(got) == nodes, recipe


def test_glm_indexer_only_on_indexshare_full_blocks(mh):
    """21 full-indexer blocks (0, 1, 2, 6, ..., 74) of 78 carry indexer tensors, as llama.cpp's
    GLM_5_2_DEFAULT_INDEXER_TYPES says; the accounting caches an indexer key on exactly those."""
    model = mh.glm_5_2()
    with_indexer = sorted({int(n.split(".")[1]) for n, _, _ in model.tensors if ".indexer." in n})
    assert with_indexer == [0, 1] + list(range(2, 78, 4)) + [78]
    assert len(with_indexer) - 1 == 21
