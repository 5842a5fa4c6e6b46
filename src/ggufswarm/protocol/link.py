"""Link reply codec: the binary message a node answers a step frame with on a WebSocket link (docs/protocol.md,
"Links"), encoded by the node that answers and decoded by the node or client that sent the frame.

Layout: the frame's 24-byte key (bytes 8..32 of its header: session id, 16 bytes, and step number, uint64), a
little-endian uint16 HTTP status, then the JSON body ``POST /v1/step`` would have answered.
"""

from __future__ import annotations

import uuid

KEY = slice(8, 32)  # session id (16 bytes) + step (uint64) in the frame header
KEY_SIZE = 24
REPLY_HEAD = KEY_SIZE + 2  # key + uint16 status
NO_KEY = bytes(KEY_SIZE)  # the key of a reply to a message too short to carry one


def frame_key(frame: bytes) -> bytes:
    """The 24-byte key of a frame (session id + step), or NO_KEY when it is shorter than a header."""
    key = frame[KEY]
    return key if len(key) == KEY_SIZE else NO_KEY


def step_key(session_id: uuid.UUID, step: int) -> bytes:
    """The key ``frame_key`` gives every frame of step ``step`` of session ``session_id``."""
    return session_id.bytes + step.to_bytes(8, "little")


def encode_reply(frame: bytes, status: int, body: bytes) -> bytes:
    """The reply message to ``frame``: its key, ``status`` (uint16 little-endian), ``body`` (JSON bytes)."""
    return frame_key(frame) + status.to_bytes(2, "little") + body


def decode_reply(message: bytes) -> tuple[bytes, int, bytes] | None:
    """``(key, status, body)`` of a reply message, or None when it is shorter than a reply head."""
    if len(message) < REPLY_HEAD:
        return None
    return (
        bytes(message[:KEY_SIZE]),
        int.from_bytes(message[KEY_SIZE:REPLY_HEAD], "little"),
        bytes(message[REPLY_HEAD:]),
    )
