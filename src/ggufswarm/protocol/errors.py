"""Machine-readable error codes of the node and gateway protocol, their HTTP statuses, and the JSON body."""

from __future__ import annotations

import json

# code -> HTTP status (docs/protocol.md, "Errors")
ERROR_STATUS = {
    "unauthorized": 401,  # no or wrong swarm token (X-Ggufswarm-Token)
    "next_hop_unknown": 403,  # next_hop is not a node the tracker lists for this model
    "bad_request": 400,  # JSON body missing / malformed / wrong field types
    "bad_frame": 400,  # frame too short, bad magic, lengths that do not add up
    "unsupported_version": 400,  # frame protocol version this node does not speak
    "bad_dtype": 400,  # unknown dtype code, or a dtype this shard does not take (ids vs hidden)
    "bad_shape": 400,  # n_embd differs from the width the node takes, or n_tokens == 0
    "bad_token": 400,  # token id outside the vocabulary
    "non_finite": 400,  # a frame carries NaN/inf
    "context_overflow": 400,  # the step would pass the session's max_length
    "not_found": 404,  # no endpoint at this path
    "method_not_allowed": 405,  # the path exists, not with this HTTP method
    "unknown_session": 404,  # no such session on this node (never opened, closed or expired)
    "session_closed": 404,  # a step for a session its client closed on this node (a late frame of its closing)
    "session_exists": 409,  # open with an id already in use
    "model_mismatch": 409,  # open for another model (fingerprint) than the one this node serves
    "session_not_empty": 409,  # restore into a session that already holds tokens
    "step_conflict": 409,  # same step number, different content
    "stale_step": 409,  # step number below the last one applied
    "step_gap": 409,  # step number skips ahead
    "position_mismatch": 409,  # frame start position != tokens the session holds
    "state_not_at_position": 409,  # truncate of a recurrent (hybrid) shard to a position it holds no state snapshot of
    "too_many_tokens": 413,  # n_tokens above the node's max_step_tokens
    "body_too_large": 413,  # a JSON request body over the server's limit
    "kv_budget_full": 429,  # the node's KV budget is taken by other sessions: retry later
    "kv_budget_too_small": 503,  # this session's max_length alone exceeds the node's whole budget
    "bad_snapshot": 400,  # cache: an upload that is not a snapshot blob, or shorter than one block
    "unknown_snapshot": 404,  # cache: no snapshot under that key (never stored, or evicted)
    "snapshot_exists": 409,  # cache: other bytes are already stored under that key (the first upload stays)
    "snapshot_corrupt": 410,  # cache: the stored bytes failed their SHA-256 check; deleted
    "snapshot_too_large": 413,  # cache: upload over the server's limit
    "internal": 500,  # a bug; the message says what
    "client_gone": 499,  # the client closed the connection before its request body arrived: nobody reads the answer
    "hop_failed": 502,  # the next hop answered with an error or dropped the connection
    "hop_timeout": 504,  # the next hop did not answer within the hop timeout
    "tracker_unavailable": 503,  # the tracker could not be asked (e.g. to check a next_hop)
    "not_ready": 503,  # the node does not know its public address yet (GET /v1/advertisement)
    "no_manifest": 404,  # a node serving a local GGUF has no swarm manifest to hand out (GET /v1/manifest)
    "rate_limited": 429,  # dial-backs: too many from one address
    "relay_full": 503,  # a relay with no room for another attached node
    "bad_signature": 401,  # a signed record (advertisement, hello, ban) whose ed25519 signature does not verify
    "banned": 403,  # a node key the swarm banned (a confirmed liar): its advertisements and hellos are refused
    # the tracker's own (docs/protocol.md, "Tracker API")
    "bad_json": 400,  # tracker: a request body that is not a JSON object (or too deep, or undecodable)
    "bad_advertisement": 400,  # tracker: a heartbeat with missing or out-of-range fields
    "bad_manifest": 400,  # tracker: a manifest or .torrent that does not parse
    "unknown_node": 404,  # tracker: no node registered under that id / advertising that URL
    "unknown_model": 404,  # tracker: no model published under that name
    "no_route": 503,  # tracker: the published nodes do not cover the layers (or lack KV room)
    "bad_evidence": 400,  # tracker: a ban whose evidence does not prove the key lied (the message says what is missing)
    "too_many_bans": 507,  # tracker: it keeps as many bans as it will
    "operator_only": 403,  # tracker: lifting a ban or removing another node needs the operator's credential
    "not_banned": 404,  # tracker: lifting a ban of a key that is not banned
    "too_many_nodes": 429,  # tracker: a new node key past its bounds (per address, in all)
    "stale_advertisement": 409,  # tracker: an advertisement or deregistration signed before the newest one taken
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


class RouteError(ProtocolError):
    """A node of a route failed or refused, as its caller sees it (a client, or a node pushing to its next hop):
    ``hop`` names that node (the message does too), ``status`` is passed on. ``late``: it came back along the route
    for an earlier step the head had already answered (the route is broken; the step now waiting was not lost on
    its own connection, so it is not resent as is); ``next_hop``: at an open, the URL of the node ``hop`` was asked
    to pass steps on to (``next_hop_unknown`` refuses that one, not ``hop``)."""

    def __init__(self, code: str, message: str, status: int | None = None, hop: str | None = None):
        super().__init__(code, message, status, hop)
        self.late = False
        self.next_hop: str | None = None


def error_body(code: str, message: str, hop: str | None = None) -> bytes:
    """``{"error": {"code": code, "message": message}}`` as UTF-8 JSON bytes; ``hop``: the failed node's URL."""
    err = {"code": code, "message": message}
    if hop:
        err["hop"] = hop
    return json.dumps({"error": err}).encode()
