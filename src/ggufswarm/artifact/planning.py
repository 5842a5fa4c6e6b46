"""``ggufswarm plan``: how many nodes of a given memory a model needs, and which layers each serves, from
its GGUF header alone (``artifact.accounting``; no tensor data is read or downloaded).

A node's memory holds its shard's weights (encoded bytes, as the tensor table gives them) plus, for each
concurrent session, the KV cache of ``context`` tokens over its blocks and the fixed per-session state of
its recurrent blocks. Compute buffers, llama.cpp's context overhead and the OS are **not** counted:
leave headroom in ``node_memory`` for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from .accounting import (
    FRAME_HEADER_BYTES,
    MAX_CONTEXT,
    TRAILER_BYTES_PER_TOKEN,
    WIRE_ELEMENT_BYTES,
    HeaderAccounts,
    ShardAccount,
)
from .gguf_file import GGUFError, GGUFModelFile

FIT_MARGIN_BYTES = 512 << 20  # device memory device_blocks leaves free beyond weights and KV: compute buffers, driver
# KV cells a session is given room for on a GPU when its blocks are chosen (a GPU's KV cache is allocated as sessions
# open, runtime/llamacpp/kv_size.py: a longer session takes the device memory free then); node --ctx-size's default
# where a cache is allocated up front
GPU_SESSION_CELLS = 8192


def device_blocks(
    acc: HeaderAccounts,
    start: int,
    end: int,
    head: bool,
    device_bytes: int,
    context: int,
    sessions: int = 1,
    n_ubatch: int = 512,
) -> int:
    """How many of blocks ``[start, end)``'s last blocks fit in ``device_bytes`` of GPU memory, as llama.cpp
    offloads them (the last N, ``n_gpu_layers``, src/llama-model.cpp): each costs its encoded weights plus the KV
    cache of ``sessions`` sessions of ``context`` tokens and their recurrent state; a head's output norm and LM
    head (``head_bytes``, and ``n_ubatch`` rows of logits-sized activations) go first; FIT_MARGIN_BYTES stay free
    for llama.cpp's compute buffers and the driver. An estimate from the header: a node reports what llama.cpp then
    allocated (runtime/llamacpp/devices.py ``Placement``)."""
    left = device_bytes - FIT_MARGIN_BYTES
    if head:
        left -= acc.head_bytes + n_ubatch * acc.n_embd * 4
    fit = 0
    for layer in reversed(acc.layers[start:end]):
        cost = layer.weight_bytes + sessions * (context * layer.kv_bytes_per_token + layer.state_bytes_per_session)
        if cost > left:
            break
        left -= cost
        fit += 1
    return fit


class PlanError(ValueError):
    """No placement exists (one block alone exceeds a node's memory, too few nodes) or bad parameters."""


@dataclass(frozen=True)
class NodePlan:
    """One node of a placement: its shard's account, the bytes it holds with ``sessions`` sessions of the
    planned context (``used_bytes``), and the longest context (tokens) one session could have on it given its
    memory (``max_context``; None when its blocks keep no per-token KV); ``gpu_blocks``: the blocks a GPU of the
    planned ``gpu_memory`` holds (``device_blocks``: the range's last ones; empty without a GPU)."""

    shard: ShardAccount
    used_bytes: int
    max_context: int | None
    gpu_blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Placement:
    """A chain of nodes covering blocks ``0 .. n_layers - 1``; ``context``: tokens planned per session;
    ``session_context``: the longest session every node could hold (min of ``max_context``, capped by
    ``trained_context`` when the header gives one); ``wire_bytes_per_token``: frame bytes one decode token
    costs over the route's node-to-node hops (``48 + boundary + 4`` per hop)."""

    node_memory: int
    context: int
    sessions: int
    nodes: list[NodePlan]
    session_context: int | None
    trained_context: int | None
    wire_dtype: str
    wire_bytes_per_token: int
    gpu_memory: int | None = None


def _check(node_memory: int, context: int, sessions: int, n_nodes: int | None) -> None:
    if node_memory <= 0:
        raise PlanError(f"node memory must be positive, got {node_memory}")
    if context < 1:
        raise PlanError(f"context must be at least 1 token, got {context}")
    if sessions < 1:
        raise PlanError(f"sessions must be at least 1, got {sessions}")
    if n_nodes is not None and n_nodes < 1:
        raise PlanError(f"nodes must be at least 1, got {n_nodes}")


def place(
    acc: HeaderAccounts,
    node_memory: int,
    context: int,
    n_nodes: int | None = None,
    sessions: int = 1,
    wire_dtype: str = "f32",
    gpu_memory: int | None = None,
) -> Placement:
    """Cut blocks ``0 .. acc.n_layers - 1`` into contiguous shards for nodes of ``node_memory`` bytes, each
    holding ``sessions`` sessions of ``context`` tokens.

    Without ``n_nodes``: the fewest nodes (greedy: each node takes blocks while they fit, the first with
    the embedding, the last with the head). With ``n_nodes``: exactly that many (or fewer when blocks run
    out), balanced so the fullest node is as empty as possible (binary search on the bound). With
    ``gpu_memory`` (bytes of GPU memory per node), each node's last blocks that fit there are its ``gpu_blocks``
    (``device_blocks`` with room for ``sessions`` sessions of at most GPU_SESSION_CELLS tokens, as a node with blocks
    on a GPU leaves; the cut itself is by ``node_memory``).
    Raises PlanError when a block with its stage does not fit a node, or ``n_nodes`` nodes cannot hold
    the model.
    """
    _check(node_memory, context, sessions, n_nodes)
    n = acc.n_layers
    blocks = acc.layers[:n]
    pw, pk, ps = [0], [0], [0]
    for b in blocks:
        pw.append(pw[-1] + b.weight_bytes)
        pk.append(pk[-1] + b.kv_bytes_per_token)
        ps.append(ps[-1] + b.state_bytes_per_session)
    tied_extra = acc.embed_bytes if "output.weight" not in acc.global_bytes else 0

    def cost(s: int, e: int) -> int:
        w = pw[e] - pw[s] + acc.shared_bytes
        if s == 0:
            w += acc.embed_bytes
        if e == n:
            w += acc.head_bytes - (tied_extra if s == 0 else 0)
        return w + sessions * (context * (pk[e] - pk[s]) + ps[e] - ps[s])

    def cut_ok(s: int, e: int) -> bool:  # [s, e) is a shard, and what follows can still be cut into shards
        return acc.range_problem(s, e) is None and (e == n or acc.range_problem(e, n) is None)

    def greedy(bound: int) -> list[tuple[int, int]] | None:
        cuts, s = [], 0
        while s < n:
            e, best = s, None
            while e < n and cost(s, e + 1) <= bound:
                e += 1
                if cut_ok(s, e):
                    best = e
            if best is None:
                return None
            cuts.append((s, best))
            s = best
        return cuts

    cuts = greedy(node_memory)
    if cuts is None and all(cost(i, i + 1) <= node_memory for i in range(n)):
        problem = next((p for p in (acc.range_problem(i, i + 1) for i in range(n)) if p), "")
        raise PlanError(
            f"no placement on nodes of {human_bytes(node_memory)} with {sessions} session(s) of {context} "
            f"tokens: the shards that fit break the model's cut rules ({problem}); use bigger nodes or "
            f"a shorter --context"
        )
    if cuts is None:
        worst = max(range(n), key=lambda i: cost(i, i + 1))
        raise PlanError(
            f"block {worst} alone (with its stage and {sessions} session(s) of {context} tokens) needs "
            f"{human_bytes(cost(worst, worst + 1))}, more than a node's {human_bytes(node_memory)}; use bigger "
            f"nodes or a shorter --context"
        )
    if n_nodes is not None:
        if len(cuts) > n_nodes:
            raise PlanError(
                f"{n_nodes} node(s) of {human_bytes(node_memory)} cannot hold the model with {sessions} "
                f"session(s) of {context} tokens: it needs at least {len(cuts)}"
            )
        lo, hi = max(cost(i, i + 1) for i in range(n)), node_memory
        while lo < hi:  # the least bound under which greedy needs at most n_nodes nodes
            mid = (lo + hi) // 2
            found = greedy(mid)
            if found is not None and len(found) <= n_nodes:
                hi = mid
            else:
                lo = mid + 1
        cuts = greedy(lo)
    nodes = []
    for s, e in cuts:
        shard = acc.shard(s, e, embed=s == 0, head=e == n, wire_dtype=wire_dtype)
        room = node_memory - shard.weight_bytes - sessions * shard.state_bytes_per_session
        max_ctx = None if shard.kv_bytes_per_token == 0 else max(room, 0) // (sessions * shard.kv_bytes_per_token)
        gpu_cells = min(context, GPU_SESSION_CELLS)
        on_gpu = device_blocks(acc, s, e, e == n, gpu_memory, gpu_cells, sessions) if gpu_memory else 0
        nodes.append(NodePlan(shard, cost(s, e), max_ctx, tuple(range(e - on_gpu, e))))
    limits = [p.max_context for p in nodes if p.max_context is not None]
    trained = acc.metadata.get(f"{acc.arch}.context_length")
    trained = int(trained) if trained else None
    session_context = min(limits) if limits else None
    if trained is not None:
        session_context = trained if session_context is None else min(session_context, trained)
    wire = sum(hop_bytes(nodes))
    return Placement(
        node_memory,
        context,
        sessions,
        nodes,
        session_context,
        trained,
        wire_dtype,
        wire,
        gpu_memory,
    )


def hop_bytes(nodes: list[NodePlan]) -> list[int]:
    """Bytes of one decode token's frame at each cut of a route of ``nodes`` (header, the hidden state at that cut:
    its ``boundary_bytes_per_token``, the token id trailer)."""
    return [n.shard.boundary_bytes_per_token + FRAME_HEADER_BYTES + TRAILER_BYTES_PER_TOKEN for n in nodes[:-1]]


# -- loading a header ------------------------------------------------------------------------------------


def local_accounts(model: str | None) -> tuple[HeaderAccounts, str]:
    """The accounting of a local GGUF ``model`` and a one-line description of it.

    ``model``: a path (any file of a split set: every file's header is read, the tensor data need not be there:
    a header-only copy is enough), None for the embedded default model, or an alias (``smollm2``: the model the
    set-up installs). Never reads tensor data. Raises GGUFError (missing file, not a GGUF, truncated header);
    a published model's accounts come from its tracker (``client.published.load_accounts``).
    """
    from .default_model import MODEL_ALIASES, resolve_model

    if not model or model in MODEL_ALIASES:  # the embedded model when None, smollm2, ...
        model = str(resolve_model(model))
    path = Path(model)
    if not path.exists():
        raise GGUFError(f"{path}: no such file (a published model name needs --tracker URL)")
    file = GGUFModelFile(path, header_only=True)
    described = sum(t.n_bytes for t in file.tensors.values())
    on_disk = sum(p.stat().st_size for p in file.paths)
    note = "" if on_disk >= described + file.header_bytes else f", {human_bytes(on_disk)} on disk (header only)"
    return HeaderAccounts.from_model(file), (
        f"{path} ({len(file.paths)} file(s), {len(file.tensors)} tensors, "
        f"{human_bytes(described)} of tensors described{note})"
    )


def human_bytes(n: int | float) -> str:
    """``n`` bytes in binary units for people: ``512 B``, ``1.50 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def plan_json(acc: HeaderAccounts, placement: Placement | None, source: str) -> dict:
    """Everything ``plan`` reports, as JSON-ready data (bytes as integers)."""
    return {
        "source": source,
        "arch": acc.arch,
        "n_layers": acc.n_layers,
        "n_blocks": acc.n_blocks,
        "n_embd": acc.n_embd,
        "boundary_width": acc.boundary_width,
        "blocks": [asdict(b) for b in acc.layers],
        "globals": dict(sorted(acc.global_bytes.items())),
        "embed_bytes": acc.embed_bytes,
        "head_bytes": acc.head_bytes,
        "shared_bytes": acc.shared_bytes,
        "total_bytes": acc.total_bytes,
        "kv_bytes_per_token": sum(b.kv_bytes_per_token for b in acc.layers[: acc.n_layers]),
        "state_bytes_per_session": sum(b.state_bytes_per_session for b in acc.layers[: acc.n_layers]),
        "boundary_bytes_per_token": {d: acc.boundary_bytes_per_token(d) for d in WIRE_ELEMENT_BYTES},
        "placement": None
        if placement is None
        else {
            **{k: v for k, v in asdict(placement).items() if k != "nodes"},
            "nodes": [
                {
                    **p.shard.to_json(),
                    "used_bytes": p.used_bytes,
                    "max_context": p.max_context,
                    "gpu_blocks": list(p.gpu_blocks),
                }
                for p in placement.nodes
            ],
        },
    }


def _blocks(node: NodePlan) -> str:
    """Which of a node's blocks a GPU holds: ``12:18 +head``, ``15:18 +head (3 of 6)``, ``none``."""
    if not node.gpu_blocks:
        return "none"
    span = f"{node.gpu_blocks[0]}:{node.gpu_blocks[-1] + 1}" + (" +head" if node.shard.head else "")
    total = node.shard.layers[1] - node.shard.layers[0]
    return span if len(node.gpu_blocks) == total else f"{span} ({len(node.gpu_blocks)} of {total})"


def plan_text(acc: HeaderAccounts, placement: Placement | None, source: str) -> str:
    """The human report of ``plan``: per-block table, totals, boundary, placement."""
    lines = [
        f"model: {source}",
        f"architecture {acc.arch}: {acc.n_layers} blocks on a route"
        + (f" (+{acc.n_blocks - acc.n_layers} MTP/nextn blocks no route runs)" if acc.n_blocks > acc.n_layers else "")
        + f", n_embd {acc.n_embd}",
        "",
        f"{'block':>5}  {'kind':<10} {'weight bytes':>16} {'':>11}  {'KV B/token':>10}  {'state B/session':>15}",
    ]
    for b in acc.layers:
        mark = "" if b.index < acc.n_layers else "  (MTP, not placed)"
        lines.append(
            f"{b.index:>5}  {b.kind:<10} {b.weight_bytes:>16,} {human_bytes(b.weight_bytes):>11}  "
            f"{b.kv_bytes_per_token:>10,}  {b.state_bytes_per_session:>15,}{mark}"
        )
    block_total = sum(b.weight_bytes for b in acc.layers)
    lines += [f"{'all':>5}  {'':<10} {block_total:>16,} {human_bytes(block_total):>11}", ""]
    for name, n in sorted(acc.global_bytes.items()):
        lines.append(f"  {name:<28} {n:>16,} {human_bytes(n):>11}")
    route_kv = sum(b.kv_bytes_per_token for b in acc.layers[: acc.n_layers])
    widened = (
        "hyper-connections"
        if acc.boundary_width_at(0) != acc.n_embd
        else "the stream and its attention-residual checkpoints, at the widest cut"
    )
    width = f"n_embd {acc.n_embd}" + (
        f" x {acc.boundary_width // acc.n_embd} ({widened})" if acc.boundary_width != acc.n_embd else ""
    )
    route_state = sum(b.state_bytes_per_session for b in acc.layers[: acc.n_layers])
    trained = acc.metadata.get(f"{acc.arch}.context_length")
    longest = min(int(trained), MAX_CONTEXT) if trained else MAX_CONTEXT  # the longest session a route serves
    lines += [
        f"  {'tensor table total':<28} {acc.total_bytes:>16,} {human_bytes(acc.total_bytes):>11}",
        "",
        f"KV cache per token (all route blocks, f16): {route_kv:,} B; at {longest:,} tokens "
        f"{human_bytes(route_kv * longest)}",
        f"recurrent state per session (f32): {route_state:,} B",
        f"boundary per decode token: {width} x 4 = {acc.boundary_bytes_per_token('f32'):,} B f32 "
        f"({acc.boundary_bytes_per_token('f16'):,} B f16); a frame adds {FRAME_HEADER_BYTES} + "
        f"{TRAILER_BYTES_PER_TOKEN} B",
    ]
    if placement is None:
        return "\n".join(lines)
    p = placement
    lines += [
        "",
        f"placement: nodes of {human_bytes(p.node_memory)}"
        + (f" with a GPU of {human_bytes(p.gpu_memory)}" if p.gpu_memory else "")
        + f", {p.sessions} session(s) of {p.context:,} tokens each (weights + KV + state; compute buffers not counted)",
        f"{'node':>4}  {'layers':<9} {'stages':<11} {'weights':>11} {'KV+state':>11} {'used':>11} {'max context':>12}"
        + ("  on the GPU" if p.gpu_memory else ""),
    ]
    for i, node in enumerate(p.nodes, 1):
        s = node.shard
        stages = "+".join(x for x, on in (("embed", s.embed), ("head", s.head)) if on) or "-"
        sessions_bytes = node.used_bytes - s.weight_bytes
        ctx = f"{longest:,}" if node.max_context is None or node.max_context >= longest else f"{node.max_context:,}"
        lines.append(
            f"{i:>4}  {s.layers[0]}:{s.layers[1]:<{8 - len(str(s.layers[0]))}} {stages:<11} "
            f"{human_bytes(s.weight_bytes):>11} {human_bytes(sessions_bytes):>11} {human_bytes(node.used_bytes):>11} "
            f"{ctx:>12}" + (f"  {_blocks(node)}" if p.gpu_memory else "")
        )
    ctx = "unbounded by memory" if p.session_context is None else f"{p.session_context:,} tokens"
    trained = f" (trained context {p.trained_context:,})" if p.trained_context else ""
    hops = hop_bytes(p.nodes)
    per_hop = (
        "no hop"
        if not hops
        else f"{len(hops)} hop(s) x {hops[0]:,}"
        if len(set(hops)) == 1
        else " + ".join(f"{h:,}" for h in hops)
    )
    lines += [
        f"nodes: {len(p.nodes)}; each session can have up to {ctx}{trained}",
        f"wire bytes per decode token on this route ({p.wire_dtype}): {per_hop} = {p.wire_bytes_per_token:,} B",
    ]
    return "\n".join(lines)


__all__ = [
    "FIT_MARGIN_BYTES",
    "device_blocks",
    "NodePlan",
    "PlanError",
    "Placement",
    "human_bytes",
    "local_accounts",
    "place",
    "plan_json",
    "plan_text",
]
