"""A llama.cpp node never loads PyTorch: its memory is its shard, its KV cache and llama.cpp, not torch's ~180 MiB.

PyTorch is the torch backend's (and the tests' reference's) dependency; importing it costs a node about 180 MiB of
RSS (measured here: 62 -> 242 MiB for the interpreter with numpy, llama-cpp-python, aiohttp and gguf loaded) and
seconds of start-up. The check is on the node process itself: whether any PyTorch library is mapped into it.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from tinymodels import write_tiny_model

from ggufswarm.cache.snapshot import STATE_DTYPE, Shard, decode_snapshot, encode_snapshot
from ggufswarm.client.route import RemoteRoute
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.node.memory import no_gpu_to_look_for
from ggufswarm.runtime.llamacpp import patches
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.spec import ShardSpec


def torch_libraries(pid: int) -> set[str]:
    """PyTorch shared libraries mapped into process ``pid`` (empty when it never imported torch)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in maps if "libtorch" in line or "/torch/" in line}


def chat_libraries(pid: int) -> set[str]:
    """Libraries of llama-cpp-python's high-level package mapped into process ``pid``: diskcache's sqlite3 and
    jinja2's markupsafe, which ``import llama_cpp`` loads and a node, calling llama.h only, does not
    (runtime/llamacpp/bindings.py)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in maps if "sqlite3" in line or "/markupsafe/" in line}


def test_llama_cpp_nodes_run_without_torch(tiny_dir):
    """Two llama.cpp nodes run prefill and decode steps with sampling, logprobs and f16 / bf16 frames, and neither
    process has PyTorch mapped, nor llama-cpp-python's high-level package (its chat templates and disk cache); a
    torch node (the control) has PyTorch, and this process, which imported ``llama_cpp``, the package's libraries."""
    import llama_cpp  # noqa: F401  (the control of chat_libraries)

    assert chat_libraries(os.getpid()), "the check cannot see llama_cpp's package in a process that imported it"
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
            assert chat_libraries(node.proc.pid) == set(), f"node {node.url} imported llama_cpp's whole package"
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


# -- KV memory as sessions use it (llama.cpp patch 0007, node/memory.py) ------------------------------------------

PAGED_PATCHES = (
    "0007-kv-give-back-unused-cells",
    "0008-kv-cell-metadata-on-demand",
    "0012-compute-buffers-given-back-when-idle",
)
CONTEXT = 65536  # the tiny model's context: a paged node's default --ctx-size
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2  # 4 layers x (K, V) x 2 KV heads x 64 dims x f16


def rss(pid: int) -> int:
    """VmRSS of process ``pid`` (bytes)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def call(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode() if body is not None else None, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def kv_allocated(url: str) -> int:
    """Bytes of llama.cpp's KV buffers on the node (``/health`` placement)."""
    return sum(b.get("KV", 0) for b in call("GET", url + "/health")[1]["placement"]["buffers"].values())


@pytest.fixture(scope="module")
def paged(tiny_dir):
    """Four llama.cpp nodes of one tiny model (4 layers, a 64K context), whole model each, ``--gpu none`` but the
    last two: ``fixed`` with --ctx-size 256 (the control), ``paged`` with the defaults, ``budget`` with a 6 MiB KV
    budget (3072 tokens), ``auto`` as ``fixed`` with ``--gpu auto``, ``listing`` as ``auto`` with
    ``GGML_VK_VISIBLE_DEVICES=0`` (the user lists Vulkan devices: lavapipe where there is no GPU)."""
    for patch in PAGED_PATCHES:
        assert patches.applied(patch), "make setup builds llama.cpp with the patch queue"
    path = write_tiny_model(tiny_dir / "paged-llama.gguf", "llama", n_layers=4, context_length=CONTEXT)
    auto = ["--ctx-size", "256", "--gpu", "auto"]
    extra = {0: ["--ctx-size", "256"], 1: [], 2: ["--kv-budget-mb", "6"], 3: auto, 4: auto}
    nodes = start_nodes(
        [ShardSpec(0, 4, embed=True, head=True)] * 5,
        str(path),
        threads=1,
        extra=["--max-sessions", "8", "--gpu", "none"],
        per_node=lambda i: extra[i],
        per_node_env=lambda i: {"GGML_VK_VISIBLE_DEVICES": "0"} if i == 4 else {},
    )
    try:
        yield dict(zip(("fixed", "paged", "budget", "auto", "listing"), nodes))
    finally:
        stop_nodes(nodes)


def test_kv_memory_is_resident_only_as_sessions_use_it(paged):
    """A paged node offers the model's whole context to each of its 9 KV streams (1.1 GiB of KV cells in all), yet
    its RSS is that of a node with 256 cells per stream (the cells' K/V: patch 0007; their metadata: 0008); one
    session of 32K tokens (the only one: it may take almost all of the node's context) makes the node resident by
    about the KV it holds, and closing it gives that back."""
    fixed, node = paged["fixed"], paged["paged"]
    h = call("GET", node.url + "/health")[1]
    assert h["max_length"] == CONTEXT and h["kv_bytes_per_token"] == KV_BYTES_PER_TOKEN
    extra_kv = kv_allocated(node.url) - kv_allocated(fixed.url)
    assert extra_kv >= 9 * (CONTEXT - 256) * KV_BYTES_PER_TOKEN * 0.99
    assert rss(node.proc.pid) - rss(fixed.proc.pid) < extra_kv / 20
    # patch 0008: nor does the cells' metadata (52 bytes a cell: 29 MiB for these 9 x 64K cells when written whole)
    assert rss(node.proc.pid) - rss(fixed.proc.pid) < 12 * 2**20

    n = 32768
    held = n * KV_BYTES_PER_TOKEN  # 64 MiB
    before = rss(node.proc.pid)
    session = RemoteRoute([node.url], 60.0).open(CONTEXT - 16, SamplingParams(temperature=0), ring=False)
    try:
        step = session.route.max_step_tokens
        ids = [5 + (i * 7) % 300 for i in range(n)]
        for lo in range(0, n, step):
            session.step(ids[lo : lo + step], sample=lo + step >= n)
        assert call("GET", node.url + "/health")[1]["kv_tokens_held"] == n
        during = rss(node.proc.pid)
        assert during - before >= 0.75 * held
    finally:
        session.close()
    after = rss(node.proc.pid)
    assert during - after >= 0.75 * held  # the session's cells went back to the OS
    # and so did llama.cpp's compute buffers, which the 32K prefill made resident (patch 0012: given back when the
    # node's last session closes; without it they stay, 40 MiB here)
    assert after - before < 12 * 2**20, f"RSS {before / 2**20:.0f} MiB before the session, {after / 2**20:.0f} after"


def test_a_session_that_does_not_fit_the_budget_is_refused_with_the_numbers_and_others_go_on(paged):
    """A node's sessions reserve its KV budget (6 MiB here: 3072 tokens) at open: one that does not fit is refused
    with kv_budget_full (429) and the numbers, the open one decodes on, and once it is closed a single session may
    reserve almost the whole budget (a paged node has no 1/--max-sessions cap)."""
    url = paged["budget"].url
    h = call("GET", url + "/health")[1]
    assert h["kv_budget_tokens"] == 6 * 2**20 // KV_BYTES_PER_TOKEN == h["max_length"] == 3072
    route = RemoteRoute([url], 60.0)
    first = route.open(2000, SamplingParams(temperature=0))
    try:
        token = first.step(list(range(5, 105)))
        status, body = call("POST", url + "/v1/sessions", {"max_length": 2000})
        assert status == 429 and body["error"]["code"] == "kv_budget_full"
        assert "1072 of 3072 tokens free" in body["error"]["message"], body
        for _ in range(3):
            token = first.step([token])
        assert first.position == 103
    finally:
        first.close()
    long = route.open(3000, SamplingParams(temperature=0))
    try:
        assert long.step([5 + i % 300 for i in range(2000)]) is not None
    finally:
        long.close()
    assert call("GET", url + "/health")[1]["status"] == "ok"


def gpu_drivers(pid: int) -> set[str]:
    """Vulkan drivers (and the LLVM Mesa's load) mapped into process ``pid``."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in maps if "libvulkan_" in line or "libLLVM" in line}


def test_a_node_with_no_gpu_to_use_loads_no_gpu_driver(paged):
    """``--gpu none``, and ``--gpu auto`` on a machine with no GPU device file: the node's Vulkan backend finds no
    driver to load (node.memory.no_gpu_to_look_for, skip_gpu_drivers), where a node listing Vulkan devices (the
    control) loads the machine's. Without a Vulkan driver on the machine the control loads none and there is nothing
    to see: skipped, unless GGUFSWARM_REQUIRE_GPU_TESTS=1 (`make test` sets it where it built the Vulkan backend and
    installed Mesa's drivers)."""
    if not gpu_drivers(paged["listing"].proc.pid):
        if os.environ.get("GGUFSWARM_REQUIRE_GPU_TESTS") == "1":
            pytest.fail("GGUFSWARM_REQUIRE_GPU_TESTS=1 but a node listing Vulkan devices loaded no Vulkan driver")
        pytest.skip("no Vulkan driver loaded by a node listing Vulkan devices on this machine")
    for name in ("fixed", "paged", "budget"):
        assert gpu_drivers(paged[name].proc.pid) == set(), name
    if no_gpu_to_look_for("auto"):  # (this machine has no GPU device file)
        assert gpu_drivers(paged["auto"].proc.pid) == set()
    else:
        assert gpu_drivers(paged["auto"].proc.pid), "a --gpu auto node on a machine with a GPU looks for it"


def test_a_long_metadata_array_reads_as_its_list_kept_packed(tmp_path):
    """A vocabulary-sized array (over ``PACKED_ARRAY_MIN`` items) reads back item for item as written (strings with
    multi-byte UTF-8 and the empty string, floats, ints), compares equal to its list, slices to lists, and writes
    back through ``gguf``'s writer unchanged; short arrays stay plain lists."""
    from gguf import GGUFValueType, GGUFWriter

    from ggufswarm.artifact.gguf_file import PACKED_ARRAY_MIN, GGUFModelFile, PackedArray

    n = PACKED_ARRAY_MIN + 5
    tokens = [f"tok{i}" if i % 7 else f"ü€{i}\n" for i in range(n)]
    tokens[3] = ""
    scores = [float(np.float32(i / 3)) for i in range(n)]
    types = [i % 6 for i in range(n)]

    def write(path, toks, scs, tys):
        w = GGUFWriter(str(path), "llama")
        w.add_key_value("tokenizer.ggml.tokens", toks, GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
        w.add_key_value("tokenizer.ggml.scores", scs, GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
        w.add_key_value("tokenizer.ggml.token_type", tys, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
        w.add_key_value("llama.short", [1, 2, 3], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(tmp_path / "a.gguf", tokens, scores, types)
    md = GGUFModelFile(tmp_path / "a.gguf").metadata
    got = md["tokenizer.ggml.tokens"]
    assert isinstance(got, PackedArray) and isinstance(md["tokenizer.ggml.scores"], PackedArray)
    assert md["llama.short"] == [1, 2, 3] and isinstance(md["llama.short"], list)
    assert len(got) == n and list(got) == tokens and got == tokens and tokens == got
    assert got[-1] == tokens[-1] and got[3] == "" and got[7] == "ü€7\n" and got[10:13] == tokens[10:13]
    assert md["tokenizer.ggml.scores"].tolist() == scores and md["tokenizer.ggml.token_type"] == types
    assert got != tokens[:-1] + ["other"]
    with pytest.raises(IndexError):
        got[n]
    # written back through gguf's writer (a head shard's derived header copies the vocabulary)
    write(tmp_path / "b.gguf", got, md["tokenizer.ggml.scores"], md["tokenizer.ggml.token_type"])
    again = GGUFModelFile(tmp_path / "b.gguf").metadata
    assert again["tokenizer.ggml.tokens"] == got and again["tokenizer.ggml.scores"] == scores
    assert again["tokenizer.ggml.token_type"] == md["tokenizer.ggml.token_type"]
