"""GPU nodes on a machine without a GPU: llama.cpp's Vulkan backend on Mesa's lavapipe (a software Vulkan device).

The wheel holds the Vulkan backend beside the CPU one when `make setup` found the Vulkan toolchain (`make test`
installs it: Debian's mesa-vulkan-drivers, libvulkan-dev, glslc, spirv-headers). ggml-vulkan lists lavapipe only
when ``GGML_VK_VISIBLE_DEVICES`` names it, so every GPU run is a process started with it (a node, or
tests/gpu_reference.py for llama.cpp's own run); this process never sees a GPU. A tiny random-weight model keeps
lavapipe's first-use shader compilation short.

Without a Vulkan-capable wheel the tests skip, unless GGUFSWARM_REQUIRE_GPU_TESTS=1 (`make test` sets it where it
built one), where that is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from route_fixtures import http
from tinymodels import write_tiny_model

from ggufswarm.net.http import ServerThread
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.shard import ShardSpec

N_LAYERS = 6
CUTS = [2, 4]
LAVAPIPE = {"GGML_VK_VISIBLE_DEVICES": "0"}  # the only Vulkan device on these machines
PROMPT = "the a of and to in is it"
GEMMA_PROMPT = "The capital of France is"
N_DECODE = 8
REPORT_ROUNDING = -(-(1 << 20) // 200)  # llama.cpp prints buffer sizes in MiB with 2 decimals: ±0.005 MiB
HERE = Path(__file__).parent


def _vulkan_wheel() -> str | None:
    """Why the GPU path cannot run here, or None: the loaded llama.cpp must have the Vulkan backend and lavapipe
    must be a Vulkan device (asked in a child process: this one must not see it)."""
    probe = (
        "from ggufswarm.runtime.llamacpp import devices as d; "
        "print([x.name for x in d.gpus() if x.backend == 'Vulkan'])"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=os.environ | LAVAPIPE)
    if out.returncode != 0:
        return f"the Vulkan probe failed: {out.stderr[-500:]}"
    if "Vulkan0" not in out.stdout:
        return "the installed llama.cpp has no Vulkan backend, or no Vulkan device is installed (make test builds it)"
    return None


@pytest.fixture(scope="module")
def vulkan():
    why = _vulkan_wheel()
    if why is not None:
        if os.environ.get("GGUFSWARM_REQUIRE_GPU_TESTS") == "1":
            pytest.fail(f"GGUFSWARM_REQUIRE_GPU_TESTS=1 but {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gpu")
    return write_tiny_model(d / "llama-q.gguf", "llama", quant=True, n_layers=N_LAYERS, seed=7)


def gpu_reference(
    model: Path, out: Path, gpu_blocks: int, ids: list[int], n_layers: int = N_LAYERS, env=None, **extra
) -> tuple[dict, dict]:
    """Run tests/gpu_reference.py in a child process that sees lavapipe (and ``env``); its arrays and JSON."""
    cmd = [
        sys.executable,
        str(HERE / "gpu_reference.py"),
        str(model),
        str(out),
        "--ids",
        ",".join(map(str, ids)),
        "--n-decode",
        str(N_DECODE),
        "--gpu-blocks",
        str(gpu_blocks),
        "--n-layers",
        str(n_layers),
    ]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | LAVAPIPE | (env or {}), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    arrays = np.load(out)
    return {k: arrays[k] for k in arrays.files}, json.loads(out.with_suffix(".json").read_text())


def run_probe(code: str, *args) -> dict:
    """Run the Python ``code`` with ``args`` in a child process that sees lavapipe; the JSON of its last line."""
    cmd = [sys.executable, "-c", code, *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | LAVAPIPE, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def prompt_ids(model: Path) -> list[int]:
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.client.tokenizer import Tokenizer

    return Tokenizer(str(model), GGUFModelFile(model).metadata).encode(PROMPT)


@pytest.mark.parametrize("on_gpu", ["head", "all"])
def test_a_head_shard_on_lavapipe_is_llama_cpp_with_the_same_blocks_there(vulkan, tiny, tmp_path, on_gpu):
    """A 3-shard chain whose last shard (2 blocks, the output head) runs on the Vulkan device gives, bitwise, the
    prefill logits and greedy decode logits of llama.cpp's whole model with its last 2 blocks and head there (its
    CPU blocks kept as a CPU-only run keeps them: gpu_reference.py); two runs give the same bits; the placement
    says where each block went, and llama.cpp's buffers there are what the accounting the fit uses predicts.
    ``all``: every shard on the device (hidden states in from the host, the graph tap out of a device tensor),
    bitwise the whole model there with ggml-vulkan's op fusion off (GGML_VK_DISABLE_FUSION=1) in both; with it on,
    the whole model fuses ops across the cut that the shards run apart (an add with the next block's norm): a
    decode logit then differs by an ulp or two (measured <= 7.2e-7), the same greedy tokens."""
    from ggufswarm.artifact.accounting import shard_account
    from ggufswarm.artifact.gguf_file import GGUFModelFile

    ids = prompt_ids(tiny)
    gpu_blocks = N_LAYERS if on_gpu == "all" else N_LAYERS - CUTS[-1]
    cuts = ",".join(map(str, CUTS))
    if on_gpu == "all":
        fused, _ = gpu_reference(tiny, tmp_path / "fused.npz", gpu_blocks, ids, cuts=cuts, chain_gpu=on_gpu)
        assert np.array_equal(fused["chain_prefill"], fused["prefill"])
        assert np.abs(fused["chain_decode"] - fused["decode"]).max() < 1e-5
        assert np.array_equal(np.argmax(fused["chain_decode"], axis=1), np.argmax(fused["decode"], axis=1))
    unfused = {"GGML_VK_DISABLE_FUSION": "1"} if on_gpu == "all" else {}
    got, meta = gpu_reference(tiny, tmp_path / "ref.npz", gpu_blocks, ids, env=unfused, cuts=cuts, chain_gpu=on_gpu)
    assert got["prefill"].shape == got["chain_prefill"].shape
    assert np.array_equal(got["chain_prefill"], got["prefill"]), np.abs(got["chain_prefill"] - got["prefill"]).max()
    assert np.array_equal(got["chain_decode"], got["decode"]), np.abs(got["chain_decode"] - got["decode"]).max()
    assert np.array_equal(got["chain2_prefill"], got["chain_prefill"]) and np.array_equal(
        got["chain2_decode"], got["chain_decode"]
    )
    first, middle, head = meta["placement"]
    if on_gpu == "all":
        assert first["gpu_blocks"] == [0, 1] and middle["gpu_blocks"] == [2, 3] and not first["output_on_gpu"]
    else:
        assert first["device"] == middle["device"] == "CPU" and not first["gpu_blocks"]
        assert "Vulkan0" not in first["buffers"]
    assert head["device"] == "Vulkan0" and head["gpu_blocks"] == [4, 5] and head["output_on_gpu"]
    assert "llvmpipe" in head["description"]
    on_device = head["buffers"]["Vulkan0"]
    assert head["device_bytes"] == sum(on_device.values()) and on_device["compute"] > 0
    # llama.cpp's own report (MiB with 2 decimals) against the header accounting gpu_fit counts with
    # the KV cache on the device holds what the session needs (kv_size): one stream of 256 cells before it opens,
    # of its 512 once it has
    acct = shard_account(GGUFModelFile(tiny), 4, 6, head=True)
    assert abs(head["idle_buffers"]["Vulkan0"]["KV"] - acct.kv_bytes_per_token * 256) <= REPORT_ROUNDING
    assert abs(on_device["KV"] - acct.kv_bytes_per_token * 512) <= REPORT_ROUNDING
    assert 0.95 * acct.weight_bytes <= on_device["model"] <= acct.weight_bytes + REPORT_ROUNDING


def test_gpu_fit_counts_blocks_from_the_end_within_free_memory(tiny):
    """gpu_fit: all blocks with room to spare, none below its margin, and in between as many of the range's last
    blocks as their weights and KV leave room for (the head's output first); plan with a GPU prints the same."""
    from ggufswarm.artifact.accounting import HeaderAccounts
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.artifact.planning import FIT_MARGIN_BYTES, place, plan_text
    from ggufswarm.runtime.llamacpp.devices import gpu_fit

    file, spec = GGUFModelFile(tiny), ShardSpec(2, 6, head=True)
    acc = HeaderAccounts.from_model(file)
    fixed = FIT_MARGIN_BYTES + acc.head_bytes + 512 * acc.n_embd * 4
    cost = [b.weight_bytes + 2 * 512 * b.kv_bytes_per_token for b in acc.layers]
    assert gpu_fit(file, spec, 1 << 40, 512, 2, 512) == 4
    assert gpu_fit(file, spec, FIT_MARGIN_BYTES, 512, 2, 512) == 0
    assert gpu_fit(file, spec, fixed + cost[5] + cost[4], 512, 2, 512) == 2
    assert gpu_fit(file, spec, fixed + cost[5] + cost[4] - 1, 512, 2, 512) == 1
    plan = place(acc, 1 << 30, 512, sessions=2, gpu_memory=fixed + cost[5] + cost[4])
    assert [n.gpu_blocks for n in plan.nodes] == [(4, 5)]
    assert "4:6 +head (2 of 6)" in plan_text(acc, plan, "tiny")


FIT_PROBE = """
import json, sys
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.runtime.llamacpp import devices
from ggufswarm.runtime.llamacpp.backend import LlamaCppShard
from ggufswarm.runtime.shard import ShardSpec
free = devices.gpus()[0].free_bytes
shard = LlamaCppShard(GGUFModelFile(sys.argv[1]), ShardSpec(0, 6, embed=True, head=True), n_ctx_seq=131072,
                      n_seq_max=4, threads=1, cache_dir=sys.argv[2], gpu="auto")
tokens, free_now = shard.device_kv_tokens(), devices.gpus()[0].free_bytes
from ggufswarm.node.state import NodeConfig, NodeState  # a node of this shard: the KV budget it offers
node = NodeState(NodeConfig(layers="0:6", embed=True, head=True, model=sys.argv[1], gpu="auto", data_dir=sys.argv[2]),
                 shard)
out = {"free": free, "placement": shard.placement.to_json(), "device_kv_tokens": tokens, "free_now": free_now,
       "budget": node.store.budget_tokens}
print(json.dumps(out))
"""


def test_a_node_holds_on_its_gpu_the_blocks_plan_gives_it(vulkan, tmp_path):
    """With room for the KV of 4 sessions (of 8192 tokens each, the most a GPU node leaves a session:
    ``planning.GPU_SESSION_CELLS``; wide KV heads, 16 KiB a token a block) a GPU of lavapipe's 2 GiB holds only some
    of a range's blocks: the node puts there exactly the blocks ``plan --node-memory ...,gpu=FREE`` lists for
    sessions of 128K tokens, the rest on the CPU, and llama.cpp's KV buffer on the device holds those blocks' cells
    (as many as its sessions use: none yet)."""
    from ggufswarm.artifact.accounting import HeaderAccounts
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.artifact.planning import FIT_MARGIN_BYTES, place

    model = write_tiny_model(
        tmp_path / "long.gguf",
        "llama",
        quant=True,
        n_layers=N_LAYERS,
        context_length=131072,
        n_head=64,
        n_head_kv=64,
        head_dim=64,
    )
    got = run_probe(FIT_PROBE, model, tmp_path / "shards")
    acc = HeaderAccounts.from_model(GGUFModelFile(model))
    plan = place(acc, 1 << 40, 131072, sessions=4, gpu_memory=got["free"])
    (node,) = plan.nodes
    placement = got["placement"]
    assert 0 < len(node.gpu_blocks) < N_LAYERS, node.gpu_blocks  # a partial fit, or the test proves nothing
    assert placement["gpu_blocks"] == list(node.gpu_blocks)
    assert placement["cpu_blocks"] == list(range(N_LAYERS - len(node.gpu_blocks)))
    # room was left for that KV; what is allocated is what the sessions use (kv_size): none open, one stream of 256
    per_token = sum(acc.layers[b].kv_bytes_per_token for b in node.gpu_blocks)
    held = placement["buffers"]["Vulkan0"]["KV"]
    assert abs(held - 256 * per_token) <= REPORT_ROUNDING
    # the KV tokens it offers are what the device's free memory holds (less the margin), not 4 x 128K (the sessions'
    # cells, below --kv-budget's 262144)
    assert got["device_kv_tokens"] == (got["free_now"] - FIT_MARGIN_BYTES + held) // per_token < 4 * 131072
    assert got["budget"] == got["device_kv_tokens"]  # what the node offers (/health, its advertisement)


GROWTH_PROBE = """
import json, sys
import numpy as np
from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.runtime.llamacpp.backend import LlamaCppShard
from ggufswarm.runtime.llamacpp.errors import KVCellsFull, LlamaCppError
from ggufswarm.runtime.shard import ShardSpec

file, ids = GGUFModelFile(sys.argv[1]), np.array(json.loads(sys.argv[3]))
def shard():
    return LlamaCppShard(file, ShardSpec(0, 6, embed=True, head=True), n_ctx_seq=2048, n_seq_max=4, threads=1,
                         cache_dir=sys.argv[2], gpu="auto")
def run(s, a, between):  # session a: a prefill, then 6 greedy decode steps; between(i) runs before decode i
    out = [s.forward(a, ids)[0]]
    for i in range(6):
        between(i)
        out.append(s.forward(a, np.array([int(np.argmax(out[-1]))]))[0])
    return np.array(out)
reports = []
def kv(s):  # KV cells the context holds; -1 where llama.cpp's buffer (MiB, 2 decimals) is not theirs
    reported = s.placement.buffers["Vulkan0"]["KV"]
    reports.append(reported)
    return s.kv_shape.tokens if abs(reported - s.kv_shape.tokens * s.kv_bytes_per_token()) <= 5243 else -1
ref = shard()  # the reference: a context as large as it gets below, from before session a's first step
a, b = ref.new_session(300), ref.new_session(2048)
want = run(ref, a, lambda i: None)
ref.close()
s = shard()
cells = {"idle": kv(s)}
a = s.new_session(300)
cells["a"] = kv(s)
held = {}
def between(i):
    if i == 2:
        held["b"] = s.new_session(2048)  # grows: both sessions' cells copied into a larger context
        cells["a+b"] = kv(s)
        s.forward(held["b"], ids[:5])
    if i == 4:
        held.pop("b").close()
        cells["fit"] = s.fit_kv()
        cells["a again"] = kv(s)
got = run(s, a, between)
make = LlamaCppShard.make_context
def device_holding(most):  # a device that cannot hold more than ``most`` cells a stream
    def make_at_most(self, shape):
        if shape.cells > most:
            raise LlamaCppError("out of device memory (test)")
        make(self, shape)
    return make_at_most
LlamaCppShard.make_context = device_holding(512)
try:
    s.new_session(2048)
    refused = None
except KVCellsFull as e:
    refused = [e.code, str(e)]
after = s.forward(a, np.array([int(np.argmax(got[-1]))]))[0]
# the device lost even the shape it had: the shard keeps a context, a is emptied
LlamaCppShard.make_context = device_holding(256)
try:
    s.new_session(2048)
except KVCellsFull:
    pass
emptied = [a.length, bool(np.array_equal(s.forward(a, ids)[0], want[0]))]
s.close()
LlamaCppShard.make_context = make
ref = shard()
a = ref.new_session(300)
again = run(ref, a, lambda i: None)
want_after = ref.forward(a, np.array([int(np.argmax(again[-1]))]))[0]
from ggufswarm.runtime.llamacpp.kv_size import streams_grow
print(json.dumps({"cells": cells, "reported": reports, "streams_grow": streams_grow(),
                  "same": bool(np.array_equal(got, want)), "refused": refused,
                  "same_after_refusal": bool(np.array_equal(after, want_after)),
                  "same_alone": bool(np.array_equal(again, want)), "emptied": emptied}))
"""


def test_a_gpu_kv_cache_grows_and_shrinks_with_its_sessions_bitwise(vulkan, tiny, tmp_path):
    """A GPU shard's KV cache (lavapipe) is allocated as sessions open (runtime/llamacpp/kv_size.py): one stream of
    256 cells idle, 512 for a 300-token session, 2 streams of 2048 when a 2048-token session joins mid-decode, and
    back to 512 once it closed; the first session's logits through both copies are bitwise those of a context that
    large from the start (and of one never resized). A session the device cannot hold is refused at open with
    ``kv_budget_full``, and the session it holds decodes on, bitwise; where the old shape cannot be made again either,
    the shard keeps a context and the session is emptied, never left at a length whose cells it lost."""
    ids = prompt_ids(tiny)
    got = run_probe(GROWTH_PROBE, tiny, tmp_path / "shards", json.dumps(ids))
    # without patch 0016 (a libllama whose sequence states load only into as many streams): 4 streams throughout
    one, two = (1, 2) if got["streams_grow"] else (4, 4)
    assert got["cells"] == {"idle": one * 256, "a": one * 512, "a+b": two * 2048, "fit": True, "a again": one * 512}
    assert got["same"] and got["same_alone"]
    code, why = got["refused"]
    assert code == "kv_budget_full" and "cannot hold" in why, got["refused"]
    assert got["same_after_refusal"]
    # a device that then cannot even hold the shape it had: the shard keeps a smaller context, the session is emptied
    # (length 0: its client's next step is a position mismatch, repaired) and a new prefill in it is the first one
    assert got["emptied"] == [0, True]


def test_layers_auto_takes_what_the_gpu_holds(vulkan):
    """``--layers auto`` without ``--memory-budget``: on a node with a GPU, 3/4 of the GPU's free memory less the
    fit's margin (said in one line); without one (this process sees none), 8192 MiB; ``--memory-budget`` wins."""
    from ggufswarm.artifact.planning import FIT_MARGIN_BYTES
    from ggufswarm.node.placement import layers_budget
    from ggufswarm.node.state import NodeConfig

    probe = (
        "from ggufswarm.node.placement import layers_budget; from ggufswarm.node.state import NodeConfig; "
        "from ggufswarm.runtime.llamacpp.devices import gpus; "
        "print(gpus()[0].free_bytes, layers_budget(NodeConfig(layers='auto', gpu='auto')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=os.environ | LAVAPIPE)
    assert done.returncode == 0, done.stderr[-2000:]
    free, budget = map(int, done.stdout.split())
    assert budget == int((free - FIT_MARGIN_BYTES) * 0.75)
    assert "--layers auto: Vulkan0" in done.stderr and "MiB of layers" in done.stderr
    assert layers_budget(NodeConfig(layers="auto", gpu="auto")) == 8192 << 20
    assert layers_budget(NodeConfig(layers="auto", gpu="auto", memory_budget_mb=100)) == 100 << 20


def complete(base: str, prompt: str, max_tokens: int) -> str:
    req = urllib.request.Request(
        f"{base}/v1/completions",
        method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode(),
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["text"]


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
        return json.loads(r.read())


def wait_for_kv(url: str, done, timeout: float = 30.0) -> int:
    """The node's KV buffer on Vulkan0 (bytes, its /health placement) once ``done(bytes)`` holds, or when ``timeout``
    seconds have passed (the caller's assertion then says what it was): a node fits its KV cache to its sessions
    right after one closes."""
    deadline = time.monotonic() + timeout
    while True:
        kv = health(url)["placement"]["buffers"]["Vulkan0"].get("KV", 0)
        if done(kv) or time.monotonic() > deadline:
            return kv
        time.sleep(0.1)


@pytest.mark.slow
def test_a_route_with_its_head_on_lavapipe_streams_llama_cpp_s_text(vulkan, gemma_path, tmp_path):
    """Gemma 3 270M on three node processes through the gateway, the last (blocks 12:18 +head) on the Vulkan
    device: the greedy text is llama.cpp's own with those blocks on that device; its /health says so; the same
    route with that node on the CPU (--gpu none) gives llama.cpp's CPU text."""
    from ggufswarm.gateway import GatewayConfig, make_app

    _, gpu_meta = gpu_reference(gemma_path, tmp_path / "gpu.npz", 6, [2], n_layers=18, prompt=GEMMA_PROMPT)
    _, cpu_meta = gpu_reference(gemma_path, tmp_path / "cpu.npz", 0, [2], n_layers=18, prompt=GEMMA_PROMPT)
    specs = [ShardSpec(0, 6, embed=True), ShardSpec(6, 12), ShardSpec(12, 18, head=True)]
    for gpu, want in (("Vulkan0", gpu_meta["text"]), ("none", cpu_meta["text"])):
        nodes = start_nodes(
            specs,
            str(gemma_path),
            threads=1,
            extra=["--ctx-size", "512", "--max-sessions", "2", "--data-dir", str(tmp_path / "data")],
            per_node=lambda i, gpu=gpu: ["--gpu", gpu if i == 2 else "none"],
            per_node_env=lambda i: LAVAPIPE if i == 2 else {},
            timeout=600,
        )
        server = ServerThread(make_app(GatewayConfig([n.url for n in nodes], model=str(gemma_path))))
        try:
            base = server.start()
            assert complete(base, GEMMA_PROMPT, N_DECODE) == want, gpu
            placement = health(nodes[2].url)["placement"]
            if gpu == "none":
                assert placement["device"] == "CPU" and placement["cpu_blocks"] == list(range(12, 18))
            else:
                assert placement["device"] == "Vulkan0" and placement["gpu_blocks"] == list(range(12, 18))
                assert placement["buffers"]["Vulkan0"]["model"] > 0
                # Gemma's tied 170 MiB LM head is more than one lavapipe storage buffer (128 MiB): llama.cpp keeps it
                # on the CPU, and the placement says so
                assert not placement["output_on_gpu"] and placement["buffers"]["CPU_Mapped"]["model"] > 150 << 20
            assert health(nodes[0].url)["placement"]["device"] == "CPU"
            if gpu != "none":  # a session past --max-sessions is refused, not run
                deadline = time.monotonic() + 60  # the gateway closes the answer's session after the last chunk
                while health(nodes[2].url)["sessions"] and time.monotonic() < deadline:
                    time.sleep(0.1)
                # its KV cache on the device is sized to the open sessions (kv_size): one stream of 256 cells idle,
                # two with two sessions of 64 tokens, one again once they closed (shrunk when the last one went)
                idle_kv = wait_for_kv(nodes[2].url, lambda kv: kv > 0)
                opened = [http("POST", f"{nodes[2].url}/v1/sessions", {"max_length": 64}) for _ in range(3)]
                assert [status for status, _ in opened] == [201, 201, 429], opened
                assert opened[2][1]["error"]["code"] == "kv_budget_full", opened[2]
                assert abs(wait_for_kv(nodes[2].url, lambda kv: kv > idle_kv) - 2 * idle_kv) <= 2 * REPORT_ROUNDING
                for _, body in opened[:2]:
                    http("DELETE", f"{nodes[2].url}/v1/sessions/{body['session_id']}")
                assert wait_for_kv(nodes[2].url, lambda kv: kv <= idle_kv) == idle_kv
                assert complete(base, GEMMA_PROMPT, N_DECODE) == want
        finally:
            server.stop()
            stop_nodes(nodes)
    assert gpu_meta["text"] and cpu_meta["text"]


@pytest.mark.slow
def test_a_session_repaired_onto_a_gpu_head_continues(vulkan, gemma_path, tmp_path):
    """A CPU route through a tracker loses its head mid-answer; the gateway repairs the session onto a spare head
    on the Vulkan device (it fetched its layers from the swarm like any node), and the answer goes on: the text
    streamed before the kill stays, the rest comes from the GPU head, which the final telemetry names. From the
    repair on, the tokens are the GPU's (docs/gpu.md: its logits differ from the CPU's), as after a repair onto a
    node of another CPU kind."""
    import threading

    from apphost import AppThread
    from test_faults import stream

    from ggufswarm.directory.trackers import TrackerClient
    from ggufswarm.gateway import GatewayConfig, make_app
    from ggufswarm.gateway.app import GATEWAY
    from ggufswarm.swarm.publish import publish
    from ggufswarm.swarm.torrent import Swarm, save_path_for
    from ggufswarm.tracker.app import TrackerConfig
    from ggufswarm.tracker.app import make_app as make_tracker_app

    specs = [ShardSpec(0, 6, embed=True), ShardSpec(6, 12), ShardSpec(12, 18, head=True), ShardSpec(12, 18, head=True)]
    with AppThread(lambda: make_tracker_app(TrackerConfig(db=":memory:", ttl_s=30))) as tracker:
        published = publish(gemma_path, tracker, "gemma", tmp_path / "publisher")
        seeder = Swarm()
        seeder.seed(published.torrent, save_path_for([gemma_path]))
        nodes, gateway = [], None
        try:
            nodes = start_nodes(
                specs,
                "gemma",
                threads=1,
                timeout=600,
                # lavapipe compiles a shader on its first use of it (seconds to a minute): a long hop timeout
                extra=["--tracker", tracker, "--hop-timeout", "300", "--ctx-size", "512", "--max-sessions", "2"],
                per_node=lambda i: ["--data-dir", str(tmp_path / f"node{i}"), "--gpu", "Vulkan0" if i == 3 else "none"],
                per_node_env=lambda i: LAVAPIPE if i == 3 else {},
            )
            cpu_head, gpu_head = nodes[2], nodes[3]
            deadline = time.monotonic() + 60
            while len(TrackerClient(tracker).nodes("gemma")) < len(nodes):
                assert time.monotonic() < deadline, "the nodes did not all advertise"
                time.sleep(0.2)
            gateway = ServerThread(
                make_app(GatewayConfig([], model="gemma", tracker=tracker, hop_timeout_s=300, data_dir=str(tmp_path)))
            )
            base = gateway.start()
            gateway.app[GATEWAY].suspect(gpu_head.url)  # the first plan takes the CPU head
            seen = []

            def kill_at(i):
                seen.append(i)
                if i == 6:
                    threading.Thread(target=cpu_head.kill).start()

            # (kill at token 6 of 40: the head may have sent up to GRANT_AHEAD steps ahead, ring decode)
            text, telemetry = stream(base, GEMMA_PROMPT, kill_at, max_tokens=40)
            assert telemetry["repairs"], telemetry
            assert telemetry["route"][-1]["node"] == gpu_head.url, telemetry["route"]
            assert health(gpu_head.url)["placement"]["device"] == "Vulkan0"
            assert len(seen) >= 7 and text.strip()
        finally:
            if gateway is not None:
                gateway.stop()
            stop_nodes(nodes)
            seeder.close()
