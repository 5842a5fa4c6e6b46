"""``ggufswarm tracker`` (serve the registry) and ``ggufswarm status`` (print what a tracker sees)."""

from __future__ import annotations

from aiohttp import web

from ..swarm.publish import tracker_call
from .app import TrackerConfig, coverage_bar, make_app


def run_tracker(config: TrackerConfig, host: str, port: int) -> int:
    """Serve the tracker until interrupted."""
    print(f"tracker on http://{host}:{port}  (db {config.db}, node TTL {config.ttl_s:.0f} s; status page at /)",
          flush=True)
    web.run_app(make_app(config), host=host, port=port, print=None)
    return 0


def status_text(tracker: str) -> str:
    """Per model: each node's range as a coverage bar over the layers, state, free KV, decode ms."""
    snapshot = tracker_call(f"{tracker.rstrip('/')}/status.json")
    lines = []
    for name, m in snapshot["models"].items():
        n = m["n_layers"]
        lines.append(f"{name}  ({n} layers, {len(m['nodes'])} nodes)")
        covered = set()
        for node in m["nodes"]:
            s, e = node["layers"]
            if node["state"] == "ready":
                covered.update(range(s, e))
            stages = ("+embed " if node["embed"] else "") + ("+head" if node["head"] else "")
            lines.append(f"  {coverage_bar(n, (s, e))}  {s:>3}:{e:<3} {node['state']:<8} "
                         f"kv free {node['free_kv_tokens']:>7}  {node['decode_ms']:6.1f} ms  {node['url']} {stages}")
        missing = sorted(set(range(n)) - covered)
        lines.append("  servable end to end" if not missing else f"  not servable: layers {missing} have no ready node")
    return "\n".join(lines) if lines else "no models published"
