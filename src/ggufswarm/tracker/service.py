"""``ggufswarm tracker`` (serve the registry) and ``ggufswarm status`` (print what a tracker sees)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from ..directory.routing import Advertisement, NoRoute, gaps, plan_route
from ..directory.trackers import TrackerClient
from .app import TrackerConfig, coverage_bar, make_app


def run_tracker(config: TrackerConfig, host: str, port: int) -> int:
    """Serve the tracker until SIGINT/SIGTERM; prints one ready line once listening.

    Raises ValueError when the database's directory does not exist, OSError when the port is taken.
    """
    from ..net.http import run_server

    db_dir = Path(config.db).expanduser().resolve().parent
    if config.db != ":memory:" and not db_dir.is_dir():
        raise ValueError(f"--db {config.db}: directory {db_dir} does not exist")
    operator_file = None
    if config.operator_token is None and config.db != ":memory:":  # so that a ban can always be lifted
        operator_file = Path(f"{config.db}.operator-token")
        config = replace(config, operator_token=operator_token(operator_file))

    def ready(url: str) -> None:
        reached = url.replace("//0.0.0.0:", "//HOST:").replace("//[::]:", "//HOST:")  # a wildcard: its address
        page = f"{reached}/?token=TOKEN (the swarm token)" if config.token else f"{reached}/"
        relay = f"; relays at {config.public_host or '127.0.0.1'}" if config.relay else ""
        print(
            f"ggufswarm tracker ready: {url}  (db {config.db}, node TTL {config.ttl_s:g} s{relay}; status page at "
            f"{page})",
            flush=True,
        )
        if operator_file is not None:
            print(
                f"ggufswarm tracker: the operator's credential (lift bans, remove nodes) is in {operator_file}: "
                f'ggufswarm bans --tracker {reached} --lift KEY --operator-token "$(cat {operator_file})"',
                flush=True,
            )

    run_server(make_app(config), host, port, ready)
    print("ggufswarm tracker: stopped", file=sys.stderr, flush=True)
    return 0


def operator_token(path: Path) -> str:
    """The operator's credential kept in ``path`` (made, 128 random bits, readable by its owner only, when absent)."""
    import secrets

    try:
        return path.read_text().strip()
    except FileNotFoundError:
        token = secrets.token_hex(16)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token


def status_text(tracker: str, token: str | None = None) -> str:
    """Per model: each node's range as a coverage bar over the layers, state, free KV, decode ms (``token``: the
    swarm token)."""
    snapshot = TrackerClient(tracker, token).status()
    lines = []
    for name, m in snapshot["models"].items():
        n = m["n_layers"]
        ads = [Advertisement.from_json(a) for a in m["nodes"]]
        count = len(ads)
        lines.append(f"{name}  ({n} layers, {count} node{'s' if count != 1 else ''})")
        covered = set()
        for node in sorted(ads, key=lambda a: (a.layers, a.url)):
            s, e = node.layers
            if node.state == "ready":
                covered.update(range(s, e))
            stages = " ".join(x for x, on in (("+embed", node.embed), ("+head", node.head)) if on)
            lines.append(
                f"  {coverage_bar(n, (s, e))}  {s:>3}:{e:<3} {node.state:<8} "
                f"kv free {node.free_kv_tokens:>7}  decode {node.decode_ms:6.1f} ms  "
                f"{node.url} {stages}".rstrip()
            )
        missing = gaps(covered, n)
        if missing:
            lines.append("  not servable: layers " + ", ".join(f"{a}:{b}" for a, b in missing) + " have no ready node")
            continue
        try:  # covered is not enough: the ranges must chain from an embedding stage to a head (the tracker's plan)
            plan_route([replace(a, free_kv_tokens=1 << 62, extra={}, signed=None) for a in ads], n, 1)
            lines.append("  servable end to end")
        except NoRoute as exc:
            lines.append(
                f"  not servable: {exc}"
                + ("" if any(a.head for a in ads) else f" (no node has --head: the one serving layer {n - 1} needs it)")
                + ("" if any(a.embed for a in ads) else " (no node has --embed: the one serving layer 0 needs it)")
            )
    return "\n".join(lines) if lines else "no models published"
