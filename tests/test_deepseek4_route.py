"""DeepSeek-V4 (``deepseek4``) across nodes: a 3-node route of the tiny model, its middle node SIGKILLed mid-stream.

The tiny model has the DeepSeek-V4-Flash layout in 6 blocks (``tests/tinymoe.py``): compress ratios 0/0/4/128/4/128
(raw sliding-window attention, then the compressed attention with its lightning indexer and the heavily compressed
one), hyper-connections of 4 residual streams, and 3 hash-routed blocks (experts picked by a token-id table). The
route is [0,2)+embed, [2,4), [4,6)+head: the first cut falls inside the hash-routed blocks, so the middle node routes
block 2 by the token ids the frames carry, and every hop carries the 4 residual streams (4 x n_embd per token). Its
compressed cache cannot be rolled back partway, so the repair goes through exact state checkpoints, as for the
hybrid recurrent models (test_hybrid_repair.py, whose helpers this reuses). Needs ggufswarm's llama.cpp patch queue
(``make setup`` builds it). The reference is llama.cpp's own whole model fed the same steps.
"""

from __future__ import annotations

import numpy as np
from apphost import AppThread
from route_fixtures import health
from test_hybrid_repair import GREEDY, N_DECODE, decode_killing, llama_cpp_steps
from tinymoe import write_tiny_deepseek4_model

from ggufswarm.artifact.accounting import shard_account
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.cache.app import CacheConfig
from ggufswarm.cache.app import make_app as make_cache_app
from ggufswarm.client.route import RemoteRoute
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.shard import ShardSpec

EVERY = 8  # --snapshot-every


def test_deepseek4_route_gives_llama_cpp_tokens_and_survives_a_sigkill(tmp_path):
    """Greedy tokens through the 3-node route equal llama.cpp's whole model; after the middle node is SIGKILLed
    (14 tokens into the answer) the spare restores the cache's snapshot, the survivors return to their state
    checkpoints, and the answer is still llama.cpp's, token for token. Each hop advertises and moves 4 x n_embd
    values per token."""
    model = write_tiny_deepseek4_model(
        tmp_path / "deepseek4.gguf", compress_ratios=[0, 0, 4, 128, 4, 128], hash_layers=3
    )
    specs = [ShardSpec(0, 2, embed=True), ShardSpec(2, 4), ShardSpec(4, 6, head=True), ShardSpec(2, 4)]
    with AppThread(lambda: make_cache_app(CacheConfig(dir=str(tmp_path / "cache"), max_bytes=2**28))) as cache:
        nodes = start_nodes(
            specs,
            str(model),
            threads=1,
            timeout=300,
            extra=[
                "--cache",
                cache,
                "--snapshot-every",
                str(EVERY),
                "--hop-timeout",
                "10",
                "--ctx-size",
                "256",
                "--max-sessions",
                "2",
            ],
            per_node=lambda i: ["--data-dir", str(tmp_path / f"node{i}")],
        )
        try:
            first, middle, head, spare = nodes
            n_embd = 128  # DEEPSEEK4_DEFAULTS
            assert health(first.url)["n_embd"] == health(middle.url)["n_embd"] == 4 * n_embd
            acc = shard_account(GGUFModelFile(model), 0, 2, True, False)  # what the node advertises (f32 frames)
            assert acc.boundary_bytes_per_token == 4 * 4 * n_embd
            rng = np.random.default_rng(21)
            prompt = [1] + rng.integers(3, 384, 19).tolist()
            want = llama_cpp_steps(model, [prompt], N_DECODE)
            session = RemoteRoute([first.url, middle.url, head.url], 10.0).open(
                128, GREEDY, replan=lambda exclude, span: RemoteRoute([spare.url], 10.0, part=True)
            )
            tokens = decode_killing(session, prompt, (first, middle, head), middle, (first, middle, head))
            repairs = session.telemetry.repairs
            session.close()
            assert tokens == want
            assert len(repairs) == 1 and repairs[0]["hop"] == middle.url, repairs
            assert repairs[0]["restored_tokens"] == 32, repairs
            for node in (first, spare, head):
                assert health(node.url)["status"] == "ok"
        finally:
            stop_nodes(nodes)


def test_deepseek4_chained_shards_in_one_process_give_the_whole_models_tokens(tmp_path):
    """``generate --split`` on DeepSeek-V4 (issue 42, item 3): chained in-process shards cut at every block
    boundary, one at a time and all at once, pass each step's token ids to the shards whose hash-routed blocks read
    them, and give the greedy tokens of llama.cpp's whole model (the original file, one shard)."""
    from ggufswarm.client.local import LocalModel
    from ggufswarm.runtime.sampling import SamplingParams

    model = write_tiny_deepseek4_model(
        tmp_path / "deepseek4.gguf", compress_ratios=[0, 0, 4, 128, 4, 128], hash_layers=3
    )
    prompt = [5 + (i * 7) % 200 for i in range(40)]

    def greedy(split):
        local = LocalModel.load(str(model), split=split, backend="llama.cpp", threads=1, max_length=256)
        session = local.session(200, SamplingParams(temperature=0))
        out = [session.step(prompt)]
        for _ in range(16):
            out.append(session.step([out[-1]]))
        return out

    whole = greedy(None)
    for split in ([1], [2], [3], [4], [5], [1, 2, 3, 4, 5]):
        assert greedy(split) == whole, split
