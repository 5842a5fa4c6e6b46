"""OpenAI-compatible gateway over a route of nodes (chat/completions, SSE streaming, generation telemetry)."""

from .app import make_app
from .config import GatewayConfig
from .serve import run_gateway

__all__ = ["GatewayConfig", "make_app", "run_gateway"]
