"""One error path: the exception → (status, code) mapping is one function (net.http.as_protocol_error), used by
every server's HTTP middleware and by a node's link replies, so a refused request is a 4xx wherever it is raised."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from aiohttp import web
from apphost import AppThread

from ggufswarm.net.http import as_protocol_error, json_errors_middleware
from ggufswarm.protocol import ProtocolError
from ggufswarm.runtime.kv import ContextOverflow
from ggufswarm.runtime.session_state import UnknownSession


@pytest.mark.parametrize(
    "exc, status, code",
    [
        (ProtocolError("bad_dtype", "x"), 400, "bad_dtype"),
        (UnknownSession("gone"), 404, "unknown_session"),
        (ContextOverflow("too long"), 400, "context_overflow"),
        (ValueError("top_p must be in (0, 1]"), 400, "bad_request"),
        (UnicodeEncodeError("ascii", "é", 0, 1, "no"), 500, "internal"),
        (KeyError("bug"), 500, "internal"),
    ],
)
def test_one_mapping_of_exceptions_to_errors(exc, status, code):
    err = as_protocol_error(exc)
    assert (err.status, err.code) == (status, code)


def test_a_value_error_a_handler_raises_is_a_400_through_the_middleware():
    """The middleware every server (node, tracker, cache, gateway) installs answers a handler's ValueError as the
    node's link replies do: 400 bad_request, not 500."""
    seen = []

    async def refuse(_request):
        raise ValueError("temperature must be >= 0")

    def factory():
        app = web.Application(middlewares=[json_errors_middleware(lambda _req, err: seen.append(err.code))])
        app.router.add_get("/x", refuse)
        return app

    with AppThread(factory) as url, pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url + "/x", timeout=10)
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"]["code"] == "bad_request"
    assert seen == ["bad_request"]
