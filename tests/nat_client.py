"""A streamed greedy completion from a gateway, run in a test namespace (tests/test_nat_swarm.py, bench/bench_nat.py).

Usage: ``python nat_client.py BASE_URL PROMPT MAX_TOKENS [--ignore-eos]`` (BASE_URL like ``http://10.77.0.1:8000``;
``--ignore-eos``: always MAX_TOKENS tokens, for benchmarks). Prints one JSON
line per text delta (``{"delta": TEXT, "n": i, "t": seconds since the request}``), flushed, then
``{"text": ..., "telemetry": ..., "seconds": ...}``; an error event or HTTP error is printed as ``{"error": ...}`` and
exits 1.
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from urllib.parse import urlsplit


def main(base: str, prompt: str, max_tokens: int, ignore_eos: bool = False) -> int:
    parts = urlsplit(base)
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if ignore_eos:
        body["ignore_eos"] = True
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        print(json.dumps({"error": f"HTTP {resp.status}: {resp.read().decode(errors='replace')}"}), flush=True)
        return 1
    text, telemetry, n = [], None, 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            print(json.dumps({"error": event["error"], "telemetry": event.get("telemetry")}), flush=True)
            return 1
        delta = event["choices"][0]["text"]
        if delta:
            text.append(delta)
            n += 1
            print(json.dumps({"delta": delta, "n": n, "t": round(time.perf_counter() - t0, 4)}), flush=True)
        telemetry = event.get("telemetry") or telemetry
    out = {"text": "".join(text), "telemetry": telemetry, "seconds": round(time.perf_counter() - t0, 4)}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), "--ignore-eos" in sys.argv[4:]))
