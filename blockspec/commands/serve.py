"""`blockspec serve`: an OpenAI-compatible HTTP server with continuous batching.

    blockspec serve --port 30000      # the demo model, its shipped drafter, adaptive blocks, lookup
    curl http://127.0.0.1:30000/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse
import os
import sys

from blockspec.config import SpecConfig
from blockspec.commands.heap import freeze_loaded
from blockspec.commands.model_args import add_runtime_arguments, load_kwargs

HELP = "OpenAI-compatible HTTP server with continuous batching"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_runtime_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port (default 30000; 0 = any free port)")
    parser.add_argument("--served-model-name", default=None, help="model name clients send (default: the target name)")
    parser.add_argument("--api-key", default=os.environ.get("BLOCKSPEC_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: $BLOCKSPEC_API_KEY; unset = no key)")
    parser.add_argument("--max-batch", type=int, default=16, help="requests decoded together per step (default 16)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="waiting requests beyond the batch; more get HTTP 429 (default 64)")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="larger request bodies are answered 413 unread (default 4 MiB)")
    parser.add_argument("--drain-timeout", type=float, default=None,
                        help="on SIGTERM/SIGINT: seconds running requests may still take while new ones get 503; "
                             "then open answers end (finish_reason 'length') and the server exits (default 25)")
    parser.add_argument("--keep-alive", type=float, default=None,
                        help="seconds an idle HTTP keep-alive connection stays open; keep it above the idle time "
                             "of your clients' connection pools, or a reused connection fails with 'Server "
                             "disconnected' (default 120)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def run(args: argparse.Namespace) -> int:
    from blockspec.api import load
    from blockspec.engine import EngineConfig
    from blockspec.errors import ConfigError
    from blockspec.server.app import DEFAULT_DRAIN_S, DEFAULT_MAX_REQUEST_BYTES, create_app
    from blockspec.server.launch import KEEP_ALIVE_S, bind, serve_forever, url_of

    max_bytes = DEFAULT_MAX_REQUEST_BYTES if args.max_request_bytes is None else args.max_request_bytes
    drain_s = DEFAULT_DRAIN_S if args.drain_timeout is None else args.drain_timeout
    if max_bytes < 1024:
        raise ConfigError(f"--max-request-bytes must be at least 1024, got {max_bytes}")
    if not drain_s >= 0:
        raise ConfigError(f"--drain-timeout must be a number of seconds >= 0, got {drain_s}")
    keep_alive_s = KEEP_ALIVE_S if args.keep_alive is None else args.keep_alive
    if not keep_alive_s > 0:
        raise ConfigError(f"--keep-alive must be a number of seconds > 0, got {keep_alive_s}")
    sock = bind(args.host, args.port)  # before loading: a busy port fails in a second, not a minute
    try:
        pipeline = load(**load_kwargs(args))
        spec = SpecConfig(block_size=pipeline.block_size, adaptive=pipeline.adaptive_block, lookup=pipeline.lookup,
                          tree_nodes=pipeline.tree_nodes)
        config = EngineConfig(spec, max_batch=args.max_batch, max_queue=args.max_queue)
        app = create_app(pipeline, engine_config=config, served_model_name=args.served_model_name,
                         api_key=args.api_key, max_request_bytes=max_bytes)
        state = app.state.blockspec
        freeze_loaded()
        drafter = pipeline.drafter_source or ("none" if pipeline.drafter is None else "fresh")
        print(f"serving {state.served_model_name!r} (drafter: {drafter}, block size "
              f"{'adaptive, up to ' if pipeline.adaptive_block else ''}{pipeline.block_size}, "
              f"compute {pipeline.compute}) "
              f"at {url_of(sock)}/v1", flush=True)
        if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
            print("warning: listening beyond loopback without --api-key", file=sys.stderr, flush=True)
        serve_forever(app, sock, log_level=args.log_level, drain_s=drain_s, keep_alive_s=keep_alive_s)
    finally:
        sock.close()
    return 0
