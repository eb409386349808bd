"""`glm-serve SNAPSHOT`: an OpenAI-compatible HTTP server over one converted snapshot (loaded once)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sqlite3
import sys
from pathlib import Path

from glmkit.cache.prefix_cache import DEFAULT_CHUNK_TOKENS, DEFAULT_MAX_BYTES, PrefixCache, default_cache_dir
from glmkit.errors import GlmkitError
from glmkit.generate.engine import FLOAT_ACTIVATIONS_HELP, Engine
from glmkit.serve.app import Loaded, SamplingDefaults, ServeConfig, create_app
from glmkit.serve.scheduler import Scheduler
from glmkit.units import parse_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm-serve", description=__doc__)
    p.add_argument("snapshot", type=Path, help="converted container directory (from glm-convert)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default %(default)s)")
    p.add_argument("--model-name", help="the model id clients use (default: the snapshot directory's name)")
    p.add_argument("--api-key", default=os.environ.get("GLM_SERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default $GLM_SERVE_API_KEY; unset = no auth)")
    p.add_argument("--max-request-size", type=parse_size, default=16 << 20, metavar="SIZE",
                   help="larger request bodies get 413 (default 16M)")
    p.add_argument("--parallel", type=int, default=4, metavar="N",
                   help="requests generating at once, round-robin, each with its own KV session (default 4)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting beyond --parallel before 429 (default 64)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                   help="prefill long prompts N tokens per scheduling step (default 512)")
    p.add_argument("--default-max-tokens", type=int, default=4096, metavar="N",
                   help="reply limit when a request sets no max_tokens (default 4096; the context caps it too)")
    p.add_argument("--split-reasoning", action="store_true",
                   help="chat: return the text before </think> as message.reasoning_content, not content")
    mtp = p.add_mutually_exclusive_group()
    mtp.add_argument("--mtp", action="store_true", help="MTP speculative decoding even where it is off by default")
    mtp.add_argument("--no-mtp", action="store_true",
                     help="disable MTP speculative decoding (default: on, except on a device decode step)")
    p.add_argument("--device", default="auto", help="auto | numpy | opencl[:platform:device]")
    p.add_argument("--float-activations", action="store_true", help=FLOAT_ACTIVATIONS_HELP)
    p.add_argument("--ram-budget", type=parse_size, default=0, metavar="SIZE",
                   help="pin the hottest routed experts in RAM up to SIZE (default 0)")
    p.add_argument("--no-prefetch", action="store_true", help="disable router-driven expert prefetch")
    cache = p.add_argument_group("prefill cache")
    cache.add_argument("--cache-dir", type=Path, help=f"where KV blobs live (default {default_cache_dir()})")
    cache.add_argument("--no-cache", action="store_true",
                       help="no reuse at all: every request prefills its whole prompt (for comparisons)")
    cache.add_argument("--cache-max-gb", type=float, default=DEFAULT_MAX_BYTES / (1 << 30),
                       help="evict least-recently-used entries beyond this size (default %(default).0f)")
    cache.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                       help="cache boundary every N tokens (default %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port < 65536:
        raise GlmkitError(f"--port: must be in 0..65535, got {args.port}")
    for name in ("parallel", "prefill_chunk", "default_max_tokens", "chunk_tokens"):
        if getattr(args, name) < 1:
            raise GlmkitError(f"--{name.replace('_', '-')}: must be >= 1")
    if args.max_queue < 0 or args.cache_max_gb < 0 or args.max_request_size < 1:
        raise GlmkitError("--max-queue and --cache-max-gb must be >= 0, --max-request-size >= 1")
    if not (args.snapshot / "manifest.json").is_file():
        raise GlmkitError(f"{args.snapshot}: not a converted snapshot (no manifest.json; run glm-convert first)")


def generation_defaults(snapshot: Path) -> SamplingDefaults:
    """temperature / top_p / top_k from the snapshot's generation_config.json (do_sample false = greedy)."""
    defaults = SamplingDefaults()
    path = snapshot / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return defaults
    if not isinstance(config, dict):
        return defaults
    if config.get("do_sample") is False:
        return SamplingDefaults(temperature=0.0)
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
        value = config.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            setattr(defaults, name, kind(value))
    if not 0 <= defaults.temperature <= 2 or not 0 < defaults.top_p <= 1 or defaults.top_k < 0:
        return SamplingDefaults()
    return defaults


def make_loader(args: argparse.Namespace):
    def load() -> Loaded:
        engine = Engine(args.snapshot, args.device, args.ram_budget, prefetch=not args.no_prefetch,
                        float_activations=args.float_activations)
        if engine.tokenizer is None or engine.tokenizer.chat_template is None:
            logging.getLogger("glmkit.serve").warning("the snapshot has no chat template: only /v1/completions works")
        directory = args.cache_dir or default_cache_dir()
        use_mtp = engine.use_mtp(args.mtp, args.no_mtp)

        def open_cache() -> PrefixCache:
            try:
                return PrefixCache.for_model(engine.model, engine.model_hash, directory, use_mtp,
                                             args.chunk_tokens, int(args.cache_max_gb * (1 << 30)))
            except (OSError, sqlite3.Error) as e:
                raise GlmkitError(f"--cache-dir: cannot use {directory} ({e})") from None

        scheduler = Scheduler(engine, prefix_cache=open_cache, use_mtp=use_mtp, reuse=not args.no_cache,
                              max_active=args.parallel, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk)
        scheduler.start()
        return Loaded(engine, scheduler, generation_defaults(args.snapshot))
    return load


def build_app(args: argparse.Namespace, on_load_error=None):
    config = ServeConfig(model_name=args.model_name or args.snapshot.resolve().name, api_key=args.api_key or None,
                         max_request_bytes=args.max_request_size, default_max_tokens=args.default_max_tokens,
                         split_reasoning=args.split_reasoning)
    return create_app(config, make_loader(args), on_load_error)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except GlmkitError as e:
        print(f"glm-serve: error: {e}", file=sys.stderr)
        return 1
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failed: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_error(message: str) -> None:  # stop serving: a server that cannot load is of no use
        failed.append(message)
        if server is not None:
            server.should_exit = True

    app = build_app(args, on_load_error)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"glm-serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                          timeout_graceful_shutdown=5))
    server.run()
    if failed:
        print(f"glm-serve: error: {failed[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
