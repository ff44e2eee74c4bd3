"""Commands that serve, and the tools a server's operator needs: serve, mcp-stdio, agent-key, schemas."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli.flags import LIVE, SEARCH, add_settings
from engine.store.index_dir import MANIFEST_FILE
from serving.settings import Settings

SERVE_SETTINGS = [
    "data_dir",
    *SEARCH,
    *LIVE,
    *Settings.part_fields("serving"),
    *Settings.part_fields("security"),
    *Settings.part_fields("telemetry"),
    *Settings.part_fields("agents"),
    *Settings.part_fields("scale_out"),
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve MCP + REST (port 8000) and the A2A agent (port 9010)",
        description="Serve the index: MCP + REST on --mcp-port, the A2A agent on --a2a-port, the agent message"
        " protocol at /v1. With --ray: one port (--mcp-port) for MCP + REST at / and the A2A agent at /a2a/,"
        " search replicas (doors and retrieval), a reranker deployment (a GPU each when the cluster has GPUs)"
        " that batches queries across replicas, and one writer the replicas follow (none with --read-only);"
        " the index directory must be at the same path on every node. With --workers N: N processes on the same"
        " ports, one writing the index and the others following what it publishes.",
        epilog="examples:\n  hybrid-search serve --build-if-missing\n"
        "  hybrid-search serve --index-dir indexes/docs --host 0.0.0.0 --reranker ../models/reranker\n"
        "  hybrid-search serve --workers 4\n"
        "  hybrid-search serve --indexes indexes   # each index folder in it, by name (docs/collections.md)\n"
        "  hybrid-search serve --ray --search-replicas 2-8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings(p, SERVE_SETTINGS)
    p.set_defaults(run=serve, answers_queries=True)

    p = sub.add_parser("mcp-stdio", help="serve the MCP tool over stdio, for hosts that launch tools")
    add_settings(p, SEARCH)
    p.set_defaults(run=mcp_stdio, answers_queries=True)

    p = sub.add_parser("schemas", help="JSON Schemas of the agent message protocol's messages")
    p.add_argument("--out", type=Path, help="folder to write <TYPE>.schema.json into (default: print)")
    p.set_defaults(run=schemas)

    p = sub.add_parser(
        "agent-key",
        help="make a key for an agent of the message protocol (prints the hashed entry for --agent-keys)",
        epilog="example:\n  hybrid-search agent-key IngestionAgent --types DOCUMENT_INGESTION >> agent-keys.toml\n"
        "  hybrid-search serve --agent-keys agent-keys.toml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("agent_id", help="the agent the key speaks for (the messages' sender)")
    p.add_argument("--types", required=True, help="message types it may send, comma-separated")
    p.add_argument("--rate", help="its rate limit, e.g. 60/minute (default: --agent-rate)")
    p.set_defaults(run=agent_key)


def serve(settings: Settings, args: argparse.Namespace) -> int:
    from serving.app import check_ports, door_ports, run_servers

    s, ray = settings.serving, settings.scale_out.ray
    if not s.mcp and not s.a2a:
        raise ValueError("--no-mcp and --no-a2a together leave nothing to serve")
    if ray and (not s.mcp or not s.a2a or s.mcp_url):
        raise ValueError("--ray serves MCP + REST and A2A on one port; leave out --no-mcp, --no-a2a and --mcp-url")
    if ray and settings.security.tls_cert is not None:
        raise ValueError("--ray serves through Ray Serve's proxy, which has no TLS here: terminate TLS in front of it")
    if ray and s.workers != 1:
        raise ValueError("--ray scales with --search-replicas, not --workers: leave out --workers")
    # every check of the arguments and the index that can fail runs before the ports are probed: a
    # mistake is named as itself, not as a port some other server holds
    on_ray = ray_app() if ray else None  # Ray not installed: say how to get it
    _check_doors(settings)
    doors = {"mcp": s.mcp, "a2a": s.a2a, "mcp_url": s.mcp_url}
    ports = {"mcp": s.mcp_port} if ray else door_ports(settings, **doors)  # Ray: one port
    engine = "mcp" in ports  # not an A2A door searching through another server's --mcp-url
    if s.indexes is not None:  # collections: each folder of DIR is checked as it opens
        if not Path(s.indexes).is_dir():
            raise ValueError(f"--indexes {s.indexes}: not a directory (make it; `init --index-dir DIR/NAME` adds one)")
        engine = False
    build = s.build_if_missing and not (Path(settings.engine.index_dir) / MANIFEST_FILE).is_file()
    if engine and not build:
        _check_index(settings)
    check_ports(ports, s.host)  # before a build or an engine's load (minutes)
    if build:
        from cli.index import build_from

        # here, not on Ray; serve's --llm-url is for answers: the build asks it for no pseudo-queries
        build_from(settings.with_values(llm_url=None, ray=False))
        if engine:
            _check_index(settings)
    if on_ray is not None:
        on_ray.run_on_ray(settings, writable=not s.read_only)
        return 0
    doors["writable"] = not s.read_only
    if settings.serving.worker_count() > 1:
        from serving.workers import run_workers

        run_workers(settings, **doors)
    else:
        run_servers(settings, **doors)
    return 0


def _check_doors(settings: Settings) -> None:
    """What the doors read at start, read now: the TLS files, the agent keys (a bad file or rate, or
    none with --key-all-doors)."""
    from serving.protocol_routes import load_keys
    from serving.tls import tls_options

    tls_options(settings)
    keys = load_keys(settings.security.agent_keys, settings.security.agent_rate)
    if settings.security.key_all_doors and not keys:
        raise ValueError("--key-all-doors needs --agent-keys with at least one key")


def _check_index(settings: Settings) -> None:
    """The index can be served as asked: it is there (one process and Ray; each of ``--workers N``
    says itself what is wrong with it), and in one shard unless served in one process or on Ray."""
    from engine.store.index_dir import IndexDirError, read_manifest

    workers = settings.serving.worker_count() > 1 and not settings.scale_out.ray
    try:
        shards = read_manifest(settings.engine.index_dir).shards
    except IndexDirError:
        if workers:  # a worker says what is wrong with it, as for one process
            return
        raise
    if workers and shards:
        raise ValueError(
            f"{settings.engine.index_dir} is in {shards} shards: serve it in one process (--workers 1) or on Ray"
            " (--ray), not with --workers"
        )


def mcp_stdio(settings: Settings, args: argparse.Namespace) -> int:
    from serving.mcp_tool import run_stdio

    run_stdio(settings)
    return 0


def schemas(settings: Settings, args: argparse.Namespace) -> int:
    """Write the JSON Schema of every agent-protocol message into a folder (or print them)."""
    from agents.messages import schemas as all_schemas

    found = all_schemas()
    if args.out is None:
        print(json.dumps(found, indent=2))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, schema in found.items():
        (args.out / f"{name}.schema.json").write_text(json.dumps(schema, indent=2) + "\n")
    print(f"wrote {len(found)} schemas to {args.out}")
    return 0


def agent_key(settings: Settings, args: argparse.Namespace) -> int:
    """A new random key for an agent: the key once, and the hashed entry for the keys file."""
    import secrets

    from serving.protocol_routes import hash_key

    key = "hsk-" + secrets.token_urlsafe(32)
    types = ", ".join(json.dumps(t) for t in args.types.split(",") if t)
    print(f"# key for {args.agent_id} (shown once; send it as 'Authorization: Bearer <key>'):\n# {key}")
    print(f'[agents.{args.agent_id}]\nkey_sha256 = "{hash_key(key)}"\nmessage_types = [{types}]')
    if args.rate:
        print(f'rate = "{args.rate}"')
    return 0


def ray_app():
    """:mod:`serving.ray_app`, or a clear error when the optional Ray extra is not installed."""
    try:
        from serving import ray_app
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("ray"):
            raise
        raise RuntimeError("--ray needs Ray: pip install 'hybrid-search[ray]'") from None
    return ray_app
