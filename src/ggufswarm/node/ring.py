"""Ring decode, the head's side: after it samples a step's token, the head sends the session's next step (that token,
one position on) to the route's first node itself, as long as the client's grant allows; the client only reads.

A client that wants the ring sends **grants** on its reply link (a text message, docs/protocol.md "Ring decode"):
``{"ring": {"until": STEP, "first": URL or null}}``: the head may send the session's steps up to number ``until``
to ``first`` (null: the head is the route's first node too, a route of one node loops on itself). The frame the
head sends is byte-identical to the one the client would have sent (protocol.encode_tokens), so every node's
numbering, retry and repair rules hold as they are: a client that sends the same step itself (it lost its reply
link) gets the recorded answer. Each such step's reply goes to the client on the reply link twice: the head's own,
as soon as it sampled and sent the step after it, then the route's (its per-hop numbers, or the error that stopped it).
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


@dataclass
class Grant:
    """A client's grant for one session: the head may send its steps up to number ``until`` to ``first`` (a node URL;
    None: to itself)."""

    until: int
    first: str | None


async def parse_grant(path: StepPath, text: str) -> Grant:
    """The Grant in a reply link's text message ``text``; ProtocolError bad_request for a malformed one,
    next_hop_unknown (403) for a ``first`` the swarm's tracker or DHT does not list (the check a next_hop gets)."""
    try:
        ring = json.loads(text)["ring"] if len(text) <= MAX_GRANT_CHARS else None
        until, first = ring["until"], ring["first"]
    except (ValueError, TypeError, KeyError):
        until = first = None
    if type(until) is not int or not 0 <= until <= MAX_STEP or (first is not None and not isinstance(first, str)):
        raise ProtocolError(
            "bad_request",
            'a reply link takes grants only: {"ring": {"until": STEP, "first": "http://HOST:PORT" or null}}',
        )
    if first is not None:
        first = node_url(first, "the ring's first node")
        await path.check_hop(first, "the ring's first node")
    elif not path.spec.embed:
        raise ProtocolError(
            "bad_request", 'a ring "first": null (loop on this node) needs a node that embeds: a route of one node'
        )
    return Grant(until, first)


def next_frame(path: StepPath, session: Session, frame: Frame, record: StepRecord) -> tuple[bytes, str | None] | None:
    """The session's next step when the head sends it itself: (its frame, the grant's first node: None for this one).
    The frame holds the token just sampled (``record.token``) at the position after ``frame``'s, numbered
    ``frame.step + 1``, a sampling step with no other flag. None when the session has no grant up to that step, no
    reply link, the step sampled nothing or was a verify step, or the next step would not fit its max_length."""
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
    return encode_tokens(session.id, frame.step + 1, start, [int(record.token)]), grant.first


def drop(path: StepPath, sid: uuid.UUID) -> None:
    """Forget session ``sid``'s grant (its reply link closed)."""
    path.rings.pop(sid, None)


__all__ = ["Grant", "drop", "next_frame", "parse_grant"]
