"""Command line: ``ggufswarm demo | generate | perplexity | node | gateway | tracker | publish | status | bans |
cache | plan``: each command's entry (``cmd_*``) and ``main``; the options are in ``parser.py``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .args import check_speculative
from .parser import build_parser


def _context_for(max_tokens: int) -> int:
    """KV cells the llama.cpp backend reserves for one generate session: prompt room plus the completion."""
    return max(4096, max_tokens + 2048)


def cmd_generate(args) -> int:
    check_speculative(args)
    from ..client.generate import GenerationStats, generate
    from ..client.local import LocalModel
    from ..runtime.sampling import SamplingParams

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    ).validate()
    model = LocalModel.load(
        args.model,
        args.split,
        args.dtype,
        args.backend,
        args.threads,
        max_length=_context_for(args.max_tokens),
        max_sessions=1,
    )
    if args.chat and not model.tokenizer.chat_template:
        print(
            f"note: the GGUF has no chat template (a base model?); using llama.cpp's built-in "
            f"'{model.tokenizer.builtin_template}' template",
            file=sys.stderr,
        )
    ids = model.prompt_ids(prompt, chat=args.chat)
    limit = model.config.max_length
    if len(ids) >= limit:
        raise ValueError(f"prompt is {len(ids)} tokens; the limit for this model is {limit} tokens")
    session = model.session(min(limit, len(ids) + max(args.max_tokens, 1)), sampling)
    stats = GenerationStats()
    drafter = None
    if args.speculative == "ngram":
        from ..client.speculative import NgramDrafter

        drafter = NgramDrafter(min(args.draft_max, session.max_verify_tokens - 1))
    elif args.speculative == "draft":
        from ..client.draft_model import DraftModel

        drafter = DraftModel(
            args.draft_model,
            model.file.metadata,
            max_length=_context_for(args.max_tokens),
            sessions=1,
            threads=args.draft_threads,
        ).drafter(min(args.draft_max, session.max_verify_tokens - 1), session.max_length)
    for delta in generate(session, model.tokenizer, ids, args.max_tokens, args.stop, stats, drafter, args.special):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(stats.summary(), file=sys.stderr)
    return 0


def cmd_perplexity(args) -> int:
    from ..client.local import LocalModel
    from ..client.perplexity import perplexity

    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except IsADirectoryError:
        raise ValueError(f"{args.file}: is a directory, not a text file") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{args.file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    model = LocalModel.load(
        args.model, args.split, args.dtype, args.backend, args.threads, max_length=args.ctx_size, all_logits=True
    )
    tokens = model.tokenizer.encode(text)
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None

    def all_logits(chunk):
        return model.session(len(chunk)).logits(chunk, all_positions=True)

    ppl = float("nan")
    for done, ppl in perplexity(all_logits, tokens, args.ctx_size, bos, args.chunks):
        print(f"[{done}] {ppl:.4f}", file=sys.stderr, flush=True)
    print(f"perplexity: {ppl:.4f}")
    return 0


def _apply_link(args) -> None:
    """Fill a node's or gateway's options from its join link (``--join`` / ``join LINK``): the model, the first
    tracker, the secret and the DHT contacts; what the command line gives itself wins."""
    from ..net.invite import JoinLink

    text = getattr(args, "link", None) or getattr(args, "join", None)
    if not text:
        args.model_id, args.relays, args.more_trackers = None, tuple(getattr(args, "relay_via", ()) or ()), ()
        return
    link = JoinLink.parse(text)
    args.model = args.model or link.model
    args.tracker = args.tracker or (link.trackers[0] if link.trackers else None)
    args.more_trackers = tuple(t for t in link.trackers if t != args.tracker)
    args.token = args.token or link.secret
    if not args.token:
        print(
            f"ggufswarm {args.command}: the join link carries no secret= and no --token / $GGUFSWARM_TOKEN is set: "
            "joining as an open swarm (a swarm with a token answers 401)",
            file=sys.stderr,
        )
    args.model_id = link.model_id
    if hasattr(args, "cache") and not args.cache and link.caches:  # a node: the swarm's snapshot cache
        args.cache = link.caches[0]
    args.relays = tuple(getattr(args, "relay_via", ()) or ()) + link.relays
    if getattr(args, "dht", None) is None or hasattr(args, "dht_port"):
        args.dht = ",".join(link.dht) if link.dht else "-"


def _dht_contacts(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    return tuple(c.strip() for c in text.split(",") if c.strip() and c.strip() != "-")


def _listen_where_reached(args) -> None:
    """A node's ``--host`` (when not given: where it reaches the machines it was told of) and the one-line warning
    when it, or its ``--public-host``, is loopback-only while one of them is on another machine."""
    from ..net.addresses import LOOPBACK, listen_host_toward, loopback_warning

    told = [args.tracker, *args.more_trackers, *(_dht_contacts(args.dht) or ()), *args.relays, args.cache]
    if args.host is None:
        args.host = listen_host_toward(told) or LOOPBACK
    for value, flag in ((args.host, "--host"), (args.public_host, "--public-host")):
        warning = loopback_warning(f"ggufswarm {args.command}", value, told, flag)
        if warning:
            print(warning, file=sys.stderr, flush=True)


def cmd_node(args) -> int:
    from ..node import NodeConfig, run_node

    _apply_link(args)
    _listen_where_reached(args)
    if args.test_lie:  # before a fetch from the swarm: a typo fails at once
        from ..node.lies import parse_lie

        parse_lie(args.test_lie)
    if args.snapshot_every < 0:
        raise ValueError(f"--snapshot-every must be >= 0, got {args.snapshot_every}")
    if args.layers == "auto" and not args.tracker and args.dht is None:
        raise ValueError("--layers auto picks the range the swarm covers least: it needs --tracker (or give START:END)")
    if args.fetch_timeout <= 0 or args.fetch_stall <= 0:
        raise ValueError(
            f"--fetch-timeout and --fetch-stall must be > 0 seconds, got {args.fetch_timeout:g} "
            f"and {args.fetch_stall:g}"
        )
    if args.cache is not None and not args.cache.startswith(("http://", "https://")):
        raise ValueError(f"--cache must be the cache server's http:// URL, got {args.cache!r}")
    from ..node.memory import tune_malloc

    tune_malloc()
    if args.backend == "llama.cpp":
        from ..node.memory import no_gpu_to_look_for, skip_gpu_drivers

        if no_gpu_to_look_for(args.gpu.lower()):
            skip_gpu_drivers()
    return run_node(
        NodeConfig(
            layers=args.layers,
            embed=args.embed,
            head=args.head,
            model=args.model,
            host=args.host,
            port=args.port,
            dtype=args.dtype,
            backend=args.backend,
            threads=args.threads,
            gpu=args.gpu,
            gpu_blocks=args.gpu_blocks,
            ctx_size=args.ctx_size,
            max_sessions=args.max_sessions,
            batching=args.batching,
            batch_group=args.batch_group,
            kv_budget_tokens=args.kv_budget,
            kv_budget_mb=args.kv_budget_mb,
            session_ttl_s=args.session_ttl,
            hop_timeout_s=args.hop_timeout,
            max_step_tokens=args.max_step_tokens,
            workers=args.workers,
            exit_with_parent=args.exit_with_parent,
            tracker=args.tracker,
            data_dir=args.data_dir,
            memory_budget_mb=args.memory_budget,
            fetch_timeout_s=args.fetch_timeout,
            fetch_stall_s=args.fetch_stall,
            cache=args.cache,
            snapshot_every=args.snapshot_every,
            token=args.token,
            state_checkpoints=args.state_checkpoints,
            dht=_dht_contacts(args.dht),
            model_id=args.model_id,
            reach=args.reach,
            public_host=args.public_host,
            relay=args.relay,
            relays=args.relays,
            more_trackers=args.more_trackers,
            torrent_port=args.torrent_port,
            test_lie=args.test_lie,
        )
    )


def cmd_cache(args) -> int:
    from ..cache.app import CacheConfig, run_cache

    return run_cache(CacheConfig(dir=args.dir, max_bytes=args.max_bytes, token=args.token), args.host, args.port)


def cmd_gateway(args) -> int:
    from ..gateway import GatewayConfig, run_gateway

    check_speculative(args)
    _apply_link(args)
    if not args.route and not args.tracker and not args.join:
        raise ValueError("give --route URL1,URL2,..., --tracker URL or --join LINK")
    if not 0 <= args.verify_rate <= 1:
        raise ValueError(f"--verify-rate must be a fraction in [0, 1], got {args.verify_rate}")
    route = [u.strip() for u in (args.route or "").split(",") if u.strip()]
    chat_template = None
    if args.chat_template_file:
        try:
            chat_template = Path(args.chat_template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template-file: cannot read {args.chat_template_file}: {exc}") from None
        if not chat_template.strip():
            raise ValueError(f"--chat-template-file: {args.chat_template_file} is empty")
    return run_gateway(
        GatewayConfig(
            route=route,
            model=args.model,
            host=args.host,
            port=args.port,
            hop_timeout_s=args.hop_timeout,
            wire_dtype=args.wire_dtype,
            default_max_tokens=args.max_tokens,
            tracker=args.tracker,
            session_lease_s=args.session_lease,
            api_keys=tuple(args.api_key),
            prompt_special=not args.literal_prompts,
            data_dir=args.data_dir,
            chat_template=chat_template,
            token=args.token,
            speculative=args.speculative,
            ring=args.ring,
            draft_max=args.draft_max,
            draft_model=args.draft_model,
            draft_threads=args.draft_threads,
            dht=_dht_contacts(getattr(args, "dht", None)) or (),
            model_id=args.model_id,
            dht_port=args.dht_port,
            more_trackers=args.more_trackers,
            verify_rate=args.verify_rate,
        )
    )


def cmd_demo(args) -> int:
    from ..gateway.demo import run_demo

    check_speculative(args)
    return run_demo(args)


def cmd_tracker(args) -> int:
    from ..net.addresses import is_loopback
    from ..tracker.app import TrackerConfig
    from ..tracker.service import run_tracker

    if args.relay and is_loopback(args.host) and args.public_host and not is_loopback(args.public_host):
        print(
            f"ggufswarm tracker: WARNING: --host {args.host} is loopback-only, but relayed nodes are announced at "
            f"--public-host {args.public_host}: no other machine can reach this tracker or the nodes it relays "
            "(give --host 0.0.0.0 or --host ADDR)",
            file=sys.stderr,
            flush=True,
        )
    if args.witness_age < 0:
        raise ValueError(f"--witness-age must be >= 0 seconds, got {args.witness_age:g}")
    config = TrackerConfig(
        db=args.db,
        ttl_s=args.ttl,
        token=args.token,
        relay=args.relay,
        public_host=args.public_host,
        host=args.host,
        operator_token=_operator_token(args),
        witness_age_s=args.witness_age,
    )
    return run_tracker(config, args.host, args.port)


def _operator_token(args) -> str | None:
    from ..net.auth import OPERATOR_ENV

    return args.operator_token or os.environ.get(OPERATOR_ENV) or None


def cmd_bans(args) -> int:
    import json
    import time

    from ..directory.trackers import TrackerClient

    client = TrackerClient(args.tracker, args.token)
    if args.lift:
        operator = _operator_token(args)
        if not operator:
            raise ValueError(
                "--lift needs the tracker's operator credential: --operator-token or $GGUFSWARM_OPERATOR_TOKEN"
            )
        print(f"lifted the ban of {client.lift(args.lift, operator)['lifted']}")
        return 0
    bans = client.bans()
    if args.json:
        print(json.dumps(bans, indent=1))
        return 0
    for ban in bans:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ban["at"]))
        print(f"{ban['key']}  {at}  {ban.get('reason') or ''}")
    print(f"{len(bans)} ban{'' if len(bans) == 1 else 's'} (--json shows their evidence)")
    return 0


def cmd_publish(args) -> int:
    import json
    from pathlib import Path

    from ..artifact.default_model import model_name, resolve_model
    from ..net.addresses import listen_host_toward, loopback_warning
    from ..net.dht import parse_contact
    from ..net.invite import JoinLink, manifest_digest
    from ..swarm.publish import publish, seed_forever

    if args.host is None:  # seed where the tracker is reached from: the peers it names this seeder to can connect
        args.host = listen_host_toward([args.tracker])
    warning = loopback_warning("ggufswarm publish", args.host, [args.tracker])
    if warning:
        print(warning, file=sys.stderr, flush=True)
    for contact in args.dht:
        parse_contact(contact)  # ValueError naming a malformed one, before the model is indexed
    path = resolve_model(args.model)
    name = args.name or model_name(args.model, path)
    published = publish(path, args.tracker, name, Path(args.data_dir), args.web_seed, args.piece_size, token=args.token)
    m = published.manifest
    print(
        f"published {m.name}: {m.arch}, {m.n_layers} layers, {sum(f['bytes'] for f in m.files)} bytes, "
        f"info-hash {published.info_hash}",
        flush=True,
    )
    link = JoinLink(
        m.name, manifest_digest(json.loads(m.to_json())), tuple(args.dht), trackers=(args.tracker,), secret=args.token
    )
    print(f"join link (nodes: ggufswarm join LINK; it carries the swarm token): {link.format()}", flush=True)
    if not args.no_seed:
        print("seeding; Ctrl-C stops", file=sys.stderr, flush=True)
        seed_forever(published, path, host=args.host)
        print("ggufswarm publish: stopped seeding", file=sys.stderr, flush=True)
    return 0


def cmd_status(args) -> int:
    from ..tracker.service import status_text

    print(status_text(args.tracker, args.token))
    return 0


def cmd_plan(args) -> int:
    import json

    from ..artifact.accounting import MAX_CONTEXT
    from ..artifact.planning import place, plan_json, plan_text
    from ..client.published import load_accounts

    if args.node_memory is None and args.nodes is not None:
        raise ValueError("--nodes places the model on nodes of --node-memory: give both")
    acc, source = load_accounts(args.model, args.tracker, args.token)
    if args.context is None:
        trained = acc.metadata.get(f"{acc.arch}.context_length")
        args.context = min(int(trained), MAX_CONTEXT) if trained else MAX_CONTEXT
    placement = None
    if args.node_memory is not None:
        memory, gpu = args.node_memory
        placement = place(acc, memory, args.context, args.nodes, args.sessions, args.wire_dtype, gpu)
    print(json.dumps(plan_json(acc, placement, source), indent=1) if args.json else plan_text(acc, placement, source))
    return 0


COMMANDS = {
    "generate": cmd_generate,
    "perplexity": cmd_perplexity,
    "node": cmd_node,
    "join": cmd_node,
    "gateway": cmd_gateway,
    "demo": cmd_demo,
    "tracker": cmd_tracker,
    "publish": cmd_publish,
    "status": cmd_status,
    "bans": cmd_bans,
    "cache": cmd_cache,
    "plan": cmd_plan,
}


COMPONENTS = ("tracker", "node", "gateway", "cache")  # what a log line names when its logger is one of theirs


def _log_to_stderr(command: str) -> None:
    """Warnings of the ``ggufswarm`` loggers go to stderr as the commands' own lines do: ``ggufswarm tracker: ...``
    (the component that logged it: the demo runs the tracker in its process), else ``ggufswarm COMMAND: ...``."""
    import logging

    class Named(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            part = record.name.split(".")[1] if record.name.count(".") else ""
            record.component = part if part in COMPONENTS else command
            return super().format(record)

    logger = logging.getLogger("ggufswarm")
    for old in [h for h in logger.handlers if getattr(h, "ggufswarm_cli", False)]:  # main() called again
        logger.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Named("ggufswarm %(component)s: %(message)s"))
    handler.setLevel(logging.WARNING)
    handler.ggufswarm_cli = True
    logger.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ggufswarm`` console script; known errors become one line on stderr, exit 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        parser.error(f"--threads must be at least 1, got {threads}")
    for flag in ("max_tokens", "chunks"):
        value = getattr(args, flag, None)
        if value is not None and value < (1 if flag == "chunks" else 0):
            parser.error(f"--{flag.replace('_', '-')} must be at least {1 if flag == 'chunks' else 0}, got {value}")
    lease = getattr(args, "session_lease", None)
    if lease is not None and not 0 < lease < float("inf"):
        parser.error(f"--session-lease must be a positive number of seconds, got {lease}")
    if getattr(args, "dtype", "float32") != "float32" and getattr(args, "backend", None) == "llama.cpp":
        parser.error(
            f"--dtype {args.dtype} is the torch backend's compute dtype; the llama.cpp backend computes "
            f"as llama.cpp does (add --backend torch)"
        )
    if threads and getattr(args, "backend", None) == "torch":
        import torch

        torch.set_num_threads(threads)
    if hasattr(args, "token"):  # the only place the environment is read: everything else is given the token
        from ..net.auth import TOKEN_ENV

        args.token = args.token or os.environ.get(TOKEN_ENV) or None
    from ..artifact.gguf_file import GGUFError

    _log_to_stderr(args.command)
    try:
        return COMMANDS[args.command](args)
    except (
        GGUFError,
        ValueError,
        OSError,
        RuntimeError,
    ) as exc:  # UnsupportedArchitecture, ContextOverflow: ValueErrors
        print(f"ggufswarm {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ggufswarm {args.command}: interrupted", file=sys.stderr)
        return 130
