"""Wire protocol between gateway and nodes: hidden-state frames and JSON errors (spec: docs/protocol.md)."""

from .errors import ERROR_STATUS, ProtocolError, error_body
from .frame import (DTYPE_CODES, DTYPE_NAMES, DTYPES, FLAG_NO_SAMPLE, FLAG_TOKEN_IDS, HEADER, HEADER_SIZE, ITEMSIZE,
                    MAGIC, PROTOCOL_VERSION, WIRE_DTYPES, Frame, FrameError, WireDtype, decode_frame, encode_hidden,
                    encode_tokens, frame_size, step_timeout_s)

__all__ = ["DTYPES", "DTYPE_CODES", "DTYPE_NAMES", "ERROR_STATUS", "FLAG_NO_SAMPLE", "FLAG_TOKEN_IDS", "HEADER",
           "HEADER_SIZE", "ITEMSIZE", "MAGIC", "PROTOCOL_VERSION", "WIRE_DTYPES", "Frame", "FrameError",
           "ProtocolError", "WireDtype", "decode_frame", "encode_hidden", "encode_tokens", "error_body", "frame_size",
           "step_timeout_s"]
