"""The HTTP layer every ggufswarm server shares (node, tracker, snapshot cache, gateway): reading a JSON request
body within limits, turning an exception into a JSON error answer, JSON 404/405, and serving an app (in the
foreground until a signal, or in a background thread).

Error answers are ``{"error": {"code", "message"[, "hop"]}}`` with the HTTP status of the code
(``protocol/errors.py``, ``ERROR_STATUS``; docs/protocol.md, "Errors"); the gateway writes OpenAI's error shape
instead (``gateway/app.py``) from the same ProtocolError.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import re
import signal
import threading
from collections.abc import Callable

import aiohttp
from aiohttp import web

from ..protocol.errors import ERROR_STATUS, ProtocolError, error_body

log = logging.getLogger(__name__)

JSON = "application/json"
MAX_JSON_DEPTH = 100  # arrays/objects nested deeper than this are refused before parsing (see json_depth)

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


async def probe(http: aiohttp.ClientSession, url: str, headers: dict | None = None) -> str | None:
    """``GET url`` with ``http`` (its timeout bounds the wait): None when it answers 200, else why not in one line
    (``connection refused``, ``timeout``, ``HTTP 503``; a 401 names the swarm token). Never raises for a network
    error. The tracker checks a reported node with it, the gateway its route (or its tracker) for ``/health``."""
    return (await probe_json(http, url, headers, read=False))[1]


async def probe_json(
    http: aiohttp.ClientSession, url: str, headers: dict | None = None, read: bool = True
) -> tuple[dict | None, str | None]:
    """``probe`` that also reads the answer: ``(JSON object, None)`` on a 200 whose body is one (``({}, None)``
    with ``read=False``), else ``(None, why)``; a 200 that is not a JSON object is ``"bad answer: ..."``."""
    try:
        async with http.get(url, headers=headers) as resp:
            if resp.status != 200:
                why = f"HTTP {resp.status}" + (" (wrong or missing swarm token: --token)" if resp.status == 401 else "")
                return None, why
            if not read:
                return {}, None
            try:
                body = await resp.json(content_type=None)
            except ValueError as exc:
                return None, f"bad answer: {exc}"
            return (body, None) if isinstance(body, dict) else (None, "bad answer: not a JSON object")
    except TimeoutError:  # (aiohttp's timeouts are asyncio.TimeoutError too)
        return None, "timeout"
    except aiohttp.ClientConnectorError as exc:
        if getattr(exc.os_error, "errno", None) == errno.ECONNREFUSED:
            return None, "connection refused"
        return None, " ".join(f"cannot connect: {exc.os_error or exc}".splitlines())
    except (aiohttp.ClientError, OSError) as exc:
        return None, " ".join(f"{type(exc).__name__}: {exc}".splitlines())


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in the JSON ``text`` (brackets inside strings do not count); an upper
    bound, without a scan, when the text has at most MAX_JSON_DEPTH opening brackets.

    Checked before ``json.loads``, which recurses once per level: a body nested thousands of levels deep
    would otherwise drive the server thread to the interpreter's recursion limit, where even a garbage
    collector finaliser that runs at that moment fails.
    """
    opens = text.count("[") + text.count("{")
    if opens <= MAX_JSON_DEPTH:
        return opens
    depth = deepest = 0
    for c in _NOT_BRACKET.sub("", _JSON_STRING.sub('""', text)):
        depth += 1 if c in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def body_error(exc: BaseException) -> ProtocolError | None:
    """The protocol error for a request body that could not be read, or None for other errors.

    Maps aiohttp's over-limit body (413 ``body_too_large``), an unknown charset in Content-Type (LookupError),
    bytes that are not text in that charset (UnicodeDecodeError) and an undecodable Content-Encoding
    (RequestPayloadError) to one error each, so servers answer them instead of 500; a connection the client closed
    before its body arrived (ConnectionResetError) is ``client_gone`` (499, nginx's "client closed request"): an
    aborted request, not a bug.
    """
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return ProtocolError("body_too_large", f"request body too large: {exc.text}")
    if type(exc) is LookupError:  # codecs: only this exact type (KeyError / IndexError are bugs)
        return ProtocolError("bad_request", f"cannot decode the body: {exc}")
    if isinstance(exc, UnicodeDecodeError):
        return ProtocolError("bad_request", f"the body is not text in its charset: {exc}")
    if isinstance(exc, web.RequestPayloadError):
        return ProtocolError("bad_request", f"cannot read the body: {exc}")
    if isinstance(exc, ConnectionResetError):
        return ProtocolError("client_gone", f"the client closed the connection before its request body arrived: {exc}")
    return None


async def read_json(request: web.Request, code: str = "bad_request") -> dict:
    """The request body as a JSON object.

    The body is decoded with the Content-Type's charset (UTF-8 by default) and must nest at most MAX_JSON_DEPTH
    levels. Raises ProtocolError: ``code`` (400; the tracker says ``bad_json``) for a body that is not text,
    not JSON, nested too deep or not an object; ``body_too_large`` (413) over the app's ``client_max_size``.
    """
    try:
        text = await request.text()
    except Exception as exc:
        if (err := body_error(exc)) is None:
            raise
        raise ProtocolError(code if err.code == "bad_request" else err.code, err.message) from None
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ProtocolError(code, f"body is not usable JSON: arrays/objects nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ProtocolError(code, f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(code, "body must be a JSON object")
    return body


def as_protocol_error(exc: BaseException) -> ProtocolError:
    """The ProtocolError to answer ``exc`` with, wherever it was raised (an HTTP handler through
    json_errors_middleware, a node's link reply): the one mapping of exceptions to error codes.

    * a ProtocolError: itself;
    * a typed error of the runtime, cache or tracker whose class carries a ``code`` of ERROR_STATUS (SessionError,
      ContextOverflow, TokenOutOfRange, the snapshot store's errors, ...): that code and its message;
    * a body that could not be read: body_error's;
    * any other ValueError (not a UnicodeError): ``bad_request`` (400): the request's values were refused (a
      sampling parameter out of range, a grammar that does not parse, a truncate past the end...);
    * anything else: ``internal`` (500, a bug; the message names the exception).
    """
    if isinstance(exc, ProtocolError):
        return exc
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code in ERROR_STATUS:
        return ProtocolError(code, str(exc))
    if (err := body_error(exc)) is not None:
        return err
    if isinstance(exc, ValueError) and code is None and not isinstance(exc, UnicodeError):
        return ProtocolError("bad_request", str(exc))
    return ProtocolError("internal", f"{type(exc).__name__}: {exc}")


def error_response(err: ProtocolError, headers: dict | None = None) -> web.Response:
    """The JSON error answer for ``err`` (its status; body as ProtocolError.body)."""
    return web.Response(body=err.body(), status=err.status, content_type=JSON, headers=headers)


def json_errors_middleware(
    on_error: Callable[[web.Request, ProtocolError], None] | None = None,
    render: Callable[[ProtocolError, dict | None], web.Response] = error_response,
):
    """aiohttp middleware giving every error a JSON answer, written by ``render(err, headers)`` (default
    error_response; the gateway writes OpenAI's error shape).

    * the router's own 404 / 405 (no such path, wrong method) → ``not_found`` / ``method_not_allowed``;
    * an exception a handler raises (not aiohttp's own HTTP exceptions, which are answers) → as_protocol_error;
      an ``internal`` one is logged with its traceback. ``on_error(request, err)`` sees each (metrics).
    * a request body the handler never read: the answer closes the connection (aiohttp would otherwise try to
      discard the body to reuse the connection, and drop it without a word when it cannot, as for an
      undecodable Content-Encoding).
    """

    @web.middleware
    async def to_json(request, handler):
        try:
            resp = await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
            if exc.status == 404:
                err = ProtocolError("not_found", f"no endpoint {request.method} {request.path}")
                headers = None
            else:
                allowed = sorted(getattr(exc, "allowed_methods", ()) or ())
                err = ProtocolError(
                    "method_not_allowed",
                    f"{request.path} does not take {request.method} (allowed: {', '.join(allowed)})",
                )
                headers = {"Allow": ",".join(allowed)}
            resp = render(err, headers)
        except web.HTTPException:
            raise
        except Exception as exc:
            err = as_protocol_error(exc)
            if err.code == "internal":
                log.exception("%s %s failed", request.method, request.path)
            if on_error is not None:
                on_error(request, err)
            resp = render(err, None)
        if request.body_exists and not request.content.at_eof() and isinstance(resp, web.Response):
            resp.force_close()
        return resp

    return to_json


async def serve(app: web.Application, host: str, port: int, ready: Callable[[str], None] | None = None) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT/SIGTERM; ``ready(url)`` is called once listening (port 0 =
    any free port). Raises OSError when the address cannot be bound."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready:
        ready(f"http://{host}:{runner.addresses[0][1]}")
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run_server(app: web.Application, host: str, port: int, ready: Callable[[str], None] | None = None) -> None:
    """``serve`` in the foreground on uvloop's event loop (libuv), asyncio's own without it: every decode token
    crosses each node's loop twice per hop (why uvloop: docs/design.md, "Measured choices")."""
    try:
        import uvloop
    except ImportError:  # not on this platform (Windows)
        asyncio.run(serve(app, host, port, ready))
    else:
        uvloop.run(serve(app, host, port, ready))


class ServerThread:
    """Serve an aiohttp app on its own event loop in a daemon thread (the demo and tests).

    ``start()`` returns the base URL once listening (port 0: any free port); ``stop()`` shuts the server down;
    ``loop`` is the event loop the app runs on (to schedule work on it from another thread).
    """

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self.url: str | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="aiohttp")
        self._runner: web.AppRunner | None = None

    def start(self, timeout: float = 60.0) -> str:
        async def boot():
            self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
            await self._runner.setup()
            await web.TCPSite(self._runner, self.host, self.port).start()
            return f"http://{self.host}:{self._runner.addresses[0][1]}"

        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(boot(), self.loop).result(timeout)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        if self._runner is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout)
            except Exception:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


__all__ = [
    "JSON",
    "MAX_JSON_DEPTH",
    "ServerThread",
    "as_protocol_error",
    "body_error",
    "error_body",
    "error_response",
    "json_depth",
    "json_errors_middleware",
    "read_json",
    "run_server",
    "serve",
]
