"""OpenAI-compatible gateway over a route of nodes (chat/completions, SSE streaming, generation telemetry)."""

from .app import GatewayConfig, ServerThread, make_app, run_gateway

__all__ = ["GatewayConfig", "ServerThread", "make_app", "run_gateway"]
