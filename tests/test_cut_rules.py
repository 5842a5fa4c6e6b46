"""One source of the cut rules (issue 42, item 4): whatever ``plan`` places, the node accepts at start.

``ggufswarm plan`` places by ``HeaderAccounts.range_problem``; a llama.cpp node checks its range at start in
``derive.shard_metadata`` (what ``LlamaCppShard`` runs before it writes or loads anything). Both call
``artifact.cut_rules.range_problem``. Over llama.cpp's whole architecture zoo (``tests/zoo.py``; each file and a copy
stretched to 8 blocks, ``zoo.stretch``) every range ``place`` produces on 2, 3 and 4 nodes is accepted by the node's
check, and on every range the two refuse alike, with the same reason. Synthetic headers show rules the planner used
to lack (a node refused what ``plan`` placed, or ``plan`` refused what a node runs). No llama.cpp model is loaded:
the node's check reads the header (the patch check, which reads the loaded libllama, is the one part left out).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import zoo
from gguf import GGMLQuantizationType as Q
from test_plan import write_header_only

from ggufswarm.artifact.accounting import HeaderAccounts
from ggufswarm.artifact.cut_rules import ONE_KIND_PATCH, range_problem
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.artifact.planning import PlanError, place
from ggufswarm.runtime.llamacpp import patches
from ggufswarm.runtime.llamacpp.derive import shard_metadata
from ggufswarm.runtime.llamacpp.errors import UnsupportedShard

NODE_COUNTS = (2, 3, 4)


@pytest.fixture(autouse=True)
def _every_patch(monkeypatch):
    """The node's check without its patch requirement: whether the loaded libllama carries patch 0002/0003 (or 0011,
    which lets a range hold one kind of block) is the machine's, not the model's, and ``plan`` cannot know it
    (``archs.ArchRules.patch``; ``plan`` assumes the patch queue)."""
    monkeypatch.setattr(patches, "require_patch", lambda name, what: None)
    monkeypatch.setattr(patches, "applied", lambda name: True)


def node_refusal(file: GGUFModelFile, a: int, b: int, n: int) -> str | None:
    """The node's start-up check of blocks ``[a, b)`` (the head with the last block): its UnsupportedShard message, or
    None when it accepts the range."""
    try:
        shard_metadata(file, a, b, head=b == n)
    except UnsupportedShard as exc:
        return str(exc)
    return None


def check_agreement(file: GGUFModelFile) -> tuple[list[tuple[int, int]], int, int]:
    """Assert that ``plan`` and the node agree on ``file``: on every range, and on every range ``place`` produces on
    2, 3 and 4 nodes. Returns the placements' ranges, how many ranges both refuse, and how many placements had two
    nodes or more."""
    acc = HeaderAccounts.from_model(file)
    n = acc.n_layers
    refused = 0
    for a in range(n):
        for b in range(a + 1, n + 1):
            node, planner = node_refusal(file, a, b, n), acc.range_problem(a, b)
            assert node == planner, (file.path.name, a, b)  # both None, or the same reason
            refused += node is not None
    placed, split = [], 0
    memory = acc.shard(0, n, embed=True, head=True).weight_bytes + (1 << 20)  # the whole model fits one node
    for k in NODE_COUNTS:
        try:
            nodes = place(acc, memory, 1, n_nodes=k).nodes
        except PlanError as exc:
            # plan refuses every placement: the node refuses every range (the whole model included)
            whole = node_refusal(file, 0, n, n)
            assert whole is not None and whole in str(exc), (file.path.name, k, str(exc))
            assert all(node_refusal(file, a, b, n) for a in range(n) for b in range(a + 1, n + 1)), file.path.name
            continue
        ranges = [p.shard.layers for p in nodes]
        assert ranges[0][0] == 0 and ranges[-1][1] == n and len(ranges) <= k, (file.path.name, ranges)
        assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:])), (file.path.name, ranges)
        for a, b in ranges:
            assert node_refusal(file, a, b, n) is None, (file.path.name, k, (a, b))
        placed += ranges
        split += len(ranges) > 1
    return placed, refused, split


def test_plan_places_only_what_the_node_accepts_over_the_zoo(zoo_dir, tmp_path):
    """Every zoo file (and its copy stretched to 8 blocks, where it has no MTP blocks): every range ``place`` produces
    on 2, 3 and 4 nodes passes the node's start-up check; on every range, plan and node refuse alike and say the same
    reason. (The zoo must exercise both sides: some ranges refused, some placements split over nodes.)"""
    files = zoo.zoo_files(zoo_dir)
    assert len(files) >= 50, f"{zoo_dir} holds {len(files)} zoo files; test-llama-archs writes over 100"
    refused = split = 0
    archs_checked = set()
    for path in files:
        file = GGUFModelFile(path)
        models = [file]
        acc = HeaderAccounts.from_model(file)
        if acc.n_blocks == acc.n_layers:  # (zoo.stretch takes no model with MTP blocks)
            models.append(GGUFModelFile(zoo.stretch(file, tmp_path / path.name)))
        for model in models:
            _, r, s = check_agreement(model)
            refused += r
            split += s
        archs_checked.add(file.architecture)
    assert len(archs_checked) >= 50
    assert refused > 0 and split > 0, (refused, split)


# -- rules the planner lacked, on synthetic header-only GGUFs (test_plan.write_header_only) ----------------------------


def synthetic(path: Path, arch: str, n: int = 8, **kv) -> GGUFModelFile:
    """A header-only ``arch`` GGUF of ``n`` equal blocks (n_embd 64, 4 heads), with extra metadata ``kv``."""
    d = 64
    tensors = [("token_embd.weight", (128, d), Q.F32), ("output_norm.weight", (d,), Q.F32)]
    tensors += [("output.weight", (128, d), Q.F32)]
    for i in range(n):
        tensors += [(f"blk.{i}.attn_q.weight", (d, d), Q.F32), (f"blk.{i}.ffn_up.weight", (4 * d, d), Q.F32)]
    base = {"block_count": n, "embedding_length": d, "attention.head_count": 4, "context_length": 256}
    write_header_only(path, arch, base | kv, tensors)
    return GGUFModelFile(path, header_only=True)


def test_minimax_m3_leading_dense_blocks(tmp_path):
    """minimax-m3: a range holding only leading dense-attention blocks aborts a llama.cpp without patch 0017 (its MSA
    inputs are never used), which the block kinds do not show: such a node refuses it, naming the patch. With the
    patch every range runs, and the node accepts every range plan places."""
    from ggufswarm.artifact.cut_rules import INDEXER_PATCH

    file = synthetic(tmp_path / "m3.gguf", "minimax-m3", leading_dense_block_count=3)
    cuts = HeaderAccounts.from_model(file).cuts
    for b in (1, 2, 3):
        problem = range_problem(cuts, 0, b, indexer_inputs=False)
        assert "only leading dense-attention blocks" in problem and INDEXER_PATCH in problem
        assert range_problem(cuts, 0, b) is None
    assert range_problem(cuts, 0, 4, indexer_inputs=False) is None
    if patches.applied(INDEXER_PATCH):
        placed, refused, split = check_agreement(file)
        assert refused == 0 and split == len(NODE_COUNTS)


def test_llama4_moe_step_and_no_rope_blocks(tmp_path):
    """llama4: llama.cpp counts the MoE block of every interleave_moe_layer_step, and the no-RoPE block of every 4
    (chunked attention), from a file's block 0; patch 0020 counts them from the whole model's (block_offset), so every
    range is placed and accepted. A llama.cpp without the patch refuses a range that shifts either, naming the patch;
    smollm3's and afmoe's no-RoPE block of every 4 likewise."""
    from ggufswarm.artifact.cut_rules import PATTERN_PATCH

    file = synthetic(tmp_path / "llama4.gguf", "llama4", interleave_moe_layer_step=2, **{"attention.sliding_window": 8})
    cuts = HeaderAccounts.from_model(file).cuts
    old = range_problem(cuts, 1, 2, block_patterns=False)
    assert "MoE block of every interleave_moe_layer_step" in old and PATTERN_PATCH in old
    assert "no-RoPE block" in range_problem(cuts, 2, 4, block_patterns=False)
    assert range_problem(cuts, 0, 4, block_patterns=False) is None  # both patterns keep their phase
    assert all(range_problem(cuts, a, b) is None for a in range(8) for b in range(a + 1, 9))
    for arch in ("smollm3", "afmoe"):
        cuts = HeaderAccounts.from_model(synthetic(tmp_path / f"{arch}.gguf", arch)).cuts
        assert "no-RoPE block of every 4" in range_problem(cuts, 2, 4, block_patterns=False), arch
        assert range_problem(cuts, 2, 4) is None, arch
    ernie = synthetic(tmp_path / "ernie.gguf", "ernie4_5-moe", interleave_moe_layer_step=2, leading_dense_block_count=1)
    cuts = HeaderAccounts.from_model(ernie).cuts
    assert range_problem(cuts, 2, 5, block_patterns=False) is None  # MoE blocks 3 of 2:5: a step of 2 in the file
    assert "MoE pattern" in range_problem(cuts, 3, 6, block_patterns=False)  # 3 and 5 of 3:6: no step gives them
    assert range_problem(cuts, 3, 6) is None
    if patches.applied(PATTERN_PATCH):
        placed, refused, split = check_agreement(file)
        assert not refused and split


def test_optional_sliding_window_ranges_are_placed(tmp_path):
    """olmo2 (sliding-window only when attention.sliding_window > 0, full-attention blocks alike either way): a node
    runs a range without a sliding-window block as a plain model, which plan used to refuse (is_swa_any); gemma2,
    whose SWA is not optional, has such ranges placed too (patch 0011 gives them an empty sliding-window cache), and
    refused, naming the patch, by the rules of a node whose llama.cpp lacks it."""
    olmo2 = synthetic(tmp_path / "olmo2.gguf", "olmo2", **{"attention.sliding_window": 8})
    acc = HeaderAccounts.from_model(olmo2)
    assert acc.cuts.swa == [il % 4 < 3 for il in range(8)]  # the default period of 4 (src/llama-hparams.cpp)
    assert acc.range_problem(3, 4) is None
    assert check_agreement(olmo2)[1] == 0  # nothing refused
    gemma2 = synthetic(tmp_path / "gemma2.gguf", "gemma2", **{"attention.sliding_window": 8})
    acc = HeaderAccounts.from_model(gemma2)
    assert acc.range_problem(1, 2) is None
    assert check_agreement(gemma2)[1] == 0
    without = [(a, b) for a in range(8) for b in range(a + 1, 9) if range_problem(acc.cuts, a, b, one_kind=False)]
    assert without == [(1, 2), (3, 4), (5, 6), (7, 8)]
    problem = range_problem(acc.cuts, 1, 2, one_kind=False)
    assert "holds no sliding-window layer" in problem and ONE_KIND_PATCH in problem
    assert range_problem(HeaderAccounts.from_model(olmo2).cuts, 3, 4, one_kind=False) is None  # optional: a plain model


def test_hybrid_ranges_of_one_kind_are_placed(tmp_path):
    """A hybrid model's range of only recurrent or only attention blocks (Qwen3-Next: recurrent but every 4th block)
    is placed, as a node with patch 0011 runs it; a node without the patch refuses it (cut_checks.OneKindProblem)."""
    qwen3next = synthetic(tmp_path / "qwen3next.gguf", "qwen3next")
    acc = HeaderAccounts.from_model(qwen3next)
    assert acc.cuts.recurrent == [il % 4 != 3 for il in range(8)]
    assert acc.range_problem(0, 3) is None and acc.range_problem(3, 4) is None
    assert check_agreement(qwen3next)[1] == 0
    assert "0:3 has no full-attention block" in range_problem(acc.cuts, 0, 3, one_kind=False)
    assert "3:4 has no recurrent block" in range_problem(acc.cuts, 3, 4, one_kind=False)
    assert range_problem(acc.cuts, 2, 4, one_kind=False) is None


def test_hybrid_ranges_may_start_at_a_block_without_heads(tmp_path):
    """Jamba's per-block head counts (0 for Mamba blocks): every range is placed, as a node with patch 0014 runs a
    range starting at a Mamba block; a node without the patch refuses those ranges, naming it."""
    jamba = synthetic(
        tmp_path / "jamba.gguf",
        "jamba",
        **{"attention.head_count": [4, 0] * 4, "attention.head_count_kv": [4, 0] * 4},
    )
    acc = HeaderAccounts.from_model(jamba)
    assert acc.cuts.recurrent == [il % 2 == 1 for il in range(8)]
    assert acc.range_problem(1, 3) is None and acc.range_problem(3, 4) is None
    assert check_agreement(jamba)[1] == 0
    problem = range_problem(acc.cuts, 1, 3, head_sizes=False)
    assert "block 1 has no attention heads" in problem and "0014-hybrid-ranges-start-at-any-block" in problem
    assert range_problem(acc.cuts, 2, 4, head_sizes=False) is None


def glm5_next(tmp_path):
    """A synthetic glm5-next of 8 blocks: recurrent (KDA) blocks 0 and 4; full-indexer attention blocks 1 and 5,
    shared-indexer ones 2, 3, 6, 7."""
    return synthetic(
        tmp_path / "glm5-next.gguf",
        "glm5-next",
        **{
            "attention.indexer.top_k": 64,
            "attention.indexer.types": [1, 1, 0, 0] * 2,
            "attention.head_count_kv": [0, 4, 4, 4] * 2,
        },
    )


def test_hyper_connection_ranges_start_at_a_full_indexer(tmp_path):
    """hy_v4 (patch 0015 carries its 4 residual streams across a cut) with DSA blocks that share the top-k of the
    block before: a range must start at a full-indexer block, and plan places only such ranges; without DSA
    (indexer.top_k 0) it cuts anywhere. glm5-next: only its attention blocks have an indexer, so a range starting
    at a recurrent (KDA) block is judged by its first attention block."""
    dsa = synthetic(
        tmp_path / "hy_v4.gguf", "hy_v4", **{"attention.indexer.top_k": 64, "attention.indexer.types": [1, 0] * 4}
    )
    acc = HeaderAccounts.from_model(dsa)
    assert "block 3 is a shared-indexer block" in acc.range_problem(3, 6)
    assert acc.range_problem(2, 5) is None
    placed, _, split = check_agreement(dsa)
    assert split > 0 and all(a % 2 == 0 for a, _ in placed)
    plain = HeaderAccounts.from_model(synthetic(tmp_path / "hy_v4-plain.gguf", "hy_v4"))
    assert all(plain.range_problem(a, a + 1) is None for a in range(8))
    glm = glm5_next(tmp_path)
    acc = HeaderAccounts.from_model(glm)
    assert acc.range_problem(0, 3) is None  # block 0 is recurrent, block 1 the first attention block: full
    assert "block 2 is a shared-indexer block" in acc.range_problem(2, 5)
    assert acc.range_problem(4, 8) is None  # 4 is recurrent, 5 a full-indexer block
    assert "block 6 is a shared-indexer block" in acc.range_problem(6, 8)
    placed, _, split = check_agreement(glm)
    assert split > 0 and all(a % 4 in (0, 1) for a, _ in placed)


def test_ranges_without_an_indexer_block_are_placed(tmp_path):
    """Patch 0017 (a graph sets only the indexer inputs a layer uses): a glm5-next range of only recurrent blocks and a
    dots3note range without a lightning-indexer block are placed; a llama.cpp without the patch refuses them, naming
    it, and a glm5-next range of one kind still needs patch 0011 too."""
    glm = glm5_next(tmp_path)
    cuts = HeaderAccounts.from_model(glm).cuts
    assert range_problem(cuts, 4, 5) is None  # block 4: recurrent (KDA) only
    problem = range_problem(cuts, 4, 5, indexer_inputs=False)
    assert "only recurrent blocks" in problem and "0017-indexer-free-ranges" in problem
    assert "has no full-attention block" in range_problem(cuts, 4, 5, one_kind=False)
    dots = synthetic(
        tmp_path / "dots3note.gguf",
        "dots3note",
        **{
            "attention.indexer.top_k": 64,
            "attention.indexer.types": [0, 1] * 4,
            "attention.sliding_window": 16,
            "attention.sliding_window_pattern": [True, False] * 4,
        },
    )
    cuts = HeaderAccounts.from_model(dots).cuts
    assert range_problem(cuts, 2, 3) is None  # block 2: sliding-window, no lightning indexer
    problem = range_problem(cuts, 2, 3, indexer_inputs=False)
    assert "no block with a lightning indexer" in problem and "0017-indexer-free-ranges" in problem
    assert range_problem(cuts, 2, 4, indexer_inputs=False) is None


def test_whole_only_and_unknown_architectures(tmp_path):
    """hrm_text runs only as the whole model (its blocks are cache slots of stacks run in nested cycles): plan places
    it on one node, as the node accepts; an architecture no node runs is refused by plan with the node's reason."""
    whole = synthetic(tmp_path / "hrm_text.gguf", "hrm_text")
    placed, _, split = check_agreement(whole)
    assert split == 0 and set(placed) == {(0, 8)}
    assert "only the whole model runs" in HeaderAccounts.from_model(whole).range_problem(0, 4)
    unknown = synthetic(tmp_path / "unknown.gguf", "no-such-arch")
    acc = HeaderAccounts.from_model(unknown)
    with pytest.raises(PlanError, match="unsupported architecture 'no-such-arch'"):
        place(acc, 1 << 30, 1, n_nodes=2)
    assert check_agreement(unknown) == ([], 36, 0)
