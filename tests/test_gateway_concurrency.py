"""The gateway runs each generation as a coroutine on its event loop (gateway/generation.py): many concurrent
streamed completions through one gateway, each answered as when it runs alone, on a bounded number of threads."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import aiohttp
import pytest
from tinymodels import write_tiny_model

from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.net.http import ServerThread
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.spec import ShardSpec

N_STREAMS = 256  # concurrent streamed chat completions
MAX_TOKENS = 4  # tokens each (ignore_eos: exactly that many)
PROMPTS = [f"request {i}: count {' '.join(str(j) for j in range(i % 5 + 1))}" for i in range(8)]
THREAD_GROWTH_LIMIT = 32  # threads the test process may add while streaming (pools warming up): far below the streams
SAMPLE_S = 0.05  # how often the thread count is sampled


@pytest.fixture(scope="module")
def tiny_route(tmp_path_factory):
    """A tiny 2-layer llama split over two node processes that each hold N_STREAMS sessions at once; the model's
    path and the nodes."""
    work = tmp_path_factory.mktemp("many")
    model = str(write_tiny_model(work / "many-llama.gguf", "llama", n_layers=2))
    nodes = start_nodes(
        [ShardSpec(0, 1, embed=True), ShardSpec(1, 2, head=True)],
        model,
        threads=1,
        extra=["--max-sessions", str(N_STREAMS), "--ctx-size", "256"],
        per_node=lambda i: ["--data-dir", str(work / f"node{i}")],
    )
    yield model, nodes
    stop_nodes(nodes)


def body(prompt: str) -> dict:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream(http: aiohttp.ClientSession, url: str, prompt: str) -> tuple[str, dict]:
    """One streamed chat completion: its text and its usage chunk; AssertionError for an error event or a stream
    that does not end with ``[DONE]``."""
    text, usage, done = [], None, False
    async with http.post(url, json=body(prompt)) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            line = line.strip()
            if not line:
                continue
            assert line.startswith(b"data: "), line
            if line == b"data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len(b"data: ") :])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
    assert done and usage is not None
    return "".join(text), usage


def threads_now() -> int:
    """Threads of this process: the kernel's count (native ones too), or Python's where /proc is not there."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


async def run_all(url: str) -> tuple[dict, list, int]:
    """Each prompt alone first (the references), then N_STREAMS streams at once, the thread count sampled
    meanwhile: (references, results, threads before the streams, most threads seen while they ran)."""
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=120), connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        alone = {p: await stream(http, url, p) for p in PROMPTS}
        peak = before = threads_now()  # the process's other threads: earlier tests' servers, pools, pytest's

        async def sample():
            nonlocal peak
            while True:
                peak = max(peak, threads_now())
                await asyncio.sleep(SAMPLE_S)

        sampler = asyncio.create_task(sample())
        try:
            results = await asyncio.gather(*(stream(http, url, PROMPTS[i % len(PROMPTS)]) for i in range(N_STREAMS)))
        finally:
            sampler.cancel()
        return alone, results, before, peak


def test_256_concurrent_streams_through_one_gateway_on_few_threads(tiny_route, tmp_path):
    """N_STREAMS streamed chat completions at once through one gateway all complete (``[DONE]``, usage of exactly
    MAX_TOKENS tokens) with the greedy text each prompt gets alone, while this process (the gateway, its
    client, pytest) adds at most THREAD_GROWTH_LIMIT threads to those it had before: no thread per generation."""
    model, nodes = tiny_route
    server = ServerThread(make_app(GatewayConfig([n.url for n in nodes], model=model, data_dir=str(tmp_path))))
    url = server.start() + "/v1/chat/completions"
    try:
        t0 = time.perf_counter()
        alone, results, before, peak = asyncio.run(run_all(url))
        elapsed = time.perf_counter() - t0
    finally:
        server.stop()
    assert len(results) == N_STREAMS
    for i, (text, usage) in enumerate(results):
        want_text, want_usage = alone[PROMPTS[i % len(PROMPTS)]]
        assert usage["completion_tokens"] == MAX_TOKENS and usage == want_usage, (i, usage)
        assert text == want_text, (i, text, want_text)
    assert peak - before <= THREAD_GROWTH_LIMIT, f"{before} threads, then {peak} while {N_STREAMS} streams ran"
    print(f"{N_STREAMS} streams in {elapsed:.1f} s; {before} threads before, at most {peak} while they ran")
