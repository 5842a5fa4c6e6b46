"""Machine-readable error codes of the node and gateway protocol, their HTTP statuses, and the JSON body."""

from __future__ import annotations

import json

# code -> HTTP status (docs/protocol.md, "Errors")
ERROR_STATUS = {
    "unauthorized": 401,        # no or wrong swarm token (X-Ggufswarm-Token)
    "next_hop_unknown": 403,    # next_hop is not a node the tracker lists for this model
    "bad_request": 400,         # JSON body missing / malformed / wrong field types
    "bad_frame": 400,           # frame too short, bad magic, lengths that do not add up
    "unsupported_version": 400, # frame protocol version this node does not speak
    "bad_dtype": 400,           # unknown dtype code, or a dtype this shard does not take (ids vs hidden)
    "bad_shape": 400,           # n_embd differs from the model's, or n_tokens == 0
    "bad_token": 400,           # token id outside the vocabulary
    "non_finite": 400,          # a frame carries NaN/inf
    "context_overflow": 400,    # the step would pass the session's max_length
    "not_found": 404,           # no endpoint at this path
    "method_not_allowed": 405,  # the path exists, not with this HTTP method
    "unknown_session": 404,     # no such session on this node (never opened, closed or expired)
    "session_exists": 409,      # open with an id already in use
    "model_mismatch": 409,      # open for another model (fingerprint) than the one this node serves
    "session_not_empty": 409,   # restore into a session that already holds tokens
    "step_conflict": 409,       # same step number, different content
    "stale_step": 409,          # step number below the last one applied
    "step_gap": 409,            # step number skips ahead
    "position_mismatch": 409,   # frame start position != tokens the session holds
    "too_many_tokens": 413,     # n_tokens above the node's max_step_tokens
    "body_too_large": 413,      # a JSON request body over the server's limit
    "kv_budget_full": 429,      # the node's KV budget is taken by other sessions: retry later
    "kv_budget_too_small": 503, # this session's max_length alone exceeds the node's whole budget
    "bad_snapshot": 400,        # cache: an upload that is not a snapshot blob, or shorter than one block
    "unknown_snapshot": 404,    # cache: no snapshot under that key (never stored, or evicted)
    "snapshot_exists": 409,     # cache: other bytes are already stored under that key (the first upload stays)
    "snapshot_corrupt": 410,    # cache: the stored bytes failed their SHA-256 check; deleted
    "snapshot_too_large": 413,  # cache: upload over the server's limit
    "internal": 500,            # a bug; the message says what
    "hop_failed": 502,          # the next hop answered with an error or dropped the connection
    "hop_timeout": 504,         # the next hop did not answer within the hop timeout
    "tracker_unavailable": 503, # the tracker could not be asked (e.g. to check a next_hop)
}


class ProtocolError(Exception):
    """An error with a machine-readable ``code`` (a key of ERROR_STATUS) and an HTTP ``status``."""

    def __init__(self, code: str, message: str, status: int | None = None, hop: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status or ERROR_STATUS.get(code, 500)
        self.hop = hop  # URL of the node that failed, when the error is about a node further down the route

    def body(self) -> bytes:
        """The JSON error body ``{"error": {"code", "message"[, "hop"]}}`` (UTF-8)."""
        return error_body(self.code, self.message, self.hop)


def error_body(code: str, message: str, hop: str | None = None) -> bytes:
    """``{"error": {"code": code, "message": message}}`` as UTF-8 JSON bytes; ``hop``: the failed node's URL."""
    err = {"code": code, "message": message}
    if hop:
        err["hop"] = hop
    return json.dumps({"error": err}).encode()


def json_errors_middleware():
    """aiohttp middleware: the router's own 404 / 405 (no such path, wrong method) answered as JSON
    errors ``not_found`` / ``method_not_allowed`` like every other error of the protocol."""
    from aiohttp import web

    @web.middleware
    async def to_json(request, handler):
        try:
            resp = await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
            code = "not_found" if exc.status == 404 else "method_not_allowed"
            message = (f"no endpoint {request.method} {request.path}" if code == "not_found" else
                       f"{request.path} does not take {request.method} (allowed: "
                       f"{', '.join(sorted(getattr(exc, 'allowed_methods', ()) or ()))})")
            headers = {"Allow": ",".join(sorted(exc.allowed_methods))} if code == "method_not_allowed" else None
            resp = web.Response(body=error_body(code, message), status=exc.status, content_type="application/json",
                                headers=headers)
        if request.body_exists and not request.content.at_eof() and isinstance(resp, web.Response):
            # A body the endpoint never read (it takes none, or an error came first): aiohttp would discard it
            # to reuse the connection, and drop the connection without a word when it cannot (an undecodable
            # Content-Encoding). Say so instead: this answer ends the connection.
            resp.force_close()
        return resp

    return to_json


def body_error(exc: BaseException) -> "ProtocolError | None":
    """The protocol error for a request body that could not be read or parsed, or None for other errors.

    Maps aiohttp's over-limit body (413 ``body_too_large``), a body nested too deep for ``json``
    (RecursionError), an unknown charset in Content-Type (LookupError) and an undecodable
    Content-Encoding (RequestPayloadError) to one error each, so servers answer them instead of 500.
    """
    from aiohttp import web

    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return ProtocolError("body_too_large", f"request body too large: {exc.text}")
    if isinstance(exc, RecursionError):
        return ProtocolError("bad_request", f"body is not usable JSON: {exc}")
    if type(exc) is LookupError:  # codecs: only this exact type (KeyError / IndexError are bugs)
        return ProtocolError("bad_request", f"cannot decode the body: {exc}")
    if isinstance(exc, web.RequestPayloadError):
        return ProtocolError("bad_request", f"cannot read the body: {exc}")
    return None
