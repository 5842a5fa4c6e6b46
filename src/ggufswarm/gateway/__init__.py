"""OpenAI-compatible gateway over a route of nodes (chat/completions, SSE streaming, generation telemetry)."""

from .app import GatewayConfig, make_app, run_gateway

__all__ = ["GatewayConfig", "make_app", "run_gateway"]
