"""A llama.cpp node never loads PyTorch: its memory is its shard, its KV cache and llama.cpp, not torch's ~180 MiB.

PyTorch is the torch backend's (and the tests' reference's) dependency; importing it costs a node about 180 MiB of
RSS (measured here: 62 -> 242 MiB for the interpreter with numpy, llama-cpp-python, aiohttp and gguf loaded) and
seconds of start-up. The check is on the node process itself: whether any PyTorch library is mapped into it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tinymodels import write_tiny_model

from ggufswarm.cache.snapshot import STATE_DTYPE, Shard, decode_snapshot, encode_snapshot
from ggufswarm.client.route import RemoteRoute
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.spec import ShardSpec


def torch_libraries(pid: int) -> set[str]:
    """PyTorch shared libraries mapped into process ``pid`` (empty when it never imported torch)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in maps if "libtorch" in line or "/torch/" in line}


def test_llama_cpp_nodes_run_without_torch(tiny_dir):
    """Two llama.cpp nodes run prefill and decode steps with sampling, logprobs and f16 / bf16 frames, and neither
    process has PyTorch mapped; a torch node (the control) does."""
    path = write_tiny_model(tiny_dir / "torch-free-llama.gguf", "llama", n_layers=2)
    nodes = start_nodes([ShardSpec(0, 1, embed=True), ShardSpec(1, 2, head=True)], str(path), threads=1)
    try:
        route = RemoteRoute([n.url for n in nodes], 30.0)
        for wire, sampling in (
            ("bf16", SamplingParams(temperature=0)),
            ("f16", SamplingParams(temperature=0.8, seed=3)),
        ):
            session = route.open(64, sampling, wire_dtype=wire, top_logprobs=3, logprobs=True)
            token = session.step(list(range(1, 20)))
            for _ in range(4):
                token = session.step([token])
            assert len(session.last_logprobs) == 3 and session.last_token_logprob <= 0.0
            session.close()
        for node in nodes:
            assert torch_libraries(node.proc.pid) == set(), f"node {node.url} loaded PyTorch"
    finally:
        stop_nodes(nodes)
    control = start_nodes([ShardSpec(0, 2, embed=True, head=True)], str(path), extra=["--backend", "torch"])
    try:
        assert torch_libraries(control[0].proc.pid), "the check cannot see PyTorch in a torch node"
    finally:
        stop_nodes(control)


def test_llama_cpp_state_snapshot_roundtrip_without_torch():
    """A llama.cpp snapshot (sequence state bytes, tokens, step boundaries) encodes and decodes through safetensors'
    numpy side: the same content, tokens as int64."""
    shard = Shard("ab" * 32, 0, 6, STATE_DTYPE)
    state = bytes(range(256)) * 3
    snap = decode_snapshot(encode_snapshot(shard, [5, 6, 7, 8], [], [], state=state, boundaries=[3, 4], node="n1"))
    assert (snap.shard, snap.state, snap.boundaries, snap.node) == (shard, state, [3, 4], "n1")
    assert snap.tokens.dtype == np.int64 and snap.tokens.tolist() == [5, 6, 7, 8]
