"""Hidden-state frames: a 48-byte little-endian header plus a raw ``[n_tokens, n_embd]`` tensor (or token ids),
and an optional int32 token-id trailer.

The header: magic ``GSWF``, version, dtype, flags, ``scale_exp``, session id, step, start, ``n_tokens``, ``n_embd``,
reserved. docs/protocol.md, "Frames", is the normative layout."""

from __future__ import annotations

import math
import struct
import uuid
import zlib
from dataclasses import dataclass

import numpy as np

from .errors import ProtocolError

MAGIC = b"GSWF"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<4sBBBb16sQIIII")
HEADER_SIZE = HEADER.size  # 48


@dataclass(frozen=True)
class WireDtype:
    """How one wire dtype travels: ``code`` (the header's dtype byte), ``numpy`` (the little-endian numpy dtype
    of the payload's values; bf16 travels as its raw 16 bits, ``<u2``), ``cast_name`` / ``cast`` (the numpy dtype
    float32 hidden states are rounded to before encoding — round to nearest even; bf16 through ``ml_dtypes``,
    imported when first used, docs/memory.md; None for ids, which are sent as given),
    ``itemsize`` (bytes per value)."""

    code: int
    numpy: str
    cast_name: str | None

    @property
    def cast(self) -> type | None:
        if self.cast_name == "bfloat16":
            import ml_dtypes

            return ml_dtypes.bfloat16
        return None if self.cast_name is None else np.dtype(self.cast_name).type

    @property
    def itemsize(self) -> int:
        return np.dtype(self.numpy).itemsize


# The one table of wire dtypes; every other mapping (codes, names, sizes, the hidden-state dtypes) derives from it.
DTYPES = {
    "ids": WireDtype(1, "<i4", None),
    "f16": WireDtype(2, "<f2", "float16"),
    "bf16": WireDtype(3, "<u2", "bfloat16"),
    "f32": WireDtype(4, "<f4", "float32"),
}
DTYPE_CODES = {name: d.code for name, d in DTYPES.items()}
DTYPE_NAMES = {d.code: name for name, d in DTYPES.items()}
ITEMSIZE = {name: d.itemsize for name, d in DTYPES.items()}
WIRE_DTYPES = tuple(name for name, d in DTYPES.items() if d.cast_name is not None)  # hidden states: f16, bf16, f32
FLAG_TOKEN_IDS = 1
FLAG_NO_SAMPLE = 2
FLAG_VERIFY = 4  # speculative decoding: the head samples at every position and replies ``tokens`` (one per token)
FLAG_REWIND = 8  # the step may start inside the session's previous step: nodes first drop the tokens from ``start``
# a quiet step (ring decode): nodes on a link answer it only with an error; each keeps its numbers for the client
# (docs/protocol.md, "Quiet steps")
FLAG_QUIET = 16
FLAGS_BYTE = 6  # the flags' offset in the header
F16_MAX = 65504.0


class FrameError(ProtocolError):
    """A frame that cannot be accepted; ``code`` says why (bad_frame, bad_dtype, bad_shape, ...)."""


@dataclass
class Frame:
    """A decoded frame (numpy). ``data``: int64 ids ``[T]`` (dtype "ids") or float32 hidden states ``[T, n_embd]``.

    ``token_ids``: int64 ``[T]`` from the trailer (the route's input ids, for the head's sampler), or None.
    ``dtype`` is the wire dtype it travelled in (the data is always widened to float32 on decode).
    """

    session_id: uuid.UUID
    step: int
    start: int
    n_tokens: int
    n_embd: int
    dtype: str
    flags: int
    data: np.ndarray
    token_ids: np.ndarray | None = None

    @property
    def sample(self) -> bool:
        """False when the sender asked the head not to sample (an intermediate prefill chunk)."""
        return not self.flags & FLAG_NO_SAMPLE

    @property
    def verify(self) -> bool:
        """True when the head is to sample at every position (a speculative verify step, FLAG_VERIFY)."""
        return bool(self.flags & FLAG_VERIFY) and not self.flags & FLAG_NO_SAMPLE

    @property
    def quiet(self) -> bool:
        """True for a quiet step (FLAG_QUIET): on a link, nodes answer it only when it fails."""
        return bool(self.flags & FLAG_QUIET)

    @property
    def rewind(self) -> bool:
        """True when the step may start before the session's end, inside its previous step (FLAG_REWIND)."""
        return bool(self.flags & FLAG_REWIND)


def frame_digest(body: bytes) -> int:
    """CRC-32 of a frame's bytes with FLAG_QUIET cleared: a quiet step and the same step sent again with replies (a
    client that lost the quiet one's answer) are one step to a node's retry check."""
    if len(body) <= FLAGS_BYTE or not body[FLAGS_BYTE] & FLAG_QUIET:
        return zlib.crc32(body)
    view = memoryview(body)
    crc = zlib.crc32(view[:FLAGS_BYTE])
    crc = zlib.crc32(bytes((body[FLAGS_BYTE] & ~FLAG_QUIET,)), crc)
    return zlib.crc32(view[FLAGS_BYTE + 1 :], crc)


def is_quiet(body: bytes) -> bool:
    """Whether a frame's bytes carry FLAG_QUIET (read from the header, nothing decoded)."""
    return len(body) > FLAGS_BYTE and bool(body[FLAGS_BYTE] & FLAG_QUIET)


def frame_size(n_tokens: int, n_embd: int, dtype: str, token_ids: bool = False) -> int:
    """Bytes of a frame with this shape (header + payload + optional id trailer)."""
    return HEADER_SIZE + _payload_size(n_tokens, n_embd, dtype) + (ITEMSIZE["ids"] * n_tokens if token_ids else 0)


def _payload_size(n_tokens: int, n_embd: int, dtype: str) -> int:
    """Bytes of a frame's tensor: ``n_tokens`` ids, or ``[n_tokens, n_embd]`` values, in ``dtype``."""
    return n_tokens * ITEMSIZE[dtype] * (1 if dtype == "ids" else n_embd)


TIMEOUT_TOKENS = 512  # a hop's timeout covers a frame of up to this many tokens; larger frames get proportionally more


def step_timeout_s(timeout_s: float, n_tokens: int) -> float:
    """Seconds to wait for the reply to a frame of ``n_tokens`` tokens when ``timeout_s`` is the wait for a decode
    step: ``timeout_s x max(1, n_tokens / 512)``. A prefill chunk's compute grows with its size (about
    linearly), so a fixed timeout either fails long prompts (504) or waits too long
    for a dead hop during decode."""
    return timeout_s * max(1.0, n_tokens / TIMEOUT_TOKENS)


def _header(
    session_id: uuid.UUID, step: int, start: int, n_tokens: int, n_embd: int, dtype: str, flags: int, scale_exp: int = 0
) -> bytes:
    return HEADER.pack(
        MAGIC,
        PROTOCOL_VERSION,
        DTYPE_CODES[dtype],
        flags,
        scale_exp,
        session_id.bytes,
        step,
        start,
        n_tokens,
        n_embd,
        0,
    )


def encode_tokens(
    session_id: uuid.UUID,
    step: int,
    start: int,
    token_ids: list[int],
    sample: bool = True,
    verify: bool = False,
    rewind: bool = False,
    quiet: bool = False,
) -> bytes:
    """A frame carrying token ids (for the first shard). ``start``: position of the first id. ``verify``: the head
    samples at every position (FLAG_VERIFY); ``rewind``: nodes holding more than ``start`` tokens drop the rest of
    the previous step first (FLAG_REWIND); ``quiet``: a quiet step (FLAG_QUIET, ring decode)."""
    ids = np.asarray(token_ids, dtype=DTYPES["ids"].numpy)
    flags = (0 if sample else FLAG_NO_SAMPLE) | (FLAG_VERIFY if verify else 0) | (FLAG_REWIND if rewind else 0)
    flags |= FLAG_QUIET if quiet else 0
    return _header(session_id, step, start, len(ids), 0, "ids", flags) + ids.tobytes()


def _float32(x) -> np.ndarray:
    """``x`` ``[T, n_embd]`` as a float32 numpy array: a numpy array as it is, a CPU torch tensor (the torch backend's
    output, any float dtype: widening to float32 is exact) through ``.numpy()``, without importing torch here."""
    if isinstance(x, np.ndarray):
        return x if x.dtype == np.float32 else x.astype(np.float32)
    return x.detach().float().numpy()


def _int_ids(ids) -> np.ndarray:
    return np.asarray(ids if isinstance(ids, (np.ndarray, list, tuple)) else ids.numpy(), dtype=DTYPES["ids"].numpy)


def encode_hidden(
    session_id: uuid.UUID, step: int, start: int, hidden, dtype: str = "f16", token_ids=None, flags: int = 0
) -> bytes:
    """A frame carrying hidden states ``[T, n_embd]`` (numpy array or CPU torch tensor, any float dtype) in wire
    ``dtype`` (f16 / bf16 / f32), rounded to nearest even.

    f16 never overflows silently: when ``max|hidden|`` exceeds the f16 range the values are sent
    divided by a power of two and ``scale_exp`` says by which (exact; Gemma's residual stream
    reaches ~1e5). ``token_ids`` (ints ``[T]``) are appended as a trailer when given.
    Raises FrameError("non_finite") when ``hidden`` already holds NaN/inf.
    """
    if dtype not in WIRE_DTYPES:
        raise FrameError("bad_dtype", f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {dtype!r}")
    wire = DTYPES[dtype]
    arr = _float32(hidden)
    n_tokens, n_embd = arr.shape
    peak = float(np.abs(arr).max())
    if not math.isfinite(peak):
        raise FrameError(
            "non_finite", f"step {step}: hidden states hold NaN/inf before encoding; refusing to send", status=500
        )
    scale_exp = 0
    if dtype == "f16" and peak > F16_MAX * (1 - 2**-12):
        scale_exp = math.ceil(math.log2(peak / (F16_MAX * (1 - 2**-12))))
        arr = arr * np.float32(2.0**-scale_exp)  # a power of two: exact
    payload = arr.astype(wire.cast, copy=False).view(wire.numpy).tobytes()
    if token_ids is not None:
        flags |= FLAG_TOKEN_IDS
        payload += _int_ids(token_ids).tobytes()
    return _header(session_id, step, start, n_tokens, n_embd, dtype, flags, scale_exp) + payload


def decode_frame(body: bytes, n_embd: int | None = None, max_tokens: int | None = None) -> Frame:
    """Parse and bounds-check a frame; the payload is copied out as float32 (or int64 ids).

    ``n_embd``: the width hidden frames must have; ``max_tokens``: the most tokens a step may carry.
    Raises FrameError with code bad_frame / unsupported_version / bad_dtype / bad_shape /
    too_many_tokens / non_finite. Nothing is allocated before the lengths are checked.
    """
    if body[:4] != MAGIC:
        raise FrameError("bad_frame", f"bad magic {bytes(body[:4])!r}: not a ggufswarm frame (expected {MAGIC!r})")
    if len(body) < HEADER_SIZE:
        raise FrameError("bad_frame", f"frame is {len(body)} bytes; the header alone is {HEADER_SIZE}")
    magic, version, code, flags, scale_exp, sid, step, start, n_tokens, width, reserved = HEADER.unpack_from(body)
    if magic != MAGIC:
        raise FrameError("bad_frame", f"bad magic {magic!r}: not a ggufswarm frame (expected {MAGIC!r})")
    if version != PROTOCOL_VERSION:
        raise FrameError("unsupported_version", f"frame version {version}; this node speaks {PROTOCOL_VERSION}")
    if reserved != 0:
        raise FrameError("bad_frame", f"reserved header field is {reserved}; it must be 0 in version {version}")
    dtype = DTYPE_NAMES.get(code)
    if dtype is None:
        raise FrameError("bad_dtype", f"unknown dtype code {code} (known: {DTYPE_CODES})")
    if n_tokens == 0:
        raise FrameError("bad_shape", "a frame needs at least one token (n_tokens = 0)")
    if max_tokens is not None and n_tokens > max_tokens:
        raise FrameError("too_many_tokens", f"n_tokens {n_tokens} exceeds this node's max_step_tokens {max_tokens}")
    if dtype == "ids":
        if width != 0:
            raise FrameError("bad_shape", f"a token-id frame must have n_embd 0, got {width}")
    elif n_embd is not None and width != n_embd:
        raise FrameError("bad_shape", f"hidden frame is [{n_tokens}, {width}]; this node takes n_embd {n_embd}")
    elif width == 0:
        raise FrameError("bad_shape", "a hidden-state frame needs n_embd > 0")
    has_ids = bool(flags & FLAG_TOKEN_IDS) and dtype != "ids"
    end = HEADER_SIZE + _payload_size(n_tokens, width, dtype)  # where the id trailer starts
    expected = end + (ITEMSIZE["ids"] * n_tokens if has_ids else 0)  # frame_size, computed once
    if len(body) != expected:
        raise FrameError(
            "bad_frame",
            f"frame is {len(body)} bytes; header says [{n_tokens}, {width}] {dtype}"
            f"{' + ids' if has_ids else ''} = {expected} bytes",
        )
    count = n_tokens if dtype == "ids" else n_tokens * width
    raw = np.frombuffer(body, dtype=DTYPES[dtype].numpy, count=count, offset=HEADER_SIZE)
    if dtype == "ids":
        data = raw.astype(np.int64)
    else:
        if dtype == "bf16":  # its raw bits are a float32's upper half
            arr = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            arr = raw.astype(np.float32)
            if dtype == "f16" and scale_exp:  # f16 range extension
                with np.errstate(over="ignore"):  # overflow gives inf, refused as non_finite below
                    arr *= np.float32(2.0**scale_exp)
        if not np.isfinite(arr).all():
            raise FrameError("non_finite", f"step {step}: frame holds NaN/inf values")
        data = arr.reshape(n_tokens, width)
    ids = None
    if has_ids:
        ids = np.frombuffer(body, dtype=DTYPES["ids"].numpy, count=n_tokens, offset=end).astype(np.int64)
    return Frame(uuid.UUID(bytes=sid), step, start, n_tokens, width, dtype, flags, data, ids)
