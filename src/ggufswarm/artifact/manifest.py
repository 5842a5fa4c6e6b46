"""Model artifact manifest: what a GGUF holds and which byte ranges each layer (shard) needs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .gguf_file import GGUFModelFile

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class ManifestTensor:
    """One tensor: the file (index into ``Manifest.files``), absolute byte offset, size, ggml type, shape."""

    name: str
    file: int
    offset: int
    n_bytes: int
    ggml_type: str
    shape: list[int]
    layer: int | None


@dataclass
class Manifest:
    """JSON-serializable description of a model artifact (see DESIGN.md, "manifest").

    ``files``: ``[{"name", "bytes", "sha256", "header_bytes"}]`` in split order. The swarm fields
    (``info_hash``, ``piece_size``, ``web_seeds``) are filled in by the publisher.
    """

    name: str
    arch: str
    n_layers: int
    files: list[dict[str, Any]]
    tensors: list[ManifestTensor]
    info_hash: str = ""
    piece_size: int = 0
    web_seeds: list[str] = field(default_factory=list)
    version: int = MANIFEST_VERSION

    @classmethod
    def from_gguf(cls, path: str | Path, name: str | None = None, hash_files: bool = True) -> Manifest:
        """Index a GGUF file or split set. ``hash_files`` computes each file's SHA-256 (reads the whole file)."""
        model = GGUFModelFile(path)
        index = {p: i for i, p in enumerate(model.paths)}
        files = []
        for p in model.paths:
            files.append(
                {
                    "name": p.name,
                    "bytes": p.stat().st_size,
                    "sha256": sha256_file(p) if hash_files else "",
                    "header_bytes": min(t.offset for t in model.tensors.values() if t.path == p)
                    if any(t.path == p for t in model.tensors.values())
                    else p.stat().st_size,
                }
            )
        tensors = [
            ManifestTensor(t.name, index[t.path], t.offset, t.n_bytes, t.ggml_type.name, list(t.shape), t.layer)
            for t in sorted(model.tensors.values(), key=lambda t: (index[t.path], t.offset))
        ]
        n_layers = int(model.metadata.get(f"{model.architecture}.block_count", 0))
        return cls(name or model.paths[0].name.removesuffix(".gguf"), model.architecture, n_layers, files, tensors)

    def byte_ranges(self, start: int, end: int, embed: bool = False, head: bool = False) -> list[tuple[int, int, int]]:
        """Byte ranges ``(file, begin, end)`` (half-open, merged) a shard ``[start, end)`` needs.

        Always includes every file's header (metadata + tensor table); ``embed`` adds
        ``token_embd``; ``head`` adds ``output_norm``, ``output`` (or ``token_embd`` when tied).
        """
        names = {t.name for t in self.tensors}
        wanted = set()
        if embed:
            wanted.add("token_embd.weight")
        if head:
            wanted |= {"output_norm.weight", "output.weight" if "output.weight" in names else "token_embd.weight"}
        wanted.add("rope_freqs.weight")
        ranges = [(i, 0, f["header_bytes"]) for i, f in enumerate(self.files)]
        for t in self.tensors:
            if t.name in wanted or (t.layer is not None and start <= t.layer < end):
                ranges.append((t.file, t.offset, t.offset + t.n_bytes))
        ranges.sort()
        merged: list[tuple[int, int, int]] = []
        for f, b, e in ranges:
            if merged and merged[-1][0] == f and b <= merged[-1][2]:
                merged[-1] = (f, merged[-1][1], max(merged[-1][2], e))
            else:
                merged.append((f, b, e))
        return merged

    def layer_bytes(self) -> list[int]:
        """Encoded tensor bytes per block ``[n_layers]``."""
        out = [0] * self.n_layers
        for t in self.tensors:
            if t.layer is not None and t.layer < self.n_layers:
                out[t.layer] += t.n_bytes
        return out

    def to_json(self) -> str:
        """The manifest as JSON text."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse JSON text; ValueError when it is not a manifest of a known version."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a manifest is a JSON object, got {type(data).__name__}")
        if data.get("version") != MANIFEST_VERSION:
            raise ValueError(f"unsupported manifest version {data.get('version')!r}")
        data["tensors"] = [ManifestTensor(**t) for t in data["tensors"]]
        return cls(**data)


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    """Hex SHA-256 of a whole file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()
