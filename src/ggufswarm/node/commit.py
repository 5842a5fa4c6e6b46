"""Step commitments, the node's side: for a session opened with ``"commit": true`` each node signs, per step,
digests of what it took in and gave out, the session's context and the history its KV cache was computed from, so
that a client can check its work later and prove what it claimed to anyone. The format is net/commitments.py's;
the fields, what is hashed and what it costs: docs/protocol.md, "Step commitments"."""

from __future__ import annotations

from ..net.commitments import MODE_FLAGS, chain_next, history_at, signed_body
from ..net.identity import NodeIdentity, canonical
from ..protocol.frame import HEADER_SIZE, ITEMSIZE, Frame
from ..runtime.digest import digest


def payload(body: bytes, n_tokens: int, n_embd: int, dtype: str) -> memoryview:
    """The payload of frame ``body`` holding ``n_tokens`` rows of ``n_embd`` values in wire ``dtype`` (or ``n_tokens``
    ids, dtype ``ids``): the values exactly as they travel, without header or token-id trailer — a view, not a
    copy."""
    width = 1 if dtype == "ids" else n_embd
    return memoryview(body)[HEADER_SIZE : HEADER_SIZE + n_tokens * width * ITEMSIZE[dtype]]


def step_commit(
    identity: NodeIdentity, frame: Frame, in_digest: str, out_digest: str, chain: list[tuple[int, str]], ctx: str
) -> dict:
    """This node's signed commitment to step ``frame`` (its session, step, start, n_tokens and sampling flags):
    ``{"in", "out", "mode", "ctx", "prev", "key", "sig"}`` with the given IN and OUT digests and context digest
    ``ctx``. ``chain``: the session's history digests by KV position, ascending (``[(0, ctx)]`` at open): ``prev``
    is the history at the step's start (``history_at``), and the step's own is appended at its end, after dropping
    those past its start (a rollback's)."""
    mode = frame.flags & MODE_FLAGS
    prev = history_at(chain, frame.start)
    while chain and chain[-1][0] > frame.start:
        chain.pop()
    if prev:
        chain.append((frame.start + frame.n_tokens, chain_next(prev, frame.start, frame.n_tokens, mode, in_digest)))
    commit = {"in": in_digest, "out": out_digest, "mode": mode, "ctx": ctx, "prev": prev, "key": identity.key_id}
    body = signed_body(frame.session_id, frame.step, frame.start, frame.n_tokens, commit)
    return {**commit, "sig": identity.sign(canonical(body))}


def input_digest(body: bytes, frame: Frame) -> str:
    """IN of a step commitment: the digest of the payload of ``body`` (the frame decoded as ``frame``), hashed in
    place."""
    return digest(payload(body, frame.n_tokens, frame.n_embd, frame.dtype))


def output_digest(out: bytes, frame: Frame, n_embd: int, dtype: str) -> str:
    """OUT of a non-head node's step commitment: the digest of the payload of ``out``, the frame it pushed for step
    ``frame`` (``frame.n_tokens`` rows of ``n_embd`` values in wire ``dtype``)."""
    return digest(payload(out, frame.n_tokens, n_embd, dtype))


__all__ = ["input_digest", "output_digest", "payload", "step_commit"]
