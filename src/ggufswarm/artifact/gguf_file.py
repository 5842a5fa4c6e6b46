"""GGUF artifact index: metadata and tensor index of one GGUF file or split set, with counted tensor reads.

The header layout is the one documented in ggml's ``docs/gguf.md``; type codes, block sizes and
dequantization come from the ``gguf`` package (``GGUFValueType``, ``GGML_QUANT_SIZES``,
``gguf.quants.dequantize``). We parse the header ourselves only because ``gguf.GGUFReader``
builds a numpy view per array element, too slow on a large vocabulary for every node start
(docs/design.md, "Measured choices").
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}


class GGUFError(ValueError):
    """A file is not a usable GGUF artifact (bad magic, truncated, inconsistent split set)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and how it is encoded.

    ``shape`` is in numpy/PyTorch order (outermost first), i.e. the reverse of GGUF's ``ne``:
    a linear weight with GGUF ``ne = [n_in, n_out]`` has ``shape == (n_out, n_in)``.
    ``offset`` is the absolute byte offset in ``path``; ``n_bytes`` the encoded size in bytes.
    """

    name: str
    path: Path
    offset: int
    n_bytes: int
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]

    @property
    def layer(self) -> int | None:
        """Block index for ``blk.N.*`` tensors, ``None`` for global tensors (embeddings, output)."""
        if self.name.startswith("blk."):
            return int(self.name.split(".", 2)[1])
        return None


PACKED_ARRAY_MIN = 4096  # arrays with more items than this are kept packed (a vocabulary), not as Python lists


class PackedArray(Sequence):
    """A long GGUF metadata array kept in its encoded form: a read-only ``Sequence`` of ``str`` or numbers.

    A vocabulary as a Python list costs one object per token (what that cost: docs/memory.md, "The parts"). Kept
    packed it is the header's bytes of the array plus two ``int64`` offsets per string. Items are decoded when
    read; a slice is a ``list``.
    ``==`` compares items with any sequence; ``tolist()`` gives the plain list.
    """

    __hash__ = None  # type: ignore[assignment]  # (a list is not hashable either)

    def __init__(self, values: np.ndarray | None = None, blob: bytes = b"", starts=None, ends=None):
        self._values = values  # numbers: [n] of the array's dtype
        self._blob, self._starts, self._ends = blob, starts, ends  # strings: utf-8 bytes [starts[i]:ends[i]]

    def __len__(self) -> int:
        return len(self._values) if self._values is not None else len(self._starts)

    def _item(self, i: int):
        if self._values is not None:
            return self._values[i].item()
        return self._blob[self._starts[i] : self._ends[i]].decode("utf-8", errors="replace")

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} items")
        return self._item(i % n)

    def __iter__(self):
        return (self._item(i) for i in range(len(self)))

    def tolist(self) -> list:
        return self._values.tolist() if self._values is not None else list(self)

    def __eq__(self, other) -> bool:
        if isinstance(other, PackedArray) and (self._values is None) == (other._values is None):
            if self._values is not None:
                return bool(np.array_equal(self._values, other._values))
            return self._blob == other._blob  # (the length-prefixed strings as the header holds them)
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"PackedArray({len(self)} items: {self[:3]}...)"


class _Cursor:
    def __init__(self, data: bytes, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise EOFError
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, vtype: GGUFValueType) -> Any:
        fmt = _SCALAR_FORMATS[vtype]
        size = struct.calcsize(fmt)
        value = struct.unpack_from(fmt, self.data, self.pos)[0] if self.pos + size <= len(self.data) else None
        if value is None:
            raise EOFError
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar(GGUFValueType.UINT64)
        return self.take(n).decode("utf-8", errors="replace")

    def packed_strings(self, count: int) -> PackedArray:
        """``count`` length-prefixed strings as one PackedArray over a copy of their bytes."""
        first, starts, ends = self.pos, np.empty(count, np.int64), np.empty(count, np.int64)
        unpack, data, pos = struct.Struct("<Q").unpack_from, self.data, self.pos
        for i in range(count):
            if pos + 8 > len(data):
                raise EOFError
            n = unpack(data, pos)[0]
            starts[i], pos = pos + 8, pos + 8 + n
            ends[i] = pos
        if pos > len(data):
            raise EOFError
        self.pos = pos
        return PackedArray(blob=bytes(data[first:pos]), starts=starts - first, ends=ends - first)

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self.scalar(GGUFValueType.UINT32))
            count = self.scalar(GGUFValueType.UINT64)
            if item_type == GGUFValueType.STRING and count > PACKED_ARRAY_MIN:
                return self.packed_strings(count)
            if item_type == GGUFValueType.STRING:
                return [self.string() for _ in range(count)]
            if item_type == GGUFValueType.ARRAY:
                return [self.value(item_type) for _ in range(count)]
            dtype = np.dtype(_SCALAR_FORMATS[item_type])
            arr = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
            return PackedArray(arr.copy()) if count > PACKED_ARRAY_MIN else arr.tolist()
        return self.scalar(vtype)


def _read_header(path: Path, check_data: bool = True) -> tuple[dict[str, Any], dict[str, tuple], list[TensorInfo], int]:
    """Parse one GGUF file's header. Returns (metadata, metadata_types, tensors, header_bytes).

    ``check_data=False`` accepts a file whose tensor data is missing or cut short (a header-only copy):
    only the header and the tensor table must be whole.

    ``metadata_types[key]`` is ``(GGUFValueType, item GGUFValueType or None)``, what a writer needs
    to write the value back unchanged.

    Raises GGUFError for a non-GGUF file or a header/tensor table that runs past the end.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(min(size, 64 << 20))
    if head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    cur = _Cursor(head, path)
    cur.pos = 4
    try:
        version = cur.scalar(GGUFValueType.UINT32)
        if version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors = cur.scalar(GGUFValueType.UINT64)
        n_kv = cur.scalar(GGUFValueType.UINT64)
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise GGUFError(f"{path}: implausible header counts (tensors={n_tensors}, kv={n_kv})")
        metadata: dict[str, Any] = {}
        types: dict[str, tuple] = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = GGUFValueType(cur.scalar(GGUFValueType.UINT32))
            item = GGUFValueType(cur.scalar(GGUFValueType.UINT32)) if vtype == GGUFValueType.ARRAY else None
            if item is not None:
                cur.pos -= 4
            metadata[key] = cur.value(vtype)
            types[key] = (vtype, item)
        raw_tensors = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar(GGUFValueType.UINT32)
            ne = [cur.scalar(GGUFValueType.UINT64) for _ in range(n_dims)]
            ggml_type = GGMLQuantizationType(cur.scalar(GGUFValueType.UINT32))
            rel_offset = cur.scalar(GGUFValueType.UINT64)
            raw_tensors.append((name, ne, ggml_type, rel_offset))
    except (EOFError, struct.error) as exc:
        raise GGUFError(f"{path}: truncated GGUF header") from exc
    except ValueError as exc:  # unknown enum value
        if isinstance(exc, GGUFError):
            raise
        raise GGUFError(f"{path}: corrupt GGUF header ({exc})") from exc
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, ne, ggml_type, rel_offset in raw_tensors:
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n_elems = int(np.prod(ne)) if ne else 1
        n_bytes = n_elems // block * type_size
        info = TensorInfo(name, path, data_start + rel_offset, n_bytes, ggml_type, tuple(reversed(ne)))
        if check_data and info.offset + info.n_bytes > size:
            raise GGUFError(
                f"{path}: truncated GGUF: tensor {name} ends at byte {info.offset + info.n_bytes}, "
                f"file has {size} bytes"
            )
        tensors.append(info)
    return metadata, types, tensors, data_start


def split_paths(path: Path) -> list[Path]:
    """All files of a ``NAME-0000K-of-0000N.gguf`` split set given any one of them (else ``[path]``).

    Raises GGUFError when a file of the set is missing.
    """
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise GGUFError(f"split set incomplete: missing {', '.join(missing)}")
    return paths


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (f16 scale ``d`` + 32 int8 ``qs``; ggml ``block_q8_0``) to float32 ``d * qs``.

    Same result as ``gguf.quants.dequantize(raw, Q8_0)`` (checked in tests), faster on a large embedding,
    which dominates load time (docs/design.md, "Measured choices"). ``raw``: uint8 ``[n_blocks * 34]``;
    returns float32 ``[n_blocks * 32]``.
    """
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return (blocks[:, 2:].view(np.int8) * d).reshape(-1)


class GGUFModelFile:
    """Metadata and tensor index of a GGUF artifact (one file or a split set); reads tensors on demand.

    Only the header and the tensors asked for are read from disk; ``bytes_read`` counts every byte
    read through this object (headers included), so partial loading can be asserted.

    ``header_only=True`` reads the header and tensor table only and accepts files whose tensor data is
    absent or truncated (planning from a header: ``artifact.accounting``, ``ggufswarm plan``); reading
    a tensor past such a file's end then raises GGUFError.

    Raises GGUFError (a ValueError) for a missing, non-GGUF, truncated or inconsistent artifact.
    """

    def __init__(self, path: str | os.PathLike, header_only: bool = False):
        self.path = Path(path)
        if self.path.is_dir():
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file")
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        self.paths = split_paths(self.path)
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, tuple] = {}  # key -> (GGUFValueType, array item type or None)
        self.tensors: dict[str, TensorInfo] = {}
        self.header_bytes = 0
        self._header_sizes: list[int] = []
        self._fingerprint: str | None = None
        for i, p in enumerate(self.paths):
            metadata, types, tensors, header_bytes = _read_header(p, check_data=not header_only)
            if i == 0:
                self.metadata, self.metadata_types = metadata, types
            self.header_bytes += header_bytes
            self._header_sizes.append(header_bytes)
            for t in tensors:
                self.tensors[t.name] = t
        expected = self.metadata.get("split.tensors.count")
        if expected is not None and expected != len(self.tensors):
            raise GGUFError(f"{self.path}: split set holds {len(self.tensors)} tensors, header says {expected}")
        self.bytes_read = self.header_bytes

    @property
    def architecture(self) -> str:
        """``general.architecture`` (e.g. ``"gemma3"``)."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: GGUF has no general.architecture key")
        return arch

    @property
    def header_sizes(self) -> list[int]:
        """Bytes of each file's GGUF header (metadata + tensor table, up to the aligned tensor data), in
        ``paths`` order."""
        return list(self._header_sizes)

    @property
    def fingerprint(self) -> str:
        """SHA-256 (hex) of every file's GGUF header (metadata + tensor table): names what the artifact
        holds without reading the tensor data. Equal for a full file and its swarm-fetched sparse copy.
        Not counted in ``bytes_read``."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for p, n in zip(self.paths, self._header_sizes):
                with open(p, "rb") as f:
                    digest.update(f.read(n))
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def layer_tensor_bytes(self, start: int, end: int) -> int:
        """Encoded bytes of all ``blk.N.*`` tensors with ``start <= N < end``."""
        return sum(t.n_bytes for t in self.tensors.values() if t.layer is not None and start <= t.layer < end)

    def read_raw(self, name: str) -> np.ndarray:
        """The encoded bytes of tensor ``name`` as a uint8 array ``[n_bytes]`` (counted in ``bytes_read``).

        Raises KeyError for an unknown tensor name.
        """
        info = self.tensors[name]
        buf = np.empty(info.n_bytes, dtype=np.uint8)
        with open(info.path, "rb", buffering=0) as f:
            f.seek(info.offset)
            got = f.readinto(memoryview(buf))
        if got != info.n_bytes:
            raise GGUFError(f"{info.path}: truncated while reading tensor {name}")
        self.bytes_read += got
        return buf

    def read_tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantized to float32, shape ``info.shape`` (numpy order).

        Dequantization is ``gguf.quants.dequantize`` (ggml's block formats in numpy).
        """
        info = self.tensors[name]
        raw = self.read_raw(name)
        if info.ggml_type == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(info.shape)
        if info.ggml_type == GGMLQuantizationType.F16:
            return raw.view(np.float16).astype(np.float32).reshape(info.shape)
        if info.ggml_type == GGMLQuantizationType.Q8_0:
            return dequantize_q8_0(raw).reshape(info.shape)
        rows = raw.reshape(int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1, -1)
        return dequantize(rows, info.ggml_type).astype(np.float32, copy=False).reshape(info.shape)

    def has(self, name: str) -> bool:
        """Whether the artifact holds tensor ``name``."""
        return name in self.tensors
