"""Ring decode, the head's side: after it samples a step's token, the head sends the session's next step (that token,
one position on) to the route's first node itself, as long as the client's grant allows; the client only reads.

A client that wants the ring sends **grants** on its reply link (a text message, docs/protocol.md "Ring decode"):
``{"ring": {"until": STEP, "first": URL or null, "quiet": BOOL, "ack": BOOL}}``: the head may send the session's steps
up to number ``until`` to ``first`` (null: itself, a route of one node); with ``quiet`` as quiet steps (FLAG_QUIET)
but every ``MEASURED_EVERY``-th; with ``ack`` it answers ``{"ring": {"sent": STEP}}``, the last step it sent itself
(a revoke, ``until`` 0, learns so where the head stopped). The frame the head sends is byte-identical to the one the
client would have sent (protocol.encode_tokens), so every node's numbering, retry and repair rules hold as they are.
Each such step's reply goes to the client on the reply link twice: the head's own, as soon as it sampled and sent
the step after it, then the route's (its per-hop numbers, or the error that stopped it).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..protocol import ProtocolError, encode_tokens
from ..protocol.frame import Frame
from ..runtime.session_state import Session, StepRecord
from .sessions_api import MAX_STEP, node_url
from .step_path import StepPath

MAX_GRANT_CHARS = 4096  # longest grant message taken
# every so many ring steps one goes with replies back along the route, which time each hop from outside
# (StepTiming.outer_ms: what a node's measured speed is; gateway/planner.py NodeTimings), the others quietly
MEASURED_EVERY = 16


@dataclass
class Grant:
    """A client's grant for one session: the head may send its steps up to number ``until`` to ``first`` (a node URL;
    None: to itself); ``quiet``: as quiet steps (but every ``MEASURED_EVERY``-th); ``ack``: the client waits for
    ``ack_text``."""

    until: int
    first: str | None
    quiet: bool = False
    ack: bool = False


def ack_text(session: Session | None) -> str:
    """The head's answer to a grant with ``ack``: ``{"ring": {"sent": STEP}}``, the last step number it sent itself
    for ``session`` (0: none, or the session is gone)."""
    return json.dumps({"ring": {"sent": 0 if session is None else session.ring_sent}})


async def parse_grant(path: StepPath, text: str) -> Grant:
    """The Grant in a reply link's text message ``text``; ProtocolError bad_request for a malformed one,
    next_hop_unknown (403) for a ``first`` the swarm's tracker or DHT does not list (the check a next_hop gets)."""
    try:
        ring = json.loads(text)["ring"] if len(text) <= MAX_GRANT_CHARS else None
        until, first, quiet, ack = ring["until"], ring["first"], ring.get("quiet", False), ring.get("ack", False)
    except (ValueError, TypeError, KeyError, AttributeError):
        until = first = quiet = ack = None
    if (
        type(until) is not int
        or not 0 <= until <= MAX_STEP
        or (first is not None and not isinstance(first, str))
        or not isinstance(quiet, bool)
        or not isinstance(ack, bool)
    ):
        raise ProtocolError(
            "bad_request",
            'a reply link takes grants only: {"ring": {"until": STEP, "first": "http://HOST:PORT" or null, '
            '"quiet": true or false, "ack": true or false}}',
        )
    if first is not None:
        first = node_url(first, "the ring's first node")
        await path.check_hop(first, "the ring's first node")
    elif not path.spec.embed:
        raise ProtocolError(
            "bad_request", 'a ring "first": null (loop on this node) needs a node that embeds: a route of one node'
        )
    return Grant(until, first, quiet, ack)


def next_frame(path: StepPath, session: Session, frame: Frame, record: StepRecord) -> tuple[bytes, str | None] | None:
    """The session's next step when the head sends it itself: (its frame, the grant's first node: None for this one).
    The frame holds the token just sampled (``record.token``) at the position after ``frame``'s, numbered
    ``frame.step + 1``, a sampling step with no other flag but FLAG_QUIET: under a quiet grant, to a first node whose
    link is open, in a session without ``commit``, but every MEASURED_EVERY-th step. None when the session has no
    grant up to that step, no reply link, the step sampled nothing or was a verify step, or the next step would not
    fit its max_length. A frame returned is the head's to send: its number is kept as ``session.ring_sent``."""
    grant = path.rings.get(session.id)
    ws = path.reply_links.get(session.id)
    start = frame.start + frame.n_tokens
    if (
        grant is None
        or ws is None
        or ws.closed
        or frame.step + 1 > grant.until
        or not frame.sample
        or frame.verify
        or record.token is None
        or start + 1 > session.max_length
    ):
        return None
    quiet = (
        grant.quiet
        and grant.first is not None
        and not session.commit
        and (frame.step + 1) % MEASURED_EVERY != 0
        and path.links.linked(grant.first)
    )
    session.ring_sent = frame.step + 1  # (a grant with ack answers it)
    return encode_tokens(session.id, frame.step + 1, start, [int(record.token)], quiet=quiet), grant.first


def drop(path: StepPath, sid: uuid.UUID) -> None:
    """Forget session ``sid``'s grant (its reply link closed)."""
    path.rings.pop(sid, None)


__all__ = ["Grant", "ack_text", "drop", "next_frame", "parse_grant"]
