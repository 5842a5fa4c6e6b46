"""A session's idle clock (node ``--session-ttl``, a client's lease) counts only time the node could serve.

The cause of a good session lost under the fuzzer's load (issue 22): on a starved machine a node's event loop can
stall for longer than the session TTL. A step that arrives meanwhile waits in the socket, and when the loop resumes
the reaper, whose timer is overdue, runs before the step's handler has read it: the session of a client that was not
idle was dropped (``unknown session`` at its next step). The reaper now credits a stall to every session's idle clock.
"""

from __future__ import annotations

import time
import uuid

import pytest
from route_fixtures import http
from tinymodels import write_tiny_model

from ggufswarm.net.http import ServerThread
from ggufswarm.node import NodeConfig, make_app
from ggufswarm.protocol.frame import encode_tokens

TTL_S = 0.6


@pytest.fixture(scope="module")
def node(tiny_dir):
    """An in-process whole-model node of a tiny llama with a session TTL of TTL_S; (url, server)."""
    model = write_tiny_model(
        tiny_dir / "ttl-llama.gguf",
        "llama",
        n_layers=2,
        n_embd=64,
        n_head=2,
        n_head_kv=1,
        head_dim=32,
        n_ff=128,
        context_length=256,
        seed=5,
    )
    server = ServerThread(
        make_app(
            NodeConfig(
                layers="0:2",
                embed=True,
                head=True,
                model=str(model),
                session_ttl_s=TTL_S,
                data_dir=str(tiny_dir / "ttl-node"),
            )
        )
    )
    url = server.start()
    yield url, server
    server.stop()


def _open(url: str) -> uuid.UUID:
    sid = uuid.uuid4()
    status, body = http(
        "POST", url + "/v1/sessions", {"session_id": str(sid), "max_length": 16, "sampling": {"temperature": 0}}
    )
    assert status == 201, body
    return sid


def _step(url: str, sid: uuid.UUID) -> tuple[int, dict]:
    return http("POST", url + "/v1/step", encode_tokens(sid, 1, 0, [5, 6, 7]))


def test_a_step_that_waited_out_a_stall_of_the_node_finds_its_session(node):
    """The node's loop is blocked for 4 TTLs right after the open; the client's step, sent during the stall, is
    answered 200, not 404 unknown_session (it was before the fix, every time)."""
    url, server = node
    sid = _open(url)
    server.loop.call_soon_threadsafe(time.sleep, 4 * TTL_S)  # the stall: nothing on the node's loop runs
    time.sleep(0.05)
    status, body = _step(url, sid)
    assert status == 200, body
    assert http("DELETE", f"{url}/v1/sessions/{sid}")[0] == 200


def test_an_idle_session_still_expires(node):
    """The other side: a client idle for 4 TTLs while the node runs loses its session (404 unknown_session)."""
    url, _ = node
    sid = _open(url)
    time.sleep(4 * TTL_S)
    status, body = _step(url, sid)
    assert status == 404 and body["error"]["code"] == "unknown_session", body
