"""Architectures of llama.cpp's zoo across nodes (issue 42): a 3-node route over a zoo file's copy stretched to 8
blocks (tests/zoo.py ``stretch``), each node a process with its layer range, gives llama.cpp's own greedy tokens, and
so does ``generate --split`` cut at every block boundary.

The models: GLM-4.x MoE (leading dense block, patch 0003), Gemma 3 (sliding-window and full-attention blocks, cuts that
leave a range of one kind: patch 0011), Qwen3.5 MoE (a hybrid of Gated DeltaNet and attention blocks, 4 positions per
token), LFM2 and Jamba (hybrids with per-block head counts, their later ranges starting at a convolution or Mamba block:
patch 0014), two of patch 0013's: bloom (its input norm on the first node only) and talkie (every block adds the
token's normalized embedding: the frames carry the token ids to the nodes past the first), the hyper-connection models
of patch 0015, HY-V4, GLM-5-Next and Qwen4-Exp (4 residual streams of n_embd per token in every frame; Qwen4-Exp's
n-gram embeddings read the token ids the frames carry), and Kimi-K3 with attention residuals (patch 0019: each frame
carries the stream and the checkpoints banked before its cut, wider from hop to hop). The cuts are the thirds of the
model, moved to the nearest ones the cut rules accept. The reference is llama.cpp's whole model fed the same prompt
(``test_hybrid_repair.llama_cpp_steps``, one thread as the nodes run).
"""

from __future__ import annotations

import numpy as np
import pytest
import zoo
from test_hybrid_repair import GREEDY, llama_cpp_steps

from ggufswarm.artifact.cut_rules import Header, range_problem
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.local import LocalModel
from ggufswarm.client.route import RemoteRoute
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.llamacpp.derive import n_vocab
from ggufswarm.runtime.shard import ShardSpec

N_DECODE = 16
# cut at every block boundary by generate --split
EVERY_BOUNDARY = ["glm4moe-moe", "gemma3-dense", "qwen35moe-moe", "lfm2-dense", "jamba-dense", "bloom-dense"]
EVERY_BOUNDARY += ["talkie-dense", "kimi-k3-moe"]
# kimi-k3 with a checkpoint every 3 blocks (patch 0019): the frames of each hop are wider than the previous hop's
OVERRIDES = {"kimi-k3-moe": {"kimi-k3.attn_res.block_size": 3}}
# hyper-connections (patch 0015): 4 residual streams cross every cut; DSA blocks sharing the top-k of the block before
# (hy_v4) cannot start a range, and glm5-next's recurrent blocks make a range alone only with patch 0017: generate
# --split takes the finest chain the cut rules accept
HYPER_CONNECTIONS = ["hy_v4-moe", "glm5-next-moe", "qwen4exp-moe"]
ROUTED = EVERY_BOUNDARY + HYPER_CONNECTIONS


def finest_cuts(header: Header) -> list[int]:
    """The cut points of the chain of the most ranges the cut rules accept (every boundary where all are)."""
    n = header.n_layers
    best: dict[int, list[int] | None] = {n: []}
    for s in range(n - 1, -1, -1):
        tails = [
            [e, *best[e]] for e in range(s + 1, n + 1) if best[e] is not None and range_problem(header, s, e) is None
        ]
        best[s] = max(tails, key=len) if tails else None
    assert best[0], f"{header.arch}: no chain of accepted ranges"
    return best[0][:-1]


def three_ranges(header: Header) -> tuple[int, int]:
    """Cut points ``(a, b)`` of a 3-node route the cut rules accept, nearest to the thirds of the model; for a model
    with per-block head counts (jamba, lfm2), one whose later ranges start at blocks without heads (patch 0014)."""
    n = header.n_layers
    ok = [
        (a, b)
        for a in range(1, n - 1)
        for b in range(a + 1, n)
        if all(range_problem(header, s, e) is None for s, e in ((0, a), (a, b), (b, n)))
    ]
    assert ok, f"{header.arch}: no 3-node route of {n} blocks"
    heads = header.md.get(f"{header.arch}.attention.head_count")
    if isinstance(heads, list) and 0 in heads:
        ok = [(a, b) for a, b in ok if heads[a] == 0 and heads[b] == 0]
        assert ok, f"{header.arch}: no 3-node route starting its ranges at blocks without heads"
    return min(ok, key=lambda p: abs(p[0] - n / 3) + abs(p[1] - 2 * n / 3))


@pytest.mark.parametrize("name", ROUTED)
def test_three_node_route_gives_llama_cpp_tokens(name, zoo_dir, tmp_path):
    path = zoo.stretch(
        GGUFModelFile(zoo_dir / f"{name}.gguf"), tmp_path / f"stretched-{name}.gguf", overrides=OVERRIDES.get(name)
    )
    model = GGUFModelFile(path)
    header = Header(model.metadata)
    a, b = three_ranges(header)
    specs = [ShardSpec(0, a, embed=True), ShardSpec(a, b), ShardSpec(b, header.n_layers, head=True)]
    prompt = np.random.default_rng(zoo.SEED).integers(0, n_vocab(model), 20).tolist()
    want = llama_cpp_steps(path, [prompt], N_DECODE)
    nodes = start_nodes(
        specs,
        str(path),
        threads=1,
        timeout=300,
        extra=["--ctx-size", "256", "--max-sessions", "1", "--hop-timeout", "30"],
        per_node=lambda i: ["--data-dir", str(tmp_path / f"node{i}")],
    )
    try:
        session = RemoteRoute([n.url for n in nodes], 30.0).open(128, GREEDY)
        tokens = [session.step(prompt)]
        while len(tokens) < N_DECODE:
            tokens.append(session.step([tokens[-1]]))
        session.close()
        assert tokens == want, (name, (a, b))
    finally:
        stop_nodes(nodes)


@pytest.mark.parametrize("name", ROUTED)
def test_generate_split_at_every_boundary_gives_llama_cpp_tokens(name, zoo_dir, tmp_path):
    """``generate --split 1,2,...,7`` (``LocalModel``: chained in-process shards of one block each; the finest chain
    the cut rules accept for the hyper-connection models) on the same copy gives llama.cpp's whole-model greedy
    tokens."""
    path = zoo.stretch(
        GGUFModelFile(zoo_dir / f"{name}.gguf"), tmp_path / f"stretched-{name}.gguf", overrides=OVERRIDES.get(name)
    )
    model = GGUFModelFile(path)
    header = Header(model.metadata)
    n, cuts = header.n_layers, finest_cuts(header)
    if name in EVERY_BOUNDARY:
        assert cuts == list(range(1, n)), (name, cuts)
    else:
        assert len(cuts) >= 3, (name, cuts)  # hy_v4: 0:2 2:4 4:6 6:8 (or finer), glm5-next likewise; qwen4exp: all
    prompt = np.random.default_rng(zoo.SEED).integers(0, n_vocab(model), 20).tolist()
    want = llama_cpp_steps(path, [prompt], N_DECODE)
    local = LocalModel.load(str(path), split=cuts, backend="llama.cpp", threads=1, max_length=256)
    bounds = [0, *cuts, n]
    assert [(s.spec.start, s.spec.end) for s in local.shards] == list(zip(bounds, bounds[1:]))
    session = local.session(128, GREEDY)
    tokens = [session.step(prompt)]
    while len(tokens) < N_DECODE:
        tokens.append(session.step([tokens[-1]]))
    assert tokens == want, name
