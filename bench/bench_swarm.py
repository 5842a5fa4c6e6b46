"""Benchmark: swarm fetch of a shard from 1 vs 3 seeders, bytes downloaded vs shard bytes, and the time
from `ggufswarm node --tracker` start to its first served token. One run, loopback, one table.

Not a test. Usage: python bench/bench_swarm.py [--model PATH] [--layers 6:12]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF path (default: embedded Gemma 3 270M Q4_K_M)")
    ap.add_argument("--layers", default="6:12", help="range fetched by the new node (default 6:12)")
    args = ap.parse_args()

    from ggufswarm.artifact.default_model import resolve_model
    from ggufswarm.artifact.manifest import Manifest
    from ggufswarm.client.route import RemoteRoute
    from ggufswarm.net.http import ServerThread
    from ggufswarm.node.launch import start_nodes, stop_nodes
    from ggufswarm.runtime.sampling import SamplingParams
    from ggufswarm.runtime.shard import ShardSpec
    from ggufswarm.swarm.publish import publish
    from ggufswarm.swarm.torrent import Swarm
    from ggufswarm.tracker.app import TrackerConfig, make_app

    path = resolve_model(args.model)
    start, end = (int(x) for x in args.layers.split(":"))
    work = Path(tempfile.mkdtemp(prefix="ggufswarm-bench-"))
    rows = []
    try:
        server = ServerThread(make_app(TrackerConfig(db=":memory:")))
        tracker = server.start()
        try:
            published = publish(path, tracker, "bench")
            manifest: Manifest = published.manifest
            ranges = manifest.byte_ranges(start, end)
            shard_bytes = sum(manifest.layer_bytes()[start:end]) + manifest.files[0]["header_bytes"]
            seeders = []
            for i in range(3):
                d = work / f"seed{i}"
                d.mkdir()
                shutil.copy(path, d / path.name)
                s = Swarm()
                s.seed(published.torrent, d)
                seeders.append(s)
            for n_seeders in (1, 3):
                leech = Swarm()
                t0 = time.perf_counter()
                stats = leech.fetch(
                    published.torrent,
                    work / f"leech{n_seeders}",
                    ranges,
                    peers=[("127.0.0.1", s.port) for s in seeders[:n_seeders]],
                    progress=False,
                )
                rows.append(
                    (
                        f"fetch {args.layers} from {n_seeders} seeder(s)",
                        time.perf_counter() - t0,
                        stats.bytes_downloaded,
                        shard_bytes,
                    )
                )
                leech.close()
            for s in seeders[1:]:
                s.close()
            t0 = time.perf_counter()
            nodes = start_nodes(
                [ShardSpec(0, manifest.n_layers, True, True)],
                "bench",
                threads=2,
                timeout=900,
                extra=["--tracker", tracker, "--data-dir", str(work / "node")],
            )
            try:
                route = RemoteRoute([nodes[0].url])
                session = route.open(64, SamplingParams(temperature=0))
                session.step([2, 651, 6037, 529])
                rows.append(("node start → first served token (whole model)", time.perf_counter() - t0, 0, 0))
                session.close()
            finally:
                stop_nodes(nodes)
            seeders[0].close()
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"model: {path.name}; piece size {published.manifest.piece_size} B")
    print(f"{'measurement':48s} {'seconds':>8s} {'downloaded B':>14s} {'shard B':>12s} {'ratio':>6s}")
    for name, secs, got, want in rows:
        ratio = f"{got / want:.3f}" if want else ""
        print(f"{name:48s} {secs:8.2f} {got or '':>14} {want or '':>12} {ratio:>6s}")


if __name__ == "__main__":
    main()
