"""The gateway's errors in OpenAI's shape: the typed errors handlers raise, the one renderer of every error answer
(``{"error": {message, type, param, code}}``), and the stderr lines of failed requests and repaired routes."""

from __future__ import annotations

import json
import sys

from aiohttp import web

from ..client.transport import REPAIRABLE
from ..net.http import as_protocol_error
from ..protocol.errors import ProtocolError, RouteError

JSON = "application/json"
# what a gateway without a tracker can and cannot do about a failed node (its error answers and its /health say it)
FIXED_ROUTE_HINT = (
    "this gateway serves a fixed --route and cannot replace a failed node: start that node again, "
    "the gateway finds it on the next request; or run the gateway with --tracker and spare nodes, "
    "and routes are repaired mid-request"
)
CLIENT_GONE = 499  # nginx's "client closed request": the answer to a client that left (nobody reads it)
SERVER_ERROR = 500  # statuses from here on are the gateway's (or the swarm's) fault: they leave a stderr line


class GatewayError(ProtocolError):
    """An error answer in OpenAI's shape: HTTP ``status``, OpenAI error ``type``, ``code``, ``param`` (the request
    parameter at fault, or None) and ``telemetry`` (what the route session did before it failed, or None)."""

    def __init__(
        self,
        message: str,
        status: int,
        code: str,
        param: str | None = None,
        type_: str | None = None,
        telemetry: dict | None = None,
    ):
        super().__init__(code, message, status)
        self.param = param
        self.type = type_ or ("invalid_request_error" if status < SERVER_ERROR else "server_error")
        self.telemetry = telemetry


class RequestError(GatewayError):
    """A request the gateway refuses: HTTP ``status`` (default 400), OpenAI error ``type``, ``code`` and ``param``."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        code: str = "invalid_request",
        param: str | None = None,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message, status, code, param, type_)


def route_failure(exc: RouteError, fixed_route: bool, telemetry: dict | None = None) -> GatewayError:
    """The answer to a route that failed (``type`` ``route_error``, the RouteError's status and code).
    ``fixed_route`` (a gateway without a tracker) adds what it can and cannot do about a failed node
    (FIXED_ROUTE_HINT) to a repairable failure; ``telemetry``: what the session did before it failed."""
    message = f"{exc} ({FIXED_ROUTE_HINT})" if fixed_route and exc.code in REPAIRABLE else str(exc)
    return GatewayError(message, exc.status, exc.code, type_="route_error", telemetry=telemetry)


def as_gateway_error(exc: BaseException, telemetry: dict | None = None) -> GatewayError:
    """``exc`` as a GatewayError: itself, a RouteError's route_failure (as on a gateway with a tracker), anything
    else with the code and status net.http.as_protocol_error maps it to (the mapping every server uses)."""
    if isinstance(exc, GatewayError):
        if telemetry is not None and exc.telemetry is None:
            exc.telemetry = telemetry
        return exc
    if isinstance(exc, RouteError):
        return route_failure(exc, False, telemetry)
    err = as_protocol_error(exc)
    return GatewayError(err.message, err.status, err.code, telemetry=telemetry)


def error_object(err: ProtocolError) -> dict:
    """OpenAI's ``{"message", "type", "param", "code"}`` of ``err`` (a GatewayError, or any ProtocolError)."""
    kind = getattr(err, "type", None) or ("invalid_request_error" if err.status < SERVER_ERROR else "server_error")
    return {"message": err.message, "type": kind, "param": getattr(err, "param", None), "code": err.code}


def error_response(err: ProtocolError, headers: dict | None = None) -> web.Response:
    """The error answer of ``err``: ``{"error": error_object, "telemetry"?}`` with its status (the renderer of
    net.http.json_errors_middleware for the gateway)."""
    body = {"error": error_object(err)}
    if getattr(err, "telemetry", None):
        body["telemetry"] = err.telemetry
    return web.Response(body=json.dumps(body).encode(), status=err.status, content_type=JSON, headers=headers)


def one_line(text) -> str:
    """``text`` with its line breaks as spaces: one line of a log."""
    return " ".join(str(text).splitlines())


def say_failed(what: str, status: int, code: str, message: str) -> None:
    """One line on stderr for a request that failed on the gateway's side (``status`` >= 500; a client's 4xx
    says nothing): ``ggufswarm gateway: WHAT (STATUS CODE): MESSAGE``, flushed at once."""
    if status >= SERVER_ERROR:
        print(f"ggufswarm gateway: {what} ({status} {code}): {one_line(message)}", file=sys.stderr, flush=True)


def say_repaired(repairs: list[dict]) -> None:
    """One stderr line per route repair that worked (``telemetry.repairs``): ``ggufswarm gateway: repaired a
    route: node URL (layers a:b) failed (CAUSE); continued on URL, ... (N tokens restored, M replayed)``."""
    for r in repairs:
        if r.get("replacement") and "error" not in r:
            lo, hi = r["replaced_layers"]
            replanned = "" if [lo, hi] == r["layers"] else f"; layers {lo}:{hi} re-planned"
            print(
                f"ggufswarm gateway: repaired a route: node {r['hop']} (layers {r['layers'][0]}:{r['layers'][1]}) "
                f"failed ({r['cause']}); continued on {', '.join(r['replacement'])}{replanned} "
                f"({r['restored_tokens']} tokens restored, {r['tokens_replayed']} replayed)",
                file=sys.stderr,
                flush=True,
            )
