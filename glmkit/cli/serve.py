"""`glm-serve SNAPSHOT`: an OpenAI-compatible HTTP server over one converted snapshot (loaded once)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from glmkit.cli.common import (
    add_cache_arguments,
    add_engine_arguments,
    check_cache_arguments,
    engine_from_arguments,
    open_prefix_cache,
    use_mtp_from_arguments,
)
from glmkit.errors import GlmkitError
from glmkit.generate.tokenizer import read_side_json
from glmkit.serve.app import Loaded, SamplingDefaults, ServeConfig, create_app
from glmkit.serve.scheduler import Scheduler
from glmkit.units import parse_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm-serve", description=__doc__)
    p.add_argument("snapshot", type=Path, help="converted container directory (from glm-convert)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default %(default)s)")
    p.add_argument("--model-name", help="the model id clients use (default: the snapshot directory's name)")
    p.add_argument("--model-alias", action="append", default=[], metavar="NAME",
                   help="another model id requests may name, e.g. the one an agent sends (repeatable; '*': any id); "
                        "replies give --model-name")
    p.add_argument("--api-key", default=os.environ.get("GLM_SERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default $GLM_SERVE_API_KEY; unset = no auth)")
    p.add_argument("--max-request-size", type=parse_size, default=16 << 20, metavar="SIZE",
                   help="larger request bodies get 413 (default 16M)")
    p.add_argument("--parallel", type=int, default=4, metavar="N",
                   help="requests generating at once, each with its own KV session (default 4)")
    p.add_argument("--max-batch", type=int, metavar="N",
                   help="decoding requests per batched forward (default: --parallel where batching pays: on the "
                        "NumPy backend, and on a CPU OpenCL decode step where a forward of two sequences measured "
                        "faster per token than single tokens; else 1, e.g. on a discrete GPU; 1: each request "
                        "decodes on its own in turn)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting beyond --parallel before 429 (default 64)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                   help="prefill long prompts N tokens per scheduling step (default 512; under an expert cache "
                        "a span as long as memory allows: each step reads the experts it routes to once)")
    p.add_argument("--default-max-tokens", type=int, default=4096, metavar="N",
                   help="reply limit when a request sets no max_tokens (default 4096; the context caps it too)")
    p.add_argument("--split-reasoning", action="store_true",
                   help="chat: return the text before </think> as message.reasoning_content, not content")
    add_engine_arguments(p, expert_memory=True, mtp=True, pipeline=True)
    add_cache_arguments(p, "prefill cache",
                        "no reuse at all: every request prefills its whole prompt (for comparisons)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port < 65536:
        raise GlmkitError(f"--port: must be in 0..65535, got {args.port}")
    for name in ("parallel", "prefill_chunk", "default_max_tokens", "max_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise GlmkitError(f"--{name.replace('_', '-')}: must be >= 1")
    if args.max_queue < 0:
        raise GlmkitError(f"--max-queue: must be >= 0, got {args.max_queue}")
    if args.max_request_size < 1:
        raise GlmkitError(f"--max-request-size: must be >= 1 byte, got {args.max_request_size}")
    check_cache_arguments(args)
    if not (args.snapshot / "manifest.json").is_file():
        raise GlmkitError(f"{args.snapshot}: not a converted snapshot (no manifest.json; run glm-convert first)")


def generation_defaults(snapshot: Path) -> SamplingDefaults:
    """temperature / top_p / top_k from the snapshot's generation_config.json (do_sample false = greedy)."""
    defaults = SamplingDefaults()
    path = snapshot / "generation_config.json"
    config = read_side_json(path) if path.exists() else {}
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
        engine = engine_from_arguments(args)
        if engine.tokenizer is None or engine.tokenizer.chat_template is None:
            logging.getLogger("glmkit.serve").warning("the snapshot has no chat template: only /v1/completions works")
        use_mtp = use_mtp_from_arguments(engine, args)
        scheduler = Scheduler(engine, prefix_cache=lambda: open_prefix_cache(engine, args, use_mtp), use_mtp=use_mtp,
                              reuse=not args.no_cache, max_active=args.parallel, max_queue=args.max_queue,
                              prefill_chunk=args.prefill_chunk, max_batch=args.max_batch)
        scheduler.start()
        return Loaded(engine, scheduler, generation_defaults(args.snapshot))
    return load


def build_app(args: argparse.Namespace, on_load_error=None):
    config = ServeConfig(model_name=args.model_name or args.snapshot.resolve().name,
                         model_aliases=tuple(args.model_alias), api_key=args.api_key or None,
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
