"""Digests of what a step takes in and gives out, for step commitments (docs/protocol.md, "Step commitments").

Every digest is SHA-256 truncated to its first 16 bytes (``hashlib.sha256(data).hexdigest()[:32]``), written as
32 lowercase hex characters. Why SHA-256 and what it costs: docs/protocol.md, "Step commitments" ("Why SHA-256")."""

from __future__ import annotations

import hashlib

import numpy as np

DIGEST_BYTES = 16


def digest(data) -> str:
    """SHA-256/128 of ``data`` (bytes or any C-contiguous buffer: a memoryview slice of a frame is hashed in place,
    not copied): the first 32 hex characters of its SHA-256."""
    return hashlib.sha256(data).hexdigest()[: 2 * DIGEST_BYTES]


def logits_digest(rows, tokens: list[int]) -> str:
    """A head's OUT digest: SHA-256/128 of the float32 little-endian bytes of ``rows`` (logits ``[R, n_vocab]``
    as the backend returned them, row-major: a numpy array or a CPU torch tensor of any float dtype, widened to
    float32) followed by ``tokens`` (the ids drawn, as int32 little-endian; empty when the step drew none)."""
    if not isinstance(rows, np.ndarray):  # a torch tensor (the torch backend's head), without importing torch here
        rows = rows.detach().float().numpy()
    h = hashlib.sha256(np.ascontiguousarray(rows, dtype="<f4"))  # hashlib frees the GIL
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return h.hexdigest()[: 2 * DIGEST_BYTES]


__all__ = ["DIGEST_BYTES", "digest", "logits_digest"]
