"""Node server: serves one shard over HTTP (session operations, frame steps, next-hop push, health, metrics)."""

from .server import NodeConfig, make_app, run_node

__all__ = ["NodeConfig", "make_app", "run_node"]
