"""Command-line flags the runtime commands share, declared once: the engine's (device, activations, expert
memory, MTP), the prefill cache's and the token windows'; and the data check before a run."""

from __future__ import annotations

import argparse
import errno
import os
import sqlite3
import sys
from pathlib import Path

from glmkit.cache.prefix_cache import DEFAULT_CHUNK_TOKENS, DEFAULT_MAX_BYTES, PrefixCache, default_cache_dir
from glmkit.errors import GlmkitError
from glmkit.eval.windows import DEFAULT_CTX, text_windows, token_windows
from glmkit.format.reader import Container
from glmkit.generate.engine import Engine
from glmkit.generate.pipeline import DEFAULT_PIPELINE_CHUNK, PIPELINE_HOPS, pipeline_stages
from glmkit.model.kv_cache import KV_DTYPES
from glmkit.units import parse_gigabytes, parse_size

DEVICE_HELP = "auto (a GPU if any, else the fastest CPU path measured) | numpy | opencl[:platform:device]"
FLOAT_ACTIVATIONS_HELP = ("float inputs to the quantized products (the reference arithmetic, slower) instead of "
                          "int8-quantized ones in the OpenCL decode step and fused int4 experts")


def add_engine_arguments(parser: argparse.ArgumentParser, *, expert_memory: bool = False, mtp: bool = False,
                         pipeline: bool = False) -> None:
    """`--device`, `--float-activations` and `--kv-dtype`; with `expert_memory` also `--ram-budget` and
    `--no-prefetch`, with `mtp` the `--mtp` / `--no-mtp` pair (read by `use_mtp_from_arguments`), with `pipeline` the
    Ray pipeline's flags (`--pipeline`, `--ray-address`, `--pipeline-chunk`, `--pipeline-hops`)."""
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--float-activations", action="store_true", help=FLOAT_ACTIVATIONS_HELP)
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="f32",
                        help="precision of the KV rows in memory and in the prefill cache: f32 (exact, default), "
                             "f16 (half the bytes, the closer of the two 16-bit types), bf16 (half the bytes) or fp8 "
                             "(e4m3 with a scale per row, about a quarter)")
    if pipeline:
        group = parser.add_argument_group("pipeline parallelism over Ray (pip install \"glmkit[distributed]\")")
        group.add_argument("--pipeline", type=_pipeline_stages, metavar="N|auto",
                           help="split the decoder layers by bytes over N Ray actors (stages), spread over the "
                                "cluster's machines; auto: one stage per node, split by each node's memory")
        group.add_argument("--ray-address", metavar="ADDR",
                           help="the Ray cluster to use (default: the one `ray start` made on this machine, else a "
                                "new local one)")
        group.add_argument("--pipeline-chunk", type=int, default=DEFAULT_PIPELINE_CHUNK, metavar="N",
                           help="prompt tokens per piece streamed through the stages (default %(default)s)")
        group.add_argument("--pipeline-hops", choices=PIPELINE_HOPS, default="auto",
                           help="how a token's hidden state goes stage to stage: graph (a Ray compiled graph of "
                                "shared-memory channels: faster hops, but every waiting stage and the head poll a "
                                "core while tokens flow), tasks (a Ray actor task per stage) or auto (the default: "
                                "graph where the stages decode on the device step, else tasks)")
    if expert_memory:
        parser.add_argument("--max-context", type=int, metavar="N",
                            help="the most tokens a sequence may hold, prompt and reply (default: the model's "
                                 "max_position_embeddings, or what the RAM holds the KV rows of beside an expert "
                                 "cache sized from it); such a cache keeps room for the KV rows of that many tokens "
                                 "(glm-serve's sessions share it) and holds experts in it while the rows leave it "
                                 "empty")
        parser.add_argument("--ram-budget", type=parse_size, default=0, metavar="SIZE",
                            help="pin the hottest routed experts in RAM up to SIZE (e.g. 8G); default 0 = page "
                                 "cache only")
        parser.add_argument("--expert-cache", type=expert_cache_size, default=None, metavar="SIZE|auto|off",
                            help="keep routed experts in a cache of SIZE (e.g. 96G) read with pread, or 'auto' "
                                 "(sized from the RAM the process may use), instead of the page cache ('off'); "
                                 "default: auto where the model is larger than that RAM, else off")
        parser.add_argument("--no-prefetch", action="store_true", help="disable router-driven expert prefetch")
    if mtp:
        group = parser.add_mutually_exclusive_group()
        group.add_argument("--mtp", action="store_true",
                           help="MTP speculative decoding even where it is off by default")
        group.add_argument("--no-mtp", action="store_true",
                           help="disable MTP speculative decoding (default: on; on a device decode step, on where "
                                "a draft's verification measured cheaper than two single tokens)")


def _pipeline_stages(text: str) -> int | str:
    try:
        return pipeline_stages(text)
    except GlmkitError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--pipeline: ")) from None


def expert_cache_size(text: str) -> int | str:
    """`--expert-cache`: "auto", "off" (0) or a size."""
    if text == "auto":
        return "auto"
    return 0 if text == "off" else parse_size(text)


def engine_from_arguments(args: argparse.Namespace, load_tokenizer: bool = True) -> Engine:
    """The Engine `add_engine_arguments`' flags describe, on `args.snapshot` (no expert-memory flags: defaults).
    An expert cache saves its usage scores beside the prefill cache (`experts/` next to its directory). With
    `--pipeline`, a `PipelineEngine` whose stages run on the Ray cluster."""
    if getattr(args, "pipeline", None) is not None:
        return pipeline_engine_from_arguments(args, load_tokenizer)
    engine = Engine(args.snapshot, args.device, getattr(args, "ram_budget", 0),
                    prefetch=not getattr(args, "no_prefetch", False), load_tokenizer=load_tokenizer,
                    float_activations=args.float_activations, expert_cache=getattr(args, "expert_cache", None),
                    expert_usage_dir=default_cache_dir().parent, kv_dtype=args.kv_dtype,
                    max_context=getattr(args, "max_context", None),
                    announce=lambda line: print(line, file=sys.stderr, flush=True))
    return engine


def pipeline_engine_from_arguments(args: argparse.Namespace, load_tokenizer: bool = True) -> Engine:
    """The `PipelineEngine` of `--pipeline`: `--expert-cache` is each stage's (for its layers, in its machine's RAM);
    `--ram-budget` is refused."""
    if getattr(args, "ram_budget", 0):
        raise GlmkitError("--ram-budget: not with --pipeline (each stage keeps its experts in an expert cache or "
                          "its page cache: --expert-cache)")
    if args.pipeline_chunk < 1:
        raise GlmkitError(f"--pipeline-chunk: must be >= 1, got {args.pipeline_chunk}")
    if isinstance(args.pipeline, int):  # before Ray starts, and before a plan sized by the count is made
        container = Container(args.snapshot)
        layers = container.config.num_hidden_layers
        container.close()
        if args.pipeline > layers:
            raise GlmkitError(f"--pipeline {args.pipeline}: the model has only {layers} decoder layers")
    from glmkit.generate.pipeline import PipelineEngine

    return PipelineEngine(args.snapshot, args.pipeline, args.ray_address, args.device, args.float_activations,
                          prefetch=not getattr(args, "no_prefetch", False), chunk=args.pipeline_chunk,
                          load_tokenizer=load_tokenizer, kv_dtype=args.kv_dtype, hops=args.pipeline_hops,
                          max_context=getattr(args, "max_context", None),
                          expert_cache=getattr(args, "expert_cache", None),
                          expert_usage_dir=default_cache_dir().parent)


def use_mtp_from_arguments(engine: Engine, args: argparse.Namespace) -> bool:
    """MTP speculative decoding as `--mtp` / `--no-mtp` ask, else the engine's default."""
    return engine.use_mtp(args.mtp, args.no_mtp)


def add_cache_arguments(parser: argparse.ArgumentParser, title: str, no_cache_help: str
                        ) -> argparse._ArgumentGroup:
    """The prefill cache's flags (`--cache-dir`, `--no-cache`, `--cache-max-gb`, `--chunk-tokens`) in a group
    called `title`; returns the group for a command's own cache flags."""
    group = parser.add_argument_group(title)
    group.add_argument("--cache-dir", type=Path, help=f"where KV blobs live (default {default_cache_dir()})")
    group.add_argument("--no-cache", action="store_true", help=no_cache_help)
    group.add_argument("--cache-max-gb", type=parse_gigabytes, default=DEFAULT_MAX_BYTES / (1 << 30),
                       help="evict least-recently-used entries beyond this size (default %(default).0f)")
    group.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                       help="cache boundary every N tokens (default %(default)s); request ends are stored too")
    return group


def check_cache_arguments(args: argparse.Namespace) -> None:
    """What can be refused in `add_cache_arguments`' flags before a model is opened."""
    if args.chunk_tokens < 1:
        raise GlmkitError(f"--chunk-tokens: must be >= 1, got {args.chunk_tokens}")


def open_prefix_cache(engine: Engine, args: argparse.Namespace, use_mtp: bool) -> PrefixCache:
    """The prefill cache `add_cache_arguments`' flags describe, for this engine's model and MTP setting."""
    directory = args.cache_dir or default_cache_dir()
    try:
        return PrefixCache.for_model(engine.model, engine.model_hash, directory, use_mtp,
                                     args.chunk_tokens, int(args.cache_max_gb * (1 << 30)))
    except (OSError, sqlite3.Error) as e:
        raise GlmkitError(f"--cache-dir: cannot use {directory} ({e})") from None


def add_window_arguments(parser: argparse.ArgumentParser) -> None:
    """The token windows a command runs over: `--text` or `--tokens` (one required), `--ctx`, `--max-windows`."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", type=Path, metavar="FILE", help="UTF-8 text, tokenized and cut into --ctx windows")
    src.add_argument("--tokens", type=Path, metavar="FILE", help="JSON list of token-id lists, one window each")
    parser.add_argument("--ctx", type=int, default=DEFAULT_CTX,
                        help=f"window length for --text (default {DEFAULT_CTX})")
    parser.add_argument("--max-windows", type=int, metavar="N", help="use only the first N windows")


def check_window_arguments(args: argparse.Namespace) -> None:
    """What can be refused before a model is opened."""
    if args.max_windows is not None and args.max_windows < 1:
        raise GlmkitError(f"--max-windows: must be at least 1, got {args.max_windows}")


def check_output_path(path: Path, flag: str) -> None:
    """Refuse, before a model is opened, an output path no file can be renamed onto: a directory, or a path in a
    missing directory (the file is only renamed into place when the work is done)."""
    if path.is_dir():
        raise GlmkitError(f"{flag}: cannot write {path} ({os.strerror(errno.EISDIR)})")
    if not path.parent.is_dir():
        raise GlmkitError(f"{flag}: cannot write {path} (no directory {path.parent})")


def windows_from_arguments(engine: Engine, args: argparse.Namespace) -> list[list[int]]:
    """The windows `add_window_arguments` describes (the engine needs its tokenizer for `--text`)."""
    windows = (text_windows(engine, args.text, args.ctx) if args.text is not None
               else token_windows(args.tokens, engine.config.vocab_size))
    return windows[:args.max_windows]


def verify_snapshot_data(container: Container) -> None:
    """Recompute every tensor's sha256 (reads the whole snapshot once); a GlmkitError names the data file and the
    tensor whose bytes no longer match the manifest (bit rot, an incomplete copy)."""
    bad = container.verify_data()
    if bad:
        entry = container.manifest.tensors[bad[0]]
        others = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise GlmkitError(f"{container.directory / entry.file}: tensor {bad[0]!r}{others} does not match its sha256 "
                          "in the manifest (the data changed after conversion: copy or convert it again)")
