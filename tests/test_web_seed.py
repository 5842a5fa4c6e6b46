"""A published model whose only source is an HTTP web seed (``ggufswarm publish --web-seed URL --no-seed``):
a node with a partial layer range fetches its layers from it, and only about its share of the bytes."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from apphost import AppThread
from tinymodels import write_tiny_model

from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.artifact.manifest import Manifest
from ggufswarm.directory.trackers import TrackerClient
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.shard import ShardSpec
from ggufswarm.tracker.app import TrackerConfig
from ggufswarm.tracker.app import make_app as make_tracker_app


class RangeServer(ThreadingHTTPServer):
    """Serves the files of ``root`` over HTTP/1.1 with single byte ranges (``Range: bytes=A-B``, ``A-``, ``-N``:
    206), as a plain static web server does; records every request (method, range header, body bytes sent)."""

    daemon_threads = True

    def __init__(self, root: Path):
        super().__init__(("127.0.0.1", 0), RangeHandler)
        self.root = root
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str | None, int]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def bytes_sent(self) -> int:
        with self.lock:
            return sum(n for _, _, n in self.requests)


class RangeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as libtorrent's web seed connection expects

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        path = self.server.root / urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        header = self.headers.get("Range")
        if not path.is_file():
            self._record(header, 0)
            self.send_error(404)
            return
        size = path.stat().st_size
        start, end, status = 0, size - 1, 200
        if header is not None:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
            if not m or not (m[1] or m[2]):
                self._record(header, 0)
                self.send_error(416)
                return
            if m[1]:
                start, end = int(m[1]), min(int(m[2]), size - 1) if m[2] else size - 1
            else:
                start = max(size - int(m[2]), 0)
            if start > end:
                self._record(header, 0)
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        length = end - start + 1
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(length))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        sent = 0
        if body:
            with open(path, "rb") as f:
                f.seek(start)
                while sent < length:
                    chunk = f.read(min(1 << 16, length - sent))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    sent += len(chunk)
        self._record(header, sent)

    def _record(self, header: str | None, sent: int) -> None:
        with self.server.lock:
            self.server.requests.append((self.command, header, sent))


def test_node_fetches_its_layers_from_a_web_seed_only(tmp_path, ggufswarm_cli):
    """Publish with ``--web-seed`` and ``--no-seed`` (no BitTorrent peer holds the model at all), start a node for
    layers 2:4 of 6 with ``--tracker``: it fetches them through the web seed, byte-identical, and both what it
    downloaded and what it holds on disk stay within the partial-fetch bound of test_swarm's peer fetch (its
    blocks + the header + at most one piece of waste at each end of each range, 5% slack); the web server sent
    about that much, not the file."""
    src = tmp_path / "www"
    src.mkdir()
    model = write_tiny_model(src / "tiny-ws.gguf", "llama", n_layers=6, seed=7)
    size = model.stat().st_size
    web = RangeServer(src)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    node = None
    try:
        with AppThread(lambda: make_tracker_app(TrackerConfig(db=str(tmp_path / "t.sqlite")))) as tracker:
            pub = subprocess.run(
                [
                    *ggufswarm_cli,
                    "publish",
                    str(model),
                    "--tracker",
                    tracker,
                    "--name",
                    "tiny-ws",
                    "--data-dir",
                    str(tmp_path / "pub"),
                    "--web-seed",
                    f"{web.url}/{model.name}",
                    "--piece-size",
                    str(64 * 1024),
                    "--no-seed",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert pub.returncode == 0, pub.stderr
            manifest = TrackerClient(tracker).manifest("tiny-ws")["manifest"]
            assert manifest["web_seeds"] == [f"{web.url}/{model.name}"] and manifest["piece_size"] == 64 * 1024
            assert web.bytes_sent() == 0  # publishing hashed the local file: nothing came over HTTP yet

            log = tmp_path / "node.err"
            with open(log, "w") as err:
                node = start_nodes(
                    [ShardSpec(2, 4)],
                    "tiny-ws",
                    threads=1,
                    stderr=err,
                    timeout=90,
                    extra=["--tracker", tracker, "--fetch-timeout", "30"],
                    per_node=lambda i: ["--data-dir", str(tmp_path / "node")],
                )[0]
            text = log.read_text()
            m = re.search(r"fetched layers 2:4 of tiny-ws: (\d+) bytes", text)
            assert m, text
            downloaded = int(m[1])
            deadline = time.monotonic() + 20  # the node advertises what it fetched once it serves
            while not (ads := TrackerClient(tracker).nodes("tiny-ws")):
                assert time.monotonic() < deadline, "the node never advertised"
                time.sleep(0.1)
            assert [(tuple(a["layers"]), a["url"]) for a in ads] == [((2, 4), node.url)]

        man = Manifest.from_json(json.dumps(manifest))
        ranges = man.byte_ranges(2, 4)
        header = man.files[0]["header_bytes"]
        shard_bytes = sum(man.layer_bytes()[2:4])
        piece = man.piece_size
        bound = 1.05 * (shard_bytes + header + 2 * len(ranges) * piece)  # test_swarm's partial-fetch bound
        fetched_path = tmp_path / "node" / model.name
        on_disk = fetched_path.stat().st_blocks * 512
        served = web.bytes_sent()
        print(
            f"{size} B file, {shard_bytes} B of blocks 2:4 + {header} B header; bound {bound:.0f}; node downloaded "
            f"{downloaded} B, holds {on_disk} B on disk; the web seed sent {served} B in {len(web.requests)} requests"
        )
        assert bound < 0.6 * size  # a real partial fetch: the bound excludes most of the file
        assert shard_bytes + header <= downloaded <= bound
        assert on_disk <= bound
        # every byte came from the web seed: it sent at least what the node downloaded (libtorrent counts verified
        # payload; a web seed may send a little more, e.g. a request cut short), and no more than the bound
        assert downloaded <= served <= bound
        assert all(method in ("GET", "HEAD") and rng for method, rng, _ in web.requests), web.requests[:5]
        fetched, original = GGUFModelFile(fetched_path), GGUFModelFile(model)
        names = [t.name for t in man.tensors if t.layer is not None and 2 <= t.layer < 4]
        assert names
        for name in names:
            assert np.array_equal(fetched.read_raw(name), original.read_raw(name)), name
    finally:
        if node is not None:
            stop_nodes([node])
        web.shutdown()
        web.server_close()
