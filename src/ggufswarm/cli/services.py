"""The command line's shared services: the options of ``ggufswarm tracker`` and ``cache``."""

from __future__ import annotations

import argparse

from .args import byte_size, token_arg


def add_tracker_parser(sub) -> argparse.ArgumentParser:
    """Add ``ggufswarm tracker`` to the subparsers ``sub``; its parser."""
    t = sub.add_parser(
        "tracker",
        help="registry of nodes, manifests and routes; BitTorrent tracker of the swarms",
        description="Serve the tracker: node registry with heartbeats (TTL expiry), shard "
        "advertisements, manifests by name, the BitTorrent announce endpoint (/announce), "
        "route queries (/route?model=NAME&max_length=N) and a live status page at /. "
        "State is kept in SQLite and survives a restart.",
    )
    t.add_argument(
        "--db",
        default="ggufswarm-tracker.sqlite",
        metavar="PATH",
        help="SQLite file (default ./ggufswarm-tracker.sqlite)",
    )
    t.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for nodes on other machines)",
    )
    t.add_argument("--port", type=int, default=8470, help="TCP port (default 8470)")
    t.add_argument("--ttl", type=float, default=15.0, metavar="S", help="forget nodes silent this long (default 15)")
    t.add_argument(
        "--relay",
        action="store_true",
        help="also relay for nodes behind NATs that cannot be dialled (net/relay.py); dial-backs are always answered",
    )
    t.add_argument("--public-host", metavar="HOST", help="with --relay: the address relayed nodes are reached at")
    t.add_argument(
        "--operator-token",
        metavar="SECRET",
        default=None,
        help="the operator's credential, apart from the swarm token (default $GGUFSWARM_OPERATOR_TOKEN): what only "
        "the operator may do, lift a ban ('ggufswarm bans --lift KEY') or remove another node, needs it; without "
        "one nobody can",
    )
    t.add_argument(
        "--witness-age",
        type=float,
        default=300.0,
        metavar="S",
        help="a ban is taken only with signed evidence from two nodes of the accused's layers and numerics (besides "
        "its own commitment); each must have served those layers here for at least S seconds, so keys made for "
        "the occasion witness nothing (default 300; 0 in a test swarm)",
    )
    token_arg(t)
    return t


def add_cache_parser(sub) -> argparse.ArgumentParser:
    """Add ``ggufswarm cache`` to the subparsers ``sub``; its parser."""
    c = sub.add_parser(
        "cache",
        help="prefix KV snapshot cache for nodes (route repair, prefix reuse)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve prefix KV snapshots: nodes started with --cache URL store each\n"
        "session's KV of their layers here (content-addressed by model, layer range and\n"
        "token prefix; SHA-256 checked on every read; least recently used evicted past\n"
        "--max-bytes). A replacement node restores from it when the gateway repairs a\n"
        "route, and a new session whose prompt starts with a cached prefix skips\n"
        "recomputing it.",
        epilog="example:\n  ggufswarm cache --dir ./ggufswarm-cache --port 8475 --max-bytes 8G\n"
        "  ggufswarm node --layers 0:9 --embed --cache http://127.0.0.1:8475",
    )
    c.add_argument("--dir", required=True, metavar="PATH", help="directory for snapshots and their index (created)")
    c.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for nodes on other machines)",
    )
    c.add_argument("--port", type=int, default=8475, help="TCP port (default 8475; 0 = any free port)")
    c.add_argument(
        "--max-bytes",
        type=byte_size,
        default=4 * 2**30,
        metavar="N",
        help="size cap; least recently used snapshots are evicted past it (bytes, or with K/M/G; default 4G)",
    )
    token_arg(c)
    return c
