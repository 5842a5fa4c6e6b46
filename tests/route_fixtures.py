"""Shared by test_node.py and test_gateway.py: a 3-node Gemma cluster (subprocesses), a gateway, references.

Import the fixtures explicitly (``from route_fixtures import cluster, gateway``). They are session-scoped: the
modules that use them (test_node, test_gateway, test_speculative) share one cluster and one gateway, booted once.
A test that stops or kills a node starts its own (``start_spare_head``), never one of these.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
import uuid

import pytest
import torch

from ggufswarm.client.generate import GenerationStats, generate
from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.net.http import ServerThread
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.shard import ShardSpec, even_split

HOP_TIMEOUT = 10.0  # seconds per hop, for the gateway's sessions and the nodes' default


@pytest.fixture(scope="session")
def cluster(gemma_path):
    """Three node processes serving Gemma 3 270M as 0:6 (+embed), 6:12, 12:18 (+head); 1 thread each."""
    nodes = start_nodes(even_split(18, 3), str(gemma_path), threads=1, extra=["--hop-timeout", str(HOP_TIMEOUT)])
    yield nodes
    stop_nodes(nodes)


@pytest.fixture(scope="session")
def gateway(cluster, gemma_path):
    """Base URL (``http://127.0.0.1:PORT``) of an in-process gateway over ``cluster``."""
    server = ServerThread(
        make_app(GatewayConfig([n.url for n in cluster], model=str(gemma_path), hop_timeout_s=HOP_TIMEOUT))
    )
    url = server.start()
    yield url
    server.stop()


def start_spare_head(gemma_path, *extra: str):
    """One extra node serving 12:18 +head (a replacement last hop), with extra CLI flags."""
    return start_nodes([ShardSpec(12, 18, head=True)], str(gemma_path), threads=1, extra=list(extra))[0]


@contextlib.contextmanager
def one_thread():
    """Run torch on one thread (two threads on two shared cores are ~3x slower here)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


_REFS: dict = {}


def reference(model, prompt: str, max_tokens: int, chat: bool = False) -> tuple[str, list[int]]:
    """Greedy completion by the in-process path of ``ggufswarm generate --temperature 0`` (text, token ids)."""
    key = (id(model), prompt, max_tokens, chat)  # per model: the llama.cpp and torch references differ
    if key not in _REFS:
        ids = model.prompt_ids(prompt, chat=chat)
        stats = GenerationStats()
        with one_thread():
            session = model.session(len(ids) + max_tokens, SamplingParams(temperature=0))
            text = "".join(generate(session, model.tokenizer, ids, max_tokens, [], stats))
        _REFS[key] = (text, stats.tokens)
    return _REFS[key]


GREEDY_PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Москва — столица",
    "東京は日本の",
    "I love pizza 🍕 because",
    "Translate to French: The cat sits on the mat.\nFrench:",
    "1, 2, 3, 5, 8, 13,",
    "<html>\n<head>\n<title>",
    "Once upon a time, in a small village,",
]


def greedy_prompts(reference_text: str) -> list[str]:
    """Ten varied prompts (code, Cyrillic, Japanese, emoji, HTML, one over 600 Gemma tokens)."""
    return GREEDY_PROMPTS + ["Summarize the following text.\n\n" + reference_text[:3500] + "\n\nSummary:"]


def llama_cpp_greedy_tokens(path, prompts_ids: list[list[int]], n: int, threads: int = 1) -> list[list[int]]:
    """llama.cpp's own full model (llama-cpp-python, flash attention as llama.cpp's CPU default): ``n`` greedy
    tokens per prompt. Threads matter: llama.cpp's split-KV attention divides the cache by thread count."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        str(path),
        n_ctx=2048,
        n_batch=2048,
        n_ubatch=512,
        logits_all=False,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        verbose=False,
    )
    out = []
    try:
        for ids in prompts_ids:
            llm.reset()
            llm.eval(ids)
            toks = []
            for _ in range(n):
                last = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
                toks.append(int(np.argmax(last)))
                llm.eval([toks[-1]])
            out.append(toks)
    finally:
        llm.close()
    return out


def sse(url: str, path: str, body: dict) -> tuple[list[dict], list[str]]:
    """POST a streamed request; (parsed chunks, raw data lines). Asserts it ends with data: [DONE]."""
    req = urllib.request.Request(
        url + path,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode().strip() for line in resp if line.strip()]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]], lines


def http(method: str, url: str, body: bytes | dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    """One HTTP request; (status, parsed JSON body). dict bodies are sent as JSON, bytes as octet-stream."""
    headers = {}
    if isinstance(body, dict):
        body = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    elif body is not None:
        headers["Content-Type"] = "application/octet-stream"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def health(url: str) -> dict:
    status, body = http("GET", url + "/health")
    assert status == 200 and body["status"] == "ok"
    return body


def wait_until_idle(nodes, bound_s: float = 120.0) -> None:
    """Wait until no node of ``nodes`` holds a session: a gateway sends the last event of a response before it
    closes the route session, so the test before may have left one closing. ``bound_s`` is a bound, not a timing."""
    deadline = time.monotonic() + bound_s
    while any(health(n.url)["sessions"] for n in nodes):
        assert time.monotonic() < deadline, [health(n.url)["sessions"] for n in nodes]
        time.sleep(0.1)


@contextlib.contextmanager
def tiny_split_route(model: str, data_dir):
    """In-process nodes over a 2-layer GGUF ``model``: ``first`` ([0,1) + embedding), ``head`` ([1,2) + head) and
    ``whole`` (the model on one node, the reference); a dict of their URLs (and ``model``) while open."""
    from apphost import AppThread

    from ggufswarm.node.app import make_app as make_node_app
    from ggufswarm.node.state import NodeConfig

    def node(layers: str, name: str, **stages):
        return AppThread(
            lambda: make_node_app(NodeConfig(layers=layers, model=model, data_dir=str(data_dir / name), **stages))
        )

    with (
        node("0:1", "first", embed=True) as first,
        node("1:2", "head", head=True) as head,
        node("0:2", "whole", embed=True, head=True) as whole,
    ):
        yield {"first": first, "head": head, "whole": whole, "model": model}


def open_greedy(url: str, max_length: int = 128) -> uuid.UUID:
    """Open a greedy session (top 5 logprobs) straight on node ``url``; its id."""
    sid = uuid.uuid4()
    status, body = http(
        "POST",
        url + "/v1/sessions",
        {"session_id": str(sid), "max_length": max_length, "sampling": {"temperature": 0}, "top_logprobs": 5},
    )
    assert status == 201, body
    return sid
