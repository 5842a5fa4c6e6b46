"""The architecture zoo in CI: every model llama.cpp's test-llama-archs writes, run as layer ranges (tests/zoo.py).

The zoo is written once per machine by the test-llama-archs of the kept wheel build tree (``scripts/
build_llama_cpp_python.sh tools``; ``$GGUFSWARM_TEST_LLAMA_ARCHS`` names another binary, ``$GGUFSWARM_TEST_ZOO_DIR`` an
already written zoo) into ``~/.cache/ggufswarm/zoo/<key>/``. One module-scoped run probes every file in child processes
(a llama.cpp abort costs one file): each decoder is run as shard chains against llama.cpp's own whole-model run of
the same file in the same process, prefill logits and 20 greedy decode steps compared bit for bit. The table is
printed (``pytest -s``).
"""

from __future__ import annotations

import os
import time

import pytest
import zoo

# the share of decoder architectures that must run as layer ranges, bitwise (the rest need llama.cpp changes the
# patch queue does not carry yet: docs/architectures.md names them)
BITWISE_TARGET = 0.95
# the architectures llama.cpp patch 0013 lets run as layer ranges (before it: the whole model only), and the hybrids
# patch 0014 lets start a range at any block (before it: only at a block with attention heads)
RANGE_PATCH_ARCHS = "bloom muse-glimmer minicpm3 talkie minimax-01 smallthinker".split()
HEADS_PATCH_ARCHS = "jamba lfm2 lfm2moe granitehybrid".split()
HC_PATCH_ARCHS = "hy_v4 glm5-next qwen4exp".split()
# the architectures whose no-RoPE (and llama4's MoE) block patterns patch 0020 counts from the whole model's block 0
PATTERN_PATCH_ARCHS = "afmoe smollm3 llama4 ernie4_5-moe".split()


@pytest.fixture(scope="module")
def verdicts(zoo_dir) -> list[zoo.Verdict]:  # (zoo_dir: conftest.py)
    files = zoo.zoo_files(zoo_dir)
    assert len(files) >= 50, f"{zoo_dir} holds {len(files)} zoo files; test-llama-archs writes over 100"
    t0 = time.monotonic()
    result = zoo.run_zoo(files, workers=max(1, min(4, os.cpu_count() or 1)), threads=1)
    print(f"\n{zoo.table(result)}\nzoo of {len(files)} files from {zoo_dir}: {time.monotonic() - t0:.1f} s")
    return result


def _listed(verdicts, kinds) -> str:
    return "\n".join(f"{v.file}: {v}" for v in verdicts if v.kind in kinds)


def test_zoo_no_wrong_crash_or_error(verdicts):
    """Every chain that runs is bitwise llama.cpp's whole model; no probe aborts llama.cpp or raises."""
    bad = [v for v in verdicts if v.kind in ("wrong", "crash", "error")]
    assert not bad, _listed(bad, ("wrong", "crash", "error"))


def test_zoo_refusals_say_why(verdicts):
    """A refused architecture or range says why (the UnsupportedShard message), and so does a non-decoder."""
    silent = [v for v in verdicts if v.kind in ("refused", "not-a-decoder") and not v.detail.strip()]
    assert not silent, _listed(silent, ("refused", "not-a-decoder"))


def test_zoo_every_decoder_has_rules(verdicts):
    """Every decoder architecture of the zoo has an ARCH_RULES entry: rules that make it bitwise, or the reason it runs
    only as the whole model (a new llama.cpp architecture shows up here, refused as unsupported)."""
    unknown = [v for v in verdicts if v.kind == "refused" and v.detail.startswith("unsupported architecture")]
    assert not unknown, "\n".join(sorted({v.arch for v in unknown}))


def test_zoo_bitwise_share(verdicts):
    """At least 95 % of the decoder architectures run as layer ranges bitwise equal to llama.cpp's whole model."""
    c = zoo.counts(verdicts)
    assert c["decoder_archs"] > 0
    assert c["bitwise_share"] >= BITWISE_TARGET, (
        f"{c['bitwise_archs']}/{c['decoder_archs']} decoder architectures bitwise; refused:\n"
        + _listed(verdicts, ("refused",))
    )


def test_patch_0013_and_0014_architectures_run_at_every_boundary(verdicts):
    """Patch 0013 (input transforms on token input only, talkie's skip embedding from token ids, a block's place in
    the whole model) and 0014 (a hybrid's range may start at a block without heads): every chain the zoo probes of
    these architectures, one-block shards included, is accepted and bitwise equal to llama.cpp's whole model."""
    by_arch = {v.arch: v for v in verdicts}
    for arch in RANGE_PATCH_ARCHS + HEADS_PATCH_ARCHS:
        v = by_arch[arch]
        assert v.kind == "bitwise" and v.results and all(r == "bitwise" for r in v.results), (arch, v.results)
        assert any(len(cut) == cut[0] for cut in v.cuts), (arch, v.cuts)  # [n, 1, ..., n - 1]: one-block shards


def test_patch_0015_hyper_connection_ranges_run(verdicts):
    """Patch 0015 (the 4 residual streams of hy_v4, glm5-next and qwen4exp through batch.embd; qwen4exp's token ids
    with them): a chain of the stretched copy runs bitwise, and the refused chains are those with a range starting at
    a shared-indexer block or, in glm5-next without patch 0017, a range of only recurrent blocks
    (``cut_checks.shared_indexer_check``);
    the finest chains these allow, over 3 nodes too: tests/test_zoo_routes.py."""
    by_arch = {v.arch: v for v in verdicts}
    for arch in HC_PATCH_ARCHS:
        v = by_arch[arch]
        assert v.kind == "bitwise", (arch, v.kind, v.detail)
        ran = [cut for cut, r in zip(v.cuts, v.results) if r == "bitwise"]
        assert any(cut[0] > 2 for cut in ran), (arch, v.cuts, v.results)  # a chain of the 8-block copy
        for cut, r in zip(v.cuts, v.results):
            assert r == "bitwise" or ("shared-indexer block" in r or "only recurrent blocks" in r), (arch, cut, r)


# zoo files whose copy stretched to 8 blocks has a chain of the finest ranges the cut rules accept holding a range of
# one kind of block (llama.cpp patch 0011): sliding-window models' ranges without a sliding-window block, hybrids'
# without a recurrent or without an attention block
ONE_KIND = (
    "cohere2-dense cohere2moe-moe dots3note-moe exaone-moe-moe gemma2-dense gemma3-dense gpt-oss-moe granite_swa-dense "
    "maple-moe mimo2-moe spark2_5-dense nemotron_h-dense nemotron_h_moe-dense qwen35-dense qwen35moe-moe qwen3next-moe"
).split()


def finest_cuts(header) -> list[int]:
    """The split points of the finest chain the cut rules accept (``cut_rules.range_problem``): from each start, the
    shortest accepted range after which the rest can still be cut."""
    import functools

    from ggufswarm.artifact.cut_rules import range_problem

    n = header.n_layers

    @functools.cache
    def reach(a: int) -> bool:
        return a == n or any(range_problem(header, a, b) is None and reach(b) for b in range(a + 1, n + 1))

    assert reach(0)
    points, a = [], 0
    while a < n:
        a = next(b for b in range(a + 1, n + 1) if range_problem(header, a, b) is None and reach(b))
        points.append(a)
    return points[:-1]


def one_kind(header, a: int, b: int) -> bool:
    """Whether blocks ``[a, b)`` are of one kind where the model has two: no sliding-window block in a model with some
    (not optional), or no recurrent or no attention block in a hybrid model."""
    swa, recurrent = header.swa, header.recurrent
    if swa is not None and any(swa) and not any(swa[a:b]) and not header.rules.swa_optional:
        return True
    return (
        recurrent is not None
        and not all(recurrent[: header.n_layers])
        and (not any(recurrent[a:b]) or not any(header.attention[a:b]))
    )


def _finest_chain_bitwise(name, zoo_dir, tmp_path, patch: str, holds) -> None:
    """The zoo file ``name``'s copy stretched to 8 blocks, cut into the finest chain the cut rules accept, holds a
    range ``holds(header, a, b)`` and equals llama.cpp's whole-model run bitwise (skipped without ``patch``)."""
    import numpy as np

    from ggufswarm.artifact.cut_rules import Header
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.runtime.llamacpp import patches
    from ggufswarm.runtime.llamacpp.derive import n_vocab

    if not patches.applied(patch):
        pytest.skip(f"needs llama.cpp patch {patch} (make setup)")
    copy = GGUFModelFile(zoo.stretch(GGUFModelFile(zoo_dir / f"{name}.gguf"), tmp_path / f"stretched-{name}.gguf"))
    header = Header(copy.metadata)
    points = finest_cuts(header)
    bounds = [0, *points, header.n_layers]
    assert any(holds(header, a, b) for a, b in zip(bounds, bounds[1:])), points
    ids = np.random.default_rng(zoo.SEED).integers(0, n_vocab(copy), zoo.N_PROMPT).tolist()
    kind, detail = zoo._run_cut(
        copy, points, ids, lambda: zoo.whole_model_run(copy.path, ids, zoo.N_DECODE, 1), tmp_path, 1
    )
    assert kind == "bitwise", (points, detail)


@pytest.mark.parametrize("name", ONE_KIND)
def test_one_kind_ranges_bitwise(name, zoo_dir, tmp_path):
    """Patch 0011: the zoo file's copy stretched to 8 blocks, cut into the finest chain the cut rules accept (one
    block a shard, where no other rule of the architecture needs more), which holds ranges of one kind of block,
    equals llama.cpp's whole-model run bitwise over a prefill and 20 greedy decode steps."""
    from ggufswarm.artifact.cut_rules import ONE_KIND_PATCH

    _finest_chain_bitwise(name, zoo_dir, tmp_path, ONE_KIND_PATCH, one_kind)


def indexer_free(header, a: int, b: int) -> bool:
    """Whether blocks ``[a, b)`` are a range only patch 0017 lets run: no attention block in glm5-next, no
    lightning-indexer block in dots3note (``cut_checks.IndexerProblem``)."""
    from ggufswarm.artifact import cut_checks
    from ggufswarm.artifact.cut_rules import range_problem

    return (
        isinstance(header.rules.check(header, a, b), cut_checks.IndexerProblem)
        and range_problem(header, a, b, indexer_inputs=False) is not None
    )


@pytest.mark.parametrize("name", ["glm5-next-moe", "dots3note-moe"])
def test_indexer_free_ranges_bitwise(name, zoo_dir, tmp_path):
    """Patch 0017: the finest chain of the stretched copy holds a range without an attention block (glm5-next: only
    recurrent KDA blocks) or without a lightning-indexer block (dots3note: only sliding-window blocks), whose graph
    sets no indexer inputs, and equals llama.cpp's whole-model run bitwise."""
    from ggufswarm.artifact.cut_rules import INDEXER_PATCH

    _finest_chain_bitwise(name, zoo_dir, tmp_path, INDEXER_PATCH, indexer_free)


def test_talkie_range_without_the_head_carries_no_lm_head(zoo_dir, monkeypatch):
    """Patch 0018: a talkie shard without the head stage carries the token embedding (every block adds it) but not
    the vocabulary-sized LM head, whose logits nobody reads; the head's shard carries it (its chains run bitwise:
    ``test_patch_0013_and_0014_architectures_run_at_every_boundary``). Without the patch every shard carries it."""
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.runtime.llamacpp import patches
    from ggufswarm.runtime.llamacpp.derive import shard_file_name, shard_tensors

    model = GGUFModelFile(zoo_dir / "talkie-dense.gguf")
    n = int(model.metadata["talkie.block_count"])
    if not patches.applied("0018-talkie-output-optional"):
        pytest.skip("needs llama.cpp patch 0018-talkie-output-optional (make setup)")
    names = {new for _, new in shard_tensors(model, 0, 1, head=False)}
    assert "token_embd.weight" in names and "output.weight" not in names
    assert "output.weight" in {new for _, new in shard_tensors(model, 1, n, head=True)}
    cached = shard_file_name(model, 0, 1, False)
    applied = patches.applied
    monkeypatch.setattr(patches, "applied", lambda name: name != "0018-talkie-output-optional" and applied(name))
    assert "output.weight" in {new for _, new in shard_tensors(model, 0, 1, head=False)}
    # a shard file cached with the patch is not the one a llama.cpp without it loads (nor the other way round)
    assert shard_file_name(model, 0, 1, False) != cached


def test_kda_ranges_start_at_any_block(verdicts):
    """kimi-linear, bailingmoe3 and kimi-k3 compute their recurrent (KDA) blocks with block 0's head count: a range
    starting at a KDA block is given the whole model's (``range_checks._recurrent_heads_check``), so every chain the
    zoo probes, one-block shards included, is accepted and bitwise; kimi-k3's attention residuals cross each cut
    (patch 0019)."""
    from ggufswarm.runtime.llamacpp import patches

    by_arch = {v.arch: v for v in verdicts}
    for arch in ("kimi-linear", "bailingmoe3", "kimi-k3"):
        v = by_arch[arch]
        if arch == "kimi-k3" and not patches.applied("0019-attention-residual-ranges"):
            assert v.kind == "refused" and "0019" in v.detail, (arch, v.detail)
            continue
        assert v.kind == "bitwise" and v.results and all(r == "bitwise" for r in v.results), (arch, v.results)
        assert any(len(cut) == cut[0] for cut in v.cuts), (arch, v.cuts)  # [n, 1, ..., n - 1]: one-block shards


def test_attention_residual_ranges_bitwise(zoo_dir, tmp_path):
    """Patch 0019: kimi-k3's copy stretched to 8 blocks with a checkpoint every 3 blocks (``attn_res.block_size`` 3:
    blocks 0, 3 and 6 bank their input), cut at every block boundary, equals llama.cpp's whole-model run bitwise; the
    hidden states crossing each cut are the residual stream and the checkpoints banked before it, ``n_embd`` wider
    after each checkpoint block, and each shard takes and sends those widths."""
    import numpy as np

    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.runtime.llamacpp import patches
    from ggufswarm.runtime.llamacpp.backend import LlamaCppShard
    from ggufswarm.runtime.llamacpp.derive import model_info, n_vocab
    from ggufswarm.runtime.shard import ShardSpec

    if not patches.applied("0019-attention-residual-ranges"):
        pytest.skip("needs llama.cpp patch 0019-attention-residual-ranges (make setup)")
    src = GGUFModelFile(zoo_dir / "kimi-k3-moe.gguf")
    copy = GGUFModelFile(zoo.stretch(src, tmp_path / "kimi-k3.gguf", overrides={"kimi-k3.attn_res.block_size": 3}))
    n_embd = int(copy.metadata["kimi-k3.embedding_length"])
    info = model_info(copy)
    # cut c: the stream and ceil(c / 3) checkpoints (cut 0: the first shard's token embeddings)
    assert [w // n_embd for w in info.widths] == [1, 2, 2, 2, 3, 3, 3, 4, 4]
    shard = LlamaCppShard(copy, ShardSpec(2, 5), n_ctx_seq=64, n_seq_max=1, n_batch=64, threads=1, cache_dir=tmp_path)
    try:
        kv = shard.new_session(64)
        out = shard.forward(kv, np.zeros((3, 2 * n_embd), dtype=np.float32))
        assert (shard.n_embd_in, shard.n_embd_out, out.shape) == (2 * n_embd, 3 * n_embd, (3, 3 * n_embd))
        with pytest.raises(ValueError, match="expected hidden states"):
            shard.forward(kv, np.zeros((1, n_embd), dtype=np.float32))
        kv.close()
    finally:
        shard.close()
    ids = np.random.default_rng(zoo.SEED).integers(0, n_vocab(copy), zoo.N_PROMPT).tolist()
    kind, detail = zoo._run_cut(
        copy, list(range(1, 8)), ids, lambda: zoo.whole_model_run(copy.path, ids, zoo.N_DECODE, 1), tmp_path, 1
    )
    assert kind == "bitwise", detail


def test_patch_0020_block_patterns_run_at_every_boundary(verdicts):
    """Patch 0020 (afmoe's, smollm3's and llama4's no-RoPE block of every 4, llama4's and ernie4_5-moe's MoE block of
    every interleave_moe_layer_step, counted from the whole model's block 0): every chain the zoo probes, one-block
    shards included, is accepted and bitwise (before it, a range had to start where the patterns kept their phase)."""
    from ggufswarm.artifact.cut_rules import PATTERN_PATCH
    from ggufswarm.runtime.llamacpp import patches

    if not patches.applied(PATTERN_PATCH):
        pytest.skip(f"needs llama.cpp patch {PATTERN_PATCH} (make setup)")
    by_arch = {v.arch: v for v in verdicts}
    for arch in PATTERN_PATCH_ARCHS:
        v = by_arch[arch]
        assert v.kind == "bitwise" and v.results and all(r == "bitwise" for r in v.results), (arch, v.results)
        assert any(len(cut) == cut[0] for cut in v.cuts), (arch, v.cuts)  # [n, 1, ..., n - 1]: one-block shards


def test_minimax_m3_ranges_of_dense_blocks_run(verdicts):
    """Patch 0017 (a graph sets only the sparse-attention inputs a layer uses): minimax-m3's ranges of only leading
    dense-attention blocks run, so every chain the zoo probes, one-block shards included, is bitwise."""
    from ggufswarm.artifact.cut_rules import INDEXER_PATCH
    from ggufswarm.runtime.llamacpp import patches

    if not patches.applied(INDEXER_PATCH):
        pytest.skip(f"needs llama.cpp patch {INDEXER_PATCH} (make setup)")
    v = {v.arch: v for v in verdicts}["minimax-m3"]
    assert v.kind == "bitwise" and v.results and all(r == "bitwise" for r in v.results), v.results
    assert any(len(cut) == cut[0] for cut in v.cuts), v.cuts
