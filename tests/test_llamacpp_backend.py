"""llama.cpp backend: chained shards are bitwise equal to llama.cpp's own full-model run.

The reference is llama-cpp-python's ``Llama`` on the original GGUF (its own context, batch and
graph code), run in the same test with the same threads (2), ubatch (512) and flash attention
(llama.cpp's CPU default). Our shards are derived GGUFs run through the C API with hidden states
passed as float32, so equality must be exact, not approximate.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from route_fixtures import greedy_prompts, llama_cpp_greedy_tokens
from tinygemma4 import write_tiny_gemma4_model
from tinymodels import write_tiny_model
from tinymoe import write_tiny_deepseek4_model, write_tiny_moe_model
from zoo import whole_model_run

from ggufswarm.artifact.cut_rules import ONE_KIND_PATCH
from ggufswarm.artifact.default_model import smollm2_path
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.local import LocalModel
from ggufswarm.runtime.llamacpp import patches
from ggufswarm.runtime.llamacpp.archs import recurrent_layers, rules_for
from ggufswarm.runtime.llamacpp.backend import LlamaCppShard, model_info
from ggufswarm.runtime.llamacpp.errors import LlamaCppError, UnsupportedShard
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.shard import ShardSpec, split_at

THREADS = 2
N_DECODE = 20


def llama_cpp_run(path, ids: list[int], n_decode: int, n_ctx: int = 2048):
    """llama.cpp's full model: all prefill logits, then ``n_decode`` greedy steps (tokens, their logits)."""
    return whole_model_run(path, ids, n_decode, THREADS, n_ctx)


def chain(path, points: list[int], tmp_path, n_ctx: int = 2048, sessions: int = 1) -> list[LlamaCppShard]:
    file = GGUFModelFile(path)
    specs = split_at(model_info(file).n_layers, points)
    return [
        LlamaCppShard(
            file, s, n_ctx_seq=n_ctx, n_seq_max=sessions, threads=THREADS, all_logits=True, cache_dir=tmp_path
        )
        for s in specs
    ]


def run_chain(shards, kvs, ids: list[int], logits: str = "all") -> np.ndarray:
    x = np.asarray(ids)
    for shard, kv in zip(shards, kvs):  # a shard routing by token id (DeepSeek-V4) gets them with the hidden states
        x = shard.forward(kv, x, logits=logits, **({"token_ids": ids} if shard.needs_token_ids else {}))
    return x


def assert_chain_equals_llama_cpp(path, points, ids, tmp_path, n_ctx=2048, reference=None):
    """``reference``: ``llama_cpp_run(path, ids, N_DECODE, n_ctx)`` computed once for several cut points."""
    prefill, tokens, decode = reference or llama_cpp_run(path, ids, N_DECODE, n_ctx)
    shards = chain(path, points, tmp_path, n_ctx)
    kvs = [s.new_session(n_ctx) for s in shards]
    out = run_chain(shards, kvs, ids)
    assert out.shape == prefill.shape
    assert np.array_equal(out, prefill), f"prefill max |diff| {np.abs(out - prefill).max()}"
    for i, tok in enumerate(tokens):
        out = run_chain(shards, kvs, [tok], "last")[0]
        assert np.array_equal(out, decode[i]), f"decode step {i}: max |diff| {np.abs(out - decode[i]).max()}"
    for s in shards:
        s.close()


@pytest.fixture(scope="module")
def long_ids(gemma_path, reference_text):
    from ggufswarm.client.tokenizer import Tokenizer

    file = GGUFModelFile(gemma_path)
    ids = Tokenizer(str(gemma_path), file.metadata).encode(reference_text[:4000])
    assert len(ids) > 700
    return ids[:720]


@pytest.mark.slow
@pytest.mark.parametrize("points", [[6, 12], [4, 10], [7, 13]], ids=["6,12", "4,10", "7,13"])
def test_gemma_shards_bitwise(gemma_path, points, tmp_path):
    ids = LocalModel.load(gemma_path, backend="llama.cpp", max_length=64).prompt_ids("The quick brown fox jumps over")
    assert_chain_equals_llama_cpp(gemma_path, points, ids, tmp_path)


@pytest.mark.slow
def test_gemma_shards_bitwise_past_sliding_window(gemma_path, long_ids, tmp_path):
    """720 tokens: past the 512-token window, with a split not aligned to the 6-layer pattern."""
    assert_chain_equals_llama_cpp(gemma_path, [4, 10], long_ids, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("points", [[10, 20], [7, 13]], ids=["10,20", "7,13"])
def test_smollm2_shards_bitwise(points, tmp_path):
    path = smollm2_path()
    model = LocalModel.load(path, backend="llama.cpp", max_length=64)
    assert model.file.architecture == "llama" and model.config.n_layers == 30
    ids = model.prompt_ids("What is the capital of France?", chat=True)
    assert_chain_equals_llama_cpp(path, points, ids, tmp_path)


TINY = [
    ("llama", lambda p: write_tiny_model(p, "llama", n_layers=6)),
    ("qwen3", lambda p: write_tiny_model(p, "qwen3", n_layers=6, quant=True)),
    ("gemma3", lambda p: write_tiny_model(p, "gemma3", n_layers=6, sliding_window=16)),
    *[(a, lambda p, a=a: write_tiny_moe_model(p, a)) for a in ("qwen3moe", "deepseek", "deepseek2", "gpt-oss")],
]


@pytest.mark.parametrize("arch,write", TINY, ids=[a for a, _ in TINY])
def test_tiny_architectures_bitwise(arch, write, tiny_dir, tmp_path):
    """3-shard chains [0,2)+[2,4)+[4,6) of random-weight models: leading dense blocks end inside / at a cut
    (deepseek, deepseek2), sliding-window layers (gemma3, gpt-oss), MLA (deepseek2), experts (the MoE ones)."""
    path = write(tiny_dir / f"bitwise-{arch}.gguf")
    rng = np.random.default_rng(3)
    ids = [1] + rng.integers(3, 384, 40).tolist()  # past the sliding windows (16, 8)
    assert_chain_equals_llama_cpp(path, [2, 4], ids, tmp_path, n_ctx=256)


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe", "qwen35"])
def test_hybrid_recurrent_shards_bitwise(arch, tiny_dir, tmp_path):
    """Qwen3-Next, Qwen3.5-MoE (Ornith) and the dense Qwen3.5 (gated delta-net recurrent blocks + gated full
    attention; MoE with a gated shared expert, or a SwiGLU FFN), 9 blocks with full_attention_interval 3 (attention at
    2, 5, 8): the 3-shard chain
    [0,4)+[4,6)+[6,9) equals llama.cpp's whole model bitwise over a prefill and 20 decode steps. The middle shard's
    attention block is its block 1, which llama.cpp would take for a recurrent one if the shard file did not carry
    ``attention.recurrent_layers``; qwen35moe's IMRoPE needs its four positions per token in hidden-state batches.
    Ranges of one kind of block run bitwise too (patch 0011: [0,2) only recurrent, [2,3) only attention)."""
    path = write_tiny_moe_model(tiny_dir / f"bitwise-{arch}.gguf", arch, n_layers=9)
    file = GGUFModelFile(path)
    assert recurrent_layers(file) == [True, True, False] * 3
    ids = [1] + np.random.default_rng(3).integers(3, 384, 40).tolist()
    reference = llama_cpp_run(path, ids, N_DECODE, 256)
    assert_chain_equals_llama_cpp(path, [4, 6], ids, tmp_path, n_ctx=256, reference=reference)
    assert_chain_equals_llama_cpp(path, [2, 3, 4, 5, 6, 8], ids, tmp_path, n_ctx=256, reference=reference)


def test_one_kind_ranges_without_the_patch_are_refused(tiny_dir, tmp_path, monkeypatch):
    """A llama-cpp-python without patch 0011 (a user's own): a hybrid range of one kind of block is refused in one
    line naming the patch, before llama.cpp would abort; a range of both kinds still runs."""
    monkeypatch.setattr(patches, "PATCH_MARKERS", {**patches.PATCH_MARKERS, ONE_KIND_PATCH: b"not in any library"})
    file = GGUFModelFile(write_tiny_moe_model(tiny_dir / "bitwise-qwen3next.gguf", "qwen3next", n_layers=9))
    for a, b, kind in ((0, 2, "full-attention"), (2, 3, "recurrent")):
        with pytest.raises(UnsupportedShard, match=f"{a}:{b} has no {kind} block.*{ONE_KIND_PATCH}") as err:
            LlamaCppShard(file, ShardSpec(a, b), n_ctx_seq=256, n_seq_max=1, cache_dir=tmp_path)
        assert "\n" not in str(err.value)
    LlamaCppShard(file, ShardSpec(2, 4), n_ctx_seq=256, n_seq_max=1, cache_dir=tmp_path).close()


def test_qwen3next_truncates_only_to_exact_state_checkpoints(tiny_dir, tmp_path):
    """A recurrent shard keeps one state per session: truncation goes to 0, or to a position whose full sequence state
    it copied (``state_bytes``, as the node does for each cache snapshot) or loaded; there the chain continues
    bitwise as it did the first time. Any other cut is StateNotAtPosition (409 state_not_at_position) and changes
    nothing. The accounting's ``state_bytes_per_session`` (what a node advertises) is llama.cpp's own state size:
    a serialized sequence is that plus the attention KV and 12 bytes of cell metadata per token, plus a header."""
    from ggufswarm.artifact.accounting import shard_account
    from ggufswarm.net.http import as_protocol_error
    from ggufswarm.runtime.llamacpp.errors import StateNotAtPosition

    path = write_tiny_moe_model(tiny_dir / "bitwise-qwen3next.gguf", "qwen3next", n_layers=9)
    file = GGUFModelFile(path)
    shards = chain(path, [4, 6], tmp_path, n_ctx=256)
    assert all(s.exact_states_only for s in shards)
    kvs = [s.new_session(256) for s in shards]
    rng = np.random.default_rng(5)
    prompt, more = [1] + rng.integers(3, 384, 19).tolist(), rng.integers(3, 384, 6).tolist()
    run_chain(shards, kvs, prompt, "last")
    states = [s.state_bytes(kv) for s, kv in zip(shards, kvs)]  # checkpoints at 20
    first = [run_chain(shards, kvs, [t], "last") for t in more]
    for s, kv, state in zip(shards, kvs, states):
        acc = shard_account(file, s.spec.start, s.spec.end)
        assert acc.state_bytes_per_session > 0 and acc.kv_bytes_per_token > 0
        overhead = len(state) - 20 * (acc.kv_bytes_per_token + 12) - acc.state_bytes_per_session
        assert 0 <= overhead < 256, (s.spec, len(state), acc)
        with pytest.raises(StateNotAtPosition, match=r"cannot be rolled back to 23 tokens.*\[20\]") as err:
            kv.truncate(23)
        assert as_protocol_error(err.value).status == 409 and kv.length == 26
    again = run_chain(shards, kvs, [more[-1]], "last")  # nothing changed: the session goes on from 26
    for kv in kvs:
        kv.truncate(kv.length)  # to its own length: always possible
        kv.truncate(20)
        assert kv.length == 20 and sorted(kv.checkpoints) == [20]
    assert all(np.array_equal(run_chain(shards, kvs, [t], "last"), ref) for t, ref in zip(more, first))
    assert np.array_equal(run_chain(shards, kvs, [more[-1]], "last"), again)
    for kv in kvs:
        kv.truncate(0)
    run_chain(shards, kvs, prompt, "last")
    assert np.array_equal(run_chain(shards, kvs, [more[0]], "last"), first[0])
    for s in shards:
        s.close()


def test_glm_dsa_shards_bitwise(tiny_dir, tmp_path):
    """GLM-5.2 (glm-dsa: MLA + DSA lightning indexer, leading dense block, MoE with a shared expert), 8 blocks with
    llama.cpp's default GLM-5.2 indexer pattern (1M trained context, no indexer.types key: blocks 0, 1, 2, 6 full,
    3-5 and 7 shared): the 3-shard chain [0,2)+[2,6)+[6,8) equals llama.cpp's whole model bitwise, 41 tokens
    past the indexer's top-12 so the sparse selection matters. The shard files carry their own indexer types
    (defaulted from the shard's block 0, [2,6) would expect indexer weights on blocks 3 and 4); a range
    starting at a shared-indexer block is refused (its top-k would have to cross the cut)."""
    from ggufswarm.runtime.llamacpp.range_checks import glm_dsa_indexer_types

    path = write_tiny_moe_model(tiny_dir / "bitwise-glm-dsa.gguf", "glm-dsa", n_layers=8)
    file = GGUFModelFile(path)
    assert glm_dsa_indexer_types(file) == [1, 1, 1, 0, 0, 0, 1, 0]
    with pytest.raises(UnsupportedShard, match=r"block 3 is a shared-indexer block.*full-indexer block 2.*0, 1, 2, 6"):
        LlamaCppShard(file, ShardSpec(3, 6), n_ctx_seq=256, n_seq_max=1, cache_dir=tmp_path)
    ids = [1] + np.random.default_rng(3).integers(3, 384, 40).tolist()
    assert_chain_equals_llama_cpp(path, [2, 6], ids, tmp_path, n_ctx=256)


@pytest.fixture(scope="module")
def deepseek4_path(tiny_dir):
    """The tiny DeepSeek-V4 in 6 blocks: compress ratios 0/0/4/128/4/128 (as DeepSeek-V4-Flash: two raw blocks,
    then the compressed attention with its lightning indexer and the heavily compressed one alternating),
    hyper-connections of 4 streams, 3 hash-routed blocks."""
    return write_tiny_deepseek4_model(
        tiny_dir / "bitwise-deepseek4.gguf", compress_ratios=[0, 0, 4, 128, 4, 128], hash_layers=3
    )


@pytest.mark.parametrize("points", [list(p) for p in itertools.combinations(range(1, 6), 2)])
def test_deepseek4_shards_bitwise(deepseek4_path, points, tmp_path):
    """DeepSeek-V4 (deepseek4: hyper-connections, compressed attention with ratios 0/4/128, lightning indexer,
    hash-routed blocks, sqrt-softplus routing, grouped output LoRA, attention sinks) as 3 shards cut at every pair
    of block boundaries, including inside the hash-routed blocks 0-2: bitwise equal to llama.cpp's whole model over
    a 150-token prompt (past the 128-token compression block) and 20 decode steps. The cuts carry the 4 residual
    streams (4 x n_embd per token) and each shard's batch the token ids (llama.cpp patches 0001-0002)."""
    ids = [1] + np.random.default_rng(3).integers(3, 384, 149).tolist()
    assert_chain_equals_llama_cpp(deepseek4_path, points, ids, tmp_path, n_ctx=256)


def test_deepseek4_hash_blocks_route_by_the_token_ids(deepseek4_path, tmp_path):
    """The control for the test above: a middle shard holding a hash-routed block, given other token ids with the
    same hidden states, computes something else (the token ids reach llama.cpp's expert choice); a shard asked to
    run without them refuses; the hidden states between shards are 4 x n_embd wide."""
    first, middle, head = chain(deepseek4_path, [2, 4], tmp_path, n_ctx=256, sessions=2)
    assert first.cfg.n_embd == middle.cfg.n_embd == 4 * 128 and middle.needs_token_ids
    ids = [1] + np.random.default_rng(4).integers(3, 384, 39).tolist()
    x = first.forward(first.new_session(256), np.asarray(ids))
    assert x.shape == (40, 512)
    kv_a, kv_b = middle.new_session(256), middle.new_session(256)
    with pytest.raises(ValueError, match="routes blocks by token id"):
        middle.forward(kv_a, x)
    same = middle.forward(kv_a, x, token_ids=ids)
    other = middle.forward(kv_b, x, token_ids=[(t + 1) % 384 for t in ids])
    assert not np.array_equal(same, other)
    for s in (first, middle, head):
        s.close()


def test_deepseek4_truncates_only_to_exact_state_checkpoints(deepseek4_path, tmp_path):
    """Its cache refuses partial removal, so a session (here of a middle shard) rolls back only to an exact state
    checkpoint, and continues bitwise from there."""
    from ggufswarm.runtime.llamacpp.errors import StateNotAtPosition

    shards = chain(deepseek4_path, [2, 4], tmp_path, n_ctx=256)
    assert all(s.exact_states_only for s in shards)
    kvs = [s.new_session(256) for s in shards]
    ids = [1] + np.random.default_rng(3).integers(3, 384, 149).tolist()
    run_chain(shards, kvs, ids, "last")
    for s, kv in zip(shards, kvs):
        s.state_bytes(kv)
    nxt = [run_chain(shards, kvs, [t], "last") for t in (5, 6, 7)]
    with pytest.raises(StateNotAtPosition, match=r"\[150\]"):
        kvs[1].truncate(151)
    for kv in kvs:
        kv.truncate(150)
    assert all(np.array_equal(run_chain(shards, kvs, [t], "last"), ref) for t, ref in zip((5, 6, 7), nxt))
    for s in shards:
        s.close()


def test_layer_range_without_the_patch_is_refused_in_one_line(deepseek4_path, tmp_path, monkeypatch):
    """A llama-cpp-python without ggufswarm's patch queue (a user's own): a DeepSeek-V4 layer range is refused before
    llama.cpp loads it, naming the patch and how to get it; the whole model still runs."""
    from ggufswarm.runtime.llamacpp import patches

    monkeypatch.setattr(
        patches, "PATCH_MARKERS", {**patches.PATCH_MARKERS, "0002-deepseek4-layer-range": b"not in any library"}
    )
    with pytest.raises(UnsupportedShard, match="needs llama.cpp patch 0002-deepseek4-layer-range.*make setup") as err:
        LlamaCppShard(
            GGUFModelFile(deepseek4_path), ShardSpec(0, 2, embed=True), n_ctx_seq=256, n_seq_max=1, cache_dir=tmp_path
        )
    assert "\n" not in str(err.value)
    whole = LlamaCppShard(
        GGUFModelFile(deepseek4_path),
        ShardSpec(0, 6, embed=True, head=True),
        n_ctx_seq=256,
        n_seq_max=1,
        cache_dir=tmp_path,
    )
    whole.close()


def accepts_range(file, acc, a: int, b: int) -> bool:
    """Whether the backend derives a shard of blocks ``[a, b)`` (the head on the last one), asserting that the header
    accounting ``plan`` places with (``acc``: HeaderAccounts) agrees (``range_problem``)."""
    from ggufswarm.runtime.llamacpp.derive import shard_metadata

    try:
        shard_metadata(file, a, b, head=b == acc.n_layers)
        backend = True
    except UnsupportedShard:
        backend = False
    assert (acc.range_problem(a, b) is None) == backend, (a, b, acc.range_problem(a, b))
    return backend


@pytest.mark.parametrize("arch", ["qwen3next", "glm-dsa", "deepseek2"])
def test_plan_cut_rules_are_the_backends(arch, tiny_dir):
    """The header accounting's cut rules (``range_problem``, from the header alone: what ``plan`` places with, the
    node's own ``artifact.cut_rules``) accept exactly the layer ranges the llama.cpp backend derives shards for, on
    every range of the tiny hybrid and DSA models (and of a model without such rules)."""
    from ggufswarm.artifact.accounting import HeaderAccounts

    path = write_tiny_moe_model(tiny_dir / f"cuts-{arch}.gguf", arch, n_layers=9 if arch == "qwen3next" else 8)
    file = GGUFModelFile(path)
    acc = HeaderAccounts.from_model(file)
    verdicts = [accepts_range(file, acc, a, b) for a in range(acc.n_layers) for b in range(a + 1, acc.n_layers + 1)]
    # the rules do refuse some ranges of glm-dsa (and of qwen3next those of one kind of block, without patch 0011)
    assert all(verdicts) == (arch == "deepseek2" or arch == "qwen3next" and patches.applied(ONE_KIND_PATCH))


def test_gemma3_ranges_without_a_sliding_window_layer(gemma_path, tmp_path, monkeypatch):
    """A Gemma 3 range of only global layers (5, 11, 17) runs (patch 0011: an empty sliding-window cache), so the
    backend and the header accounting ``plan`` places with accept every range; a llama.cpp without the patch asserts
    one sliding-window layer (is_swa_any), and such a range is refused with the reason before it could abort."""
    from ggufswarm.artifact.accounting import HeaderAccounts

    file = GGUFModelFile(gemma_path)
    acc = HeaderAccounts.from_model(file)
    assert all(accepts_range(file, acc, a, b) for a in range(18) for b in range(a + 1, 19))
    LlamaCppShard(file, ShardSpec(17, 18, head=True), n_ctx_seq=256, n_seq_max=1, cache_dir=tmp_path).close()
    monkeypatch.setattr(patches, "PATCH_MARKERS", {**patches.PATCH_MARKERS, ONE_KIND_PATCH: b"not in any library"})
    unpatched = tmp_path / "unpatched"  # (a shard header derived before is not checked again)
    with pytest.raises(UnsupportedShard, match=f"17:18 holds no sliding-window layer.*is_swa_any.*{ONE_KIND_PATCH}"):
        LlamaCppShard(file, ShardSpec(17, 18, head=True), n_ctx_seq=256, n_seq_max=1, cache_dir=unpatched)
    LlamaCppShard(file, ShardSpec(16, 18, head=True), n_ctx_seq=256, n_seq_max=1, cache_dir=unpatched).close()


@pytest.mark.slow
def test_gemma3_global_layer_shards_bitwise(gemma_path, long_ids, tmp_path):
    """Gemma 3 cut so that each global layer (5, 11, 17) is a shard of its own, with neither a sliding-window layer
    nor a sliding-window cache that holds one: bitwise llama.cpp's whole model past the sliding window."""
    assert_chain_equals_llama_cpp(gemma_path, [5, 6, 11, 12, 17], long_ids, tmp_path)


GEMMA4_IDS = [1] + np.random.default_rng(3).integers(3, 384, 149).tolist()  # past the 32-token window


@pytest.fixture(scope="module")
def gemma4_path(tiny_dir):
    """The tiny Gemma 4 (31B layout) in 8 blocks: sliding-window except 2, 5 and 7 (full attention)."""
    return write_tiny_gemma4_model(tiny_dir / "bitwise-gemma4.gguf")


@pytest.fixture(scope="module")
def gemma4_reference(gemma4_path):
    """llama.cpp's whole model on ``GEMMA4_IDS``: prefill logits, 20 greedy tokens and their logits."""
    return llama_cpp_run(gemma4_path, GEMMA4_IDS, N_DECODE, 256)


# every pair of cuts leaving each of the 3 shards two blocks or more (llama.cpp's gemma4 KV cache needs two)
GEMMA4_CUTS = [[a, b] for a, b in itertools.combinations(range(2, 7), 2) if b - a >= 2]


@pytest.mark.parametrize("points", GEMMA4_CUTS, ids=[f"{a},{b}" for a, b in GEMMA4_CUTS])
def test_gemma4_shards_bitwise(gemma4_path, gemma4_reference, points, tmp_path):
    """Gemma 4 (gemma4, 31B's dense layout: per-layer sliding-window array, bigger heads with fewer KV heads and
    K-as-V on full-attention blocks, proportional RoPE through rope_freqs, sqrt(n_embd) token scale, layer output
    scale, final logit softcapping) as 3 shards cut at every admissible pair of block boundaries: bitwise equal to
    llama.cpp's whole model over a 150-token prompt (past the 32-token window) and 20 decode steps. Shards of
    sliding-window blocks alone ([0,2), [3,5)) leave rope_freqs out (llama.cpp would refuse the unused tensor); a shard
    may start and end on a full-attention block ([2,6))."""
    assert_chain_equals_llama_cpp(gemma4_path, points, GEMMA4_IDS, tmp_path, n_ctx=256, reference=gemma4_reference)


def test_gemma4_moe_shards_bitwise(tiny_dir, tmp_path):
    """Gemma 4 26B-A4B's layout (the dense FFN as a shared expert beside 8 routed experts, top-2, with the router's
    own RMS norm and scale, fused gate/up expert weights and per-expert output scales): 3 shards bitwise equal."""
    path = write_tiny_gemma4_model(tiny_dir / "bitwise-gemma4-moe.gguf", n_expert=8)
    assert_chain_equals_llama_cpp(path, [3, 5], GEMMA4_IDS, tmp_path, n_ctx=256)


def test_gemma4_cut_rules(gemma4_path, tmp_path):
    """The backend and the header accounting ``plan`` places with agree on every range of the tiny Gemma 4: refused
    are the one-block ranges (llama.cpp's gemma4 KV cache asserts n_layer_kv_from_start >= 2, which would abort the
    node), with the reason; rope_freqs goes only to ranges with a full-attention block; the KV per token counts
    each kind's own heads (sliding-window: 4 KV heads of 32, full: 1 of 64; K and V, f16)."""
    from ggufswarm.artifact.accounting import HeaderAccounts, shard_account
    from ggufswarm.runtime.llamacpp.derive import shard_tensors

    file = GGUFModelFile(gemma4_path)
    with pytest.raises(UnsupportedShard, match=r"5:6 has one block.*n_layer_kv_from_start >= 2"):
        LlamaCppShard(file, ShardSpec(5, 6), n_ctx_seq=256, n_seq_max=1, cache_dir=tmp_path)
    acc = HeaderAccounts.from_model(file)
    refused = []
    for a in range(8):
        for b in range(a + 1, 9):
            if not accepts_range(file, acc, a, b):
                refused.append((a, b))
            else:
                has_freqs = "rope_freqs.weight" in [n for n, _ in shard_tensors(file, a, b, head=b == 8)]
                assert has_freqs == any(i in (2, 5, 7) for i in range(a, b)), (a, b)
    assert refused == [(i, i + 1) for i in range(8)]
    assert [layer.kv_bytes_per_token for layer in acc.layers] == [512, 512, 256, 512, 512, 256, 512, 256]
    assert shard_account(file, 2, 5).kv_bytes_per_token == 1280


@pytest.mark.parametrize(
    "variant", [{"n_embd_per_layer": 16}, {"shared_kv_layers": 2}], ids=["per-layer-embeddings", "shared-kv"]
)
def test_gemma4_e2b_layout_runs_only_whole(variant, tiny_dir, tmp_path):
    """Gemma 4 E2B/E4B's layout (per-layer token embeddings computed from the token ids at the graph's start, or
    blocks attending with an earlier block's KV cache): a layer range is refused with the reason, by the backend and
    by the header accounting; the whole model loads and runs."""
    from ggufswarm.artifact.accounting import HeaderAccounts

    path = write_tiny_gemma4_model(tiny_dir / f"gemma4-{next(iter(variant))}.gguf", **variant)
    file = GGUFModelFile(path)
    reason = "per-layer token embeddings" if "n_embd_per_layer" in variant else "shared-KV layers"
    with pytest.raises(UnsupportedShard, match=f"{reason}.*only the whole model runs"):
        LlamaCppShard(file, ShardSpec(0, 4, embed=True), n_ctx_seq=256, n_seq_max=1, cache_dir=tmp_path)
    acc = HeaderAccounts.from_model(file)
    assert acc.range_problem(0, 4) and acc.range_problem(4, 8) and acc.range_problem(0, 8) is None
    if "shared_kv_layers" in variant:  # blocks 6 and 7 hold no cache of their own
        assert [layer.kv_bytes_per_token for layer in acc.layers[5:]] == [256, 0, 0]
    whole = LlamaCppShard(
        file, ShardSpec(0, 8, embed=True, head=True), n_ctx_seq=256, n_seq_max=1, threads=THREADS, cache_dir=tmp_path
    )
    out = whole.forward(whole.new_session(256), np.asarray(GEMMA4_IDS[:40]), logits="last")
    assert out.shape == (1, 384) and np.isfinite(out).all()
    whole.close()


@pytest.mark.parametrize("points", [[1, 3], [2, 4], [3, 5]])
def test_glm4moe_shards_bitwise(points, tiny_dir, tmp_path):
    """GLM-4.5/4.6/4.7 (glm4moe; a leading dense block, MTP block dropped): llama.cpp's graph aborts on embedding
    input of a file without M-RoPE, unless the file is a layer range (llama.cpp patch 0003); 3 shards equal
    llama.cpp's whole model bitwise."""
    path = write_tiny_moe_model(tiny_dir / "bitwise-glm4moe.gguf", "glm4moe")
    ids = [1] + np.random.default_rng(3).integers(3, 384, 40).tolist()
    assert_chain_equals_llama_cpp(path, points, ids, tmp_path, n_ctx=256)


@pytest.mark.slow
def test_sessions_interleave_truncate_and_restore(gemma_path, tmp_path):
    """Two sessions interleaved equal each alone, and a session after the idle shards gave their compute buffers
    back (``trim_compute_buffers``) equals one before; truncate-then-decode equals a fresh session; a sequence
    state copied out of one context and loaded into another shard instance, of the same or another number of
    sequences (patch 0016), continues identically."""
    shards = chain(gemma_path, [6, 12], tmp_path, n_ctx=512, sessions=2)
    model = LocalModel.load(gemma_path, backend="llama.cpp", max_length=64)
    a_ids, b_ids = model.prompt_ids("Once upon a time"), model.prompt_ids("def fibonacci(n):")

    def solo(ids, n=8):
        kvs = [s.new_session(512) for s in shards]
        outs = [run_chain(shards, kvs, ids, "last")]
        for _ in range(n):
            outs.append(run_chain(shards, kvs, [int(outs[-1].argmax())], "last"))
        for kv in kvs:
            kv.close()
        return outs

    ref_a, ref_b = solo(a_ids), solo(b_ids)
    # compute buffers given back while idle (patch 0012) are written again by the next steps: the same bits; the
    # head's output buffer (the last decode's logits: a row of the vocabulary per sequence sampled) is cleared too
    from ggufswarm.runtime.llamacpp.bindings import L

    def last_logits():
        return np.ctypeslib.as_array(L.llama_get_logits(shards[-1]._ctx), shape=(64,)).copy()

    assert np.any(last_logits() != 0)
    assert all(s.trim_compute_buffers() for s in shards)
    assert not np.any(last_logits() != 0)
    assert all(np.array_equal(x, y) for x, y in zip(solo(a_ids), ref_a))
    kva, kvb = [s.new_session(512) for s in shards], [s.new_session(512) for s in shards]
    got_a, got_b = [run_chain(shards, kva, a_ids, "last")], [run_chain(shards, kvb, b_ids, "last")]
    for _ in range(8):
        got_a.append(run_chain(shards, kva, [int(got_a[-1].argmax())], "last"))
        got_b.append(run_chain(shards, kvb, [int(got_b[-1].argmax())], "last"))
    assert all(np.array_equal(x, y) for x, y in zip(got_a, ref_a))
    assert all(np.array_equal(x, y) for x, y in zip(got_b, ref_b))

    # truncate session b back to its prompt and decode again: equals the fresh run
    for kv in kvb:
        kv.truncate(len(b_ids) - 1)
    redo = run_chain(shards, kvb, [b_ids[-1]], "last")
    assert np.array_equal(redo, ref_b[0])

    # copy session a's state (every shard) into a second set of shard instances, continue there
    states = [s.state_bytes(kv) for s, kv in zip(shards, kva)]
    held = kva[0].length
    others = chain(gemma_path, [6, 12], tmp_path, n_ctx=512, sessions=2)  # llama.cpp states hold the stream count
    kvo = [s.new_session(512) for s in others]
    for s, kv, st in zip(others, kvo, states):
        s.load_state(kv, st, held)
    nxt = int(got_a[-1].argmax())
    want = run_chain(shards, kva, [nxt], "last")
    assert np.array_equal(run_chain(others, kvo, [nxt], "last"), want)
    with pytest.raises(LlamaCppError):
        others[0].load_state(kvo[0], b"not a llama.cpp state", 4)
    assert kvo[0].length == 0  # a rejected state leaves the session empty, never half-loaded
    # and into a context with another number of sequences (2 streams, where the states were saved from 3: llama.cpp
    # refused them, "n_stream mismatch", before patch 0016)
    single = chain(gemma_path, [6, 12], tmp_path, n_ctx=512, sessions=1)
    kvs = [s.new_session(512) for s in single]
    for s, kv, st in zip(single, kvs, states):
        s.load_state(kv, st, held)
    assert np.array_equal(run_chain(single, kvs, [nxt], "last"), want)
    for s in shards + others + single:
        s.close()


@pytest.mark.slow
def test_greedy_equals_llama_cpp_single_and_split(gemma_path, reference_text):
    """Ten varied prompts, 24 greedy tokens: the default in-process path (llama.cpp backend), as one shard
    and as [0,4)+[4,10)+[10,18), equals llama.cpp's own greedy tokens 10/10."""
    one = LocalModel.load(gemma_path, max_length=1024, threads=1)
    three = LocalModel.load(gemma_path, split=[4, 10], max_length=1024, threads=1)
    assert one.backend == "llama.cpp"
    prompts = [one.prompt_ids(p) for p in greedy_prompts(reference_text)]
    refs = llama_cpp_greedy_tokens(gemma_path, prompts, 24)
    for model in (one, three):
        for ids, ref in zip(prompts, refs):
            session = model.session(len(ids) + 32, SamplingParams(temperature=0))
            toks = [session.step(ids)]
            while len(toks) < 24:
                toks.append(session.step([toks[-1]]))
            session.close()
            assert toks == ref, (len(model.shards), model.tokenizer.decode(ids[:8]))


def test_bad_input(tiny_dir, tmp_path):
    path = write_tiny_model(tiny_dir / "bad-input-llama.gguf", "llama", n_layers=6)
    file = GGUFModelFile(path)
    with pytest.raises(UnsupportedShard, match="unsupported architecture 'rwkv7' for the llama.cpp backend"):
        rules_for("rwkv7")  # (outside the zoo: test-llama-archs writes no RWKV model)
    mid = LlamaCppShard(file, ShardSpec(2, 4), n_ctx_seq=256, n_seq_max=1, threads=1, cache_dir=tmp_path)
    kv = mid.new_session(256)
    with pytest.raises(ValueError, match=r"expected hidden states \[n_tokens, 256\]"):
        mid.forward(kv, torch.zeros(3, 255))
    with pytest.raises(ValueError, match="at most"):
        mid.forward(kv, torch.zeros(mid.n_batch + 1, 256))
    assert kv.length == 0
    out = mid.forward(kv, torch.ones(2, 256))  # still serving
    assert out.shape == (2, 256) and kv.length == 2
    first = LlamaCppShard(file, ShardSpec(0, 2, embed=True), n_ctx_seq=256, n_seq_max=1, threads=1, cache_dir=tmp_path)
    kv0 = first.new_session(256)
    with pytest.raises(ValueError, match="token id out of range"):
        first.forward(kv0, torch.tensor([1, 384]))
    with pytest.raises(Exception, match="kv_budget|sequence|session slots"):
        first.new_session(256)  # its only slot is taken
    with pytest.raises(Exception, match="cells per session"):
        kv0.close()
        first.new_session(100_000)
    for s in (mid, first):
        s.close()


@pytest.mark.slow
def test_head_samples_with_llama_cpp_sampler_chain(gemma_path):
    """A seeded draw at the llama.cpp head equals llama-cpp-python's own sampler chain (top-k, top-p, min-p,
    temperature, dist) given the same logits and the position's dist seed."""
    import llama_cpp

    from ggufswarm.runtime.llamacpp.sampling import LlamaCppSampler, draw_seed

    llm = llama_cpp.Llama(str(gemma_path), n_ctx=256, n_threads=1, flash_attn=True, verbose=False)
    try:
        ids = llm.tokenize(b"Once upon a time")
        llm.eval(ids)
        logits = torch.from_numpy(
            np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()
        )
        drawn = set()
        for seed in range(8):
            ours = LlamaCppSampler(SamplingParams(temperature=1.3, top_k=50, top_p=0.9, min_p=0.02, seed=seed))
            llm.set_seed(draw_seed(seed, len(ids)))
            theirs = llm.sample(top_k=50, top_p=0.9, min_p=0.02, temp=1.3)
            got = ours.sample(logits, ids)
            assert got == theirs, seed
            drawn.add(got)
        assert len(drawn) > 1  # the seeds really draw different tokens
    finally:
        llm.close()
    model = LocalModel.load(gemma_path, max_length=64, threads=1)
    assert isinstance(model.session(32).sampler, LlamaCppSampler)


def test_sampler_penalties_follow_llama_cpp():
    """With a repeat penalty, greedy and sampled draws go through llama.cpp's penalties sampler: positive
    logits of recent tokens are divided, negative ones multiplied (the CTRL rule llama.cpp uses)."""
    from ggufswarm.runtime.llamacpp.sampling import LlamaCppSampler

    logits = torch.zeros(100)
    logits[7], logits[9] = 5.0, 4.0
    greedy = LlamaCppSampler(SamplingParams(temperature=0, repeat_penalty=2.0, repeat_last_n=4))
    assert greedy.sample(logits, [1, 2, 3]) == 7
    assert greedy.sample(logits, [1, 2, 7]) == 9  # 5 / 2 < 4
    assert greedy.sample(logits, [7, 1, 2, 3, 4]) == 7  # 7 is outside the last 4
    hot = LlamaCppSampler(SamplingParams(temperature=0.5, top_k=2, repeat_penalty=100.0, seed=3))
    assert {hot.sample(logits, [7] * n) for n in range(1, 20)} == {9}


@pytest.mark.parametrize(
    "settings",
    [
        {"logit_bias": ((3, 100.0), (11, -100.0), (40, 2.5))},
        {"presence_penalty": 1.5, "frequency_penalty": 0.5, "penalize_from": 6},
        {
            "presence_penalty": -2.0,
            "frequency_penalty": 2.0,
            "penalize_from": 0,
            "repeat_penalty": 1.3,
            "repeat_last_n": 5,
            "logit_bias": {"4": -3.0},
        },
    ],
    ids=["logit_bias", "presence_frequency", "all"],
)
def test_torch_bias_and_penalties_equal_llama_cpp_samplers(settings):
    """The torch head's logit bias and penalties (Sampler.adjust) give llama.cpp's own logit-bias and penalties
    samplers' logits (LlamaCppSampler.adjust), to float32 rounding, and both heads then draw the same greedy
    token; presence/frequency penalties count only the tokens from ``penalize_from`` on."""
    from ggufswarm.runtime.llamacpp.sampling import LlamaCppSampler
    from ggufswarm.runtime.torch_sampling import Sampler

    gen = torch.Generator().manual_seed(5)
    history = torch.randint(0, 60, (14,), generator=gen).tolist() + [4, 4, 4, 11]
    params = SamplingParams(temperature=0, **settings)
    for _ in range(5):
        logits = torch.randn(64, generator=gen) * 3
        ours = Sampler(params).adjust(logits, history)
        ref = torch.from_numpy(LlamaCppSampler(params).adjust(logits, history))
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
        assert not torch.equal(ref, logits)  # the settings did change the logits
        assert (
            Sampler(params).sample(logits, history)
            == LlamaCppSampler(params).sample(logits, history)
            == int(ref.argmax())
        )
    if "penalize_from" in settings and not settings.get("repeat_penalty"):  # tokens before it are not penalized
        before = set(history[: settings["penalize_from"]]) - set(history[settings["penalize_from"] :])
        adjusted = LlamaCppSampler(params).adjust(logits, history)
        assert before and all(adjusted[t] == logits[t] for t in before)
    with pytest.raises(ValueError, match="logit_bias"):
        LlamaCppSampler(SamplingParams(temperature=0, logit_bias=((64, 1.0),))).sample(torch.zeros(64), [])


def test_grammar_draws_follow_the_schema_and_rebuild_from_the_history(gemma):
    """llama.cpp's grammar sampler at a llama.cpp head: sampled draws (random logits, so the grammar does all the
    work) give JSON that validates; a fresh sampler handed the same history (a replacement head after a route
    repair) or a shorter one (a rollback) draws the same tokens; a history token the grammar forbids is a
    ValueError, never an abort; the torch head refuses grammars."""
    import json

    import jsonschema

    from ggufswarm.client.grammar import response_format_grammar
    from ggufswarm.runtime.llamacpp.sampling import LlamaCppSampler
    from ggufswarm.runtime.torch_sampling import Sampler

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    head, n_vocab, prompt = gemma.shards[-1], gemma.tokenizer.n_vocab, [2, 100, 200]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=9, penalize_from=3, grammar=grammar)
    first = LlamaCppSampler(params)
    first.bind(head)
    gen = torch.Generator().manual_seed(0)
    history, seen = list(prompt), []
    while len(seen) < 60:
        seen.append(torch.randn(n_vocab, generator=gen) * 4)
        token = first.sample(seen[-1], history)
        if token in gemma.tokenizer.eog_ids:
            break
        history.append(token)
    assert token in gemma.tokenizer.eog_ids
    jsonschema.validate(json.loads(gemma.tokenizer.decode(history[3:])), schema)
    fresh = LlamaCppSampler(params)
    fresh.bind(head)
    for k in (len(seen) - 1, 4, 1, 0, len(seen) - 2):  # forward, then rolled back, then forward again
        assert fresh.sample(seen[k], history[: 3 + k]) == (history[3 + k] if 3 + k < len(history) else token)
    bad = gemma.tokenizer.encode("x", add_bos=False)[0]
    with pytest.raises(ValueError, match="grammar"):
        fresh.sample(seen[0], prompt + [bad])
    assert fresh.sample(seen[1], history[:4]) == history[4]  # and it recovers
    with pytest.raises(ValueError, match="llama.cpp head"):
        Sampler(params)
    for broken in ("root ::= (", 'root ::= root "a"', 'item ::= "a"', "root ::= undefined"):  # parse errors, no abort
        with pytest.raises(ValueError, match="could not parse"):
            LlamaCppSampler(SamplingParams(temperature=0, grammar=broken)).bind(head)


OPTIONS = [
    ("llama", {"n_layers": 6, "rope_linear_factor": 4.0}),
    ("llama", {"n_layers": 6, "rope_freqs": True}),
    ("gemma3", {"n_layers": 6, "sliding_window": 16, "rope_linear_factor": 8.0}),
    ("gemma3", {"n_layers": 6, "sliding_window": 16, "final_logit_softcap": 10.0}),
]


@pytest.mark.parametrize("arch,options", OPTIONS, ids=[f"{a}-{list(o)[-1]}" for a, o in OPTIONS])
def test_rope_scaling_freqs_and_softcap_survive_the_shard_files(arch, options, tiny_dir, tmp_path):
    """Linear RoPE scaling, ``rope_freqs.weight`` and the final logit soft-cap reach the derived shard GGUFs: a
    3-shard chain is bitwise llama.cpp's whole model (a shard losing the key or the tensor would compute
    something else: test_architectures shows each changes the logits)."""
    path = write_tiny_model(tiny_dir / f"bitwise-{arch}-{list(options)[-1]}.gguf", arch, **options)
    rng = np.random.default_rng(3)
    assert_chain_equals_llama_cpp(path, [2, 4], [1] + rng.integers(3, 384, 40).tolist(), tmp_path, n_ctx=256)
