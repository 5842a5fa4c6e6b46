"""Node: serves one shard over HTTP (session operations, frame steps, next-hop push, health, metrics).

Layout, in the order a step flows: ``state`` (config, shared state, metrics), ``sessions_api`` (session endpoints),
``steps`` (frames in, apply, push to the next hop over ``link``, relay back), ``batching`` and ``snapshots`` (what a
step may go through), ``advertise`` (the tracker), ``app`` (the aiohttp app and the ``ggufswarm node`` command).
"""

from .app import make_app, run_node
from .state import NodeConfig

__all__ = ["NodeConfig", "make_app", "run_node"]
