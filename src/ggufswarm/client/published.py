"""A published model's GGUF accounting for ``ggufswarm plan --tracker``: the tensor table from the tracker's
manifest, the metadata from a node serving the model (``GET /v1/model/header/0``); never any tensor data."""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from ..artifact.accounting import HeaderAccounts
from ..artifact.default_model import MODEL_ALIASES
from ..artifact.gguf_file import GGUFModelFile
from ..artifact.manifest import Manifest
from ..artifact.planning import PlanError, human_bytes, local_accounts
from ..directory.trackers import TrackerClient
from ..net.auth import auth_headers

HEADER_TIMEOUT_S = 30.0  # seconds for one node's answer with the model's first header


def load_accounts(
    model: str | None, tracker: str | None = None, token: str | None = None
) -> tuple[HeaderAccounts, str]:
    """The accounting of ``model`` and a one-line description of where its header came from: a local GGUF (see
    ``artifact.planning.local_accounts``) when ``model`` names one or no ``tracker`` is given, else the model
    published under that name on ``tracker`` (``token``: the swarm token).

    Raises GGUFError (missing file, not a GGUF), TrackerError (unknown name, tracker down), PlanError (no node
    gave the header)."""
    if tracker is None or not model or model in MODEL_ALIASES or Path(model).exists():
        return local_accounts(model)
    client = TrackerClient(tracker, token)
    manifest = Manifest.from_json(json.dumps(client.manifest(model)["manifest"]))
    errors = []
    for node in client.nodes(model):
        url = str(node.get("url", "")).rstrip("/")
        try:
            req = urllib.request.Request(f"{url}/v1/model/header/0", headers=auth_headers(token))
            with urllib.request.urlopen(req, timeout=HEADER_TIMEOUT_S) as r:
                data = r.read(manifest.files[0]["header_bytes"] + 1)
        except (urllib.error.URLError, OSError) as exc:
            errors.append(f"{url}: {getattr(exc, 'reason', exc)}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            head = Path(tmp) / "header.gguf"
            head.write_bytes(data)
            metadata = GGUFModelFile(head, header_only=True).metadata
        acc = HeaderAccounts(metadata, ((t.name, t.n_bytes) for t in manifest.tensors))
        described = sum(t.n_bytes for t in manifest.tensors)
        return acc, (
            f"{model} on {client.url} (manifest: {len(manifest.files)} file(s), {len(manifest.tensors)} "
            f"tensors, {human_bytes(described)} described; metadata from {url})"
        )
    why = "; ".join(errors) if errors else "no node serves it now"
    raise PlanError(
        f"{model}: the tracker's manifest has the tensor table but not the metadata, and no node gave "
        f"the header ({why}); plan from a local copy of the GGUF header instead"
    )
