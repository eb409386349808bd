"""`glm-run SNAPSHOT`: one-shot generation (`-p`) or interactive chat (`--chat`), streamed to stdout."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmkit.cache.prefix_cache import default_cache_dir
from glmkit.cache.session import (
    DEFAULT_RECOMPUTE_RATIO,
    DEFAULT_SIMILARITY,
    ApproxPolicy,
    ReuseStats,
    Session,
    load_messages,
    save_messages,
    session_path,
)
from glmkit.cli.common import (
    add_cache_arguments,
    add_engine_arguments,
    check_cache_arguments,
    engine_from_arguments,
    open_prefix_cache,
    use_mtp_from_arguments,
    verify_snapshot_data,
)
from glmkit.errors import GlmkitError
from glmkit.format.reader import Container
from glmkit.generate.engine import Engine, default_expert_cache
from glmkit.generate.generator import GenerationStats, Generator
from glmkit.generate.sampling import Sampler, SamplingParams
from glmkit.generate.tokenizer import StreamDecoder
from glmkit.model.kv_cache import KVCache, kv_bytes_per_token
from glmkit.units import format_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm-run", description=__doc__)
    p.add_argument("snapshot", help="converted container directory (from glm-convert)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("-p", "--prompt", help="generate a reply to this prompt and exit")
    mode.add_argument("--chat", action="store_true", help="interactive multi-turn chat (history kept; /exit quits)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--raw-prompt", action="store_true", help="feed -p as plain text, without the chat template")
    p.add_argument("--no-think", action="store_true", help="render the chat template with enable_thinking=False")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per reply (default %(default)s)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, help="sampling seed")
    add_engine_arguments(p, expert_memory=True, mtp=True)
    p.add_argument("--list-devices", action="store_true",
                   help="list OpenCL platforms and devices with memory and measured bandwidths, then exit "
                        "(glm-run --list-devices; glm-run SNAPSHOT --list-devices also says where its routed "
                        "experts would live: the page cache or an expert cache, its size and why)")
    p.add_argument("--stats-json", type=Path, metavar="PATH", help="write timing/memory statistics here")
    p.add_argument("--verify", action="store_true",
                   help="before running, check every tensor's bytes against the sha256 in the manifest (reads the "
                        "whole snapshot once)")
    cache = add_cache_arguments(p, "prefill cache (exact prefix reuse across requests and processes)",
                                "neither read nor write the prefill cache")
    cache.add_argument("--session", metavar="NAME",
                       help="with --chat: save the conversation under NAME and resume it on the next run")
    cache.add_argument("--reuse", choices=("exact", "approximate"), default="exact",
                       help="exact (default): reuse only an identical prefix, bit-exact; approximate: also reuse "
                            "chunks stored at other positions (re-rotated, partly recomputed; changes the output)")
    cache.add_argument("--reuse-threshold", type=float, default=DEFAULT_SIMILARITY, metavar="COS",
                       help="approximate: cosine similarity a similar, non-identical chunk needs (default "
                            "%(default)s; above 1 = identical chunks only)")
    cache.add_argument("--recompute-ratio", type=float, default=DEFAULT_RECOMPUTE_RATIO, metavar="R",
                       help="approximate: fraction of each reused span recomputed, from its start "
                            "(default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if "--list-devices" in words:
        from glmkit.backends.devices import list_devices_report

        print(list_devices_report())
        snapshot = next((w for w in words if not w.startswith("-")), None)  # glm-run SNAP --list-devices
        if snapshot is not None:
            try:
                container = Container(snapshot)
                print(f"{snapshot}: {default_expert_cache(container)[1]}")
                cfg = container.config
                print(f"{snapshot}: context {cfg.max_position_embeddings:,} tokens; KV cache "
                      f"{format_size(kv_bytes_per_token(cfg))} per token (f32), "
                      f"{format_size(kv_bytes_per_token(cfg) * cfg.max_position_embeddings)} at the full context")
            except GlmkitError as e:
                print(f"glm-run: error: {e}", file=sys.stderr)
                return 2
        return 0
    args = build_parser().parse_args(argv)
    try:
        params = SamplingParams(args.temp, args.top_p, args.top_k, args.seed).check()
        if args.max_tokens < 1:
            raise GlmkitError(f"--max-tokens: must be >= 1, got {args.max_tokens}")
        check_cache_arguments(args)
        if args.session and not args.chat:
            raise GlmkitError("--session: only with --chat")
        policy = approx_policy(args)
        engine = engine_from_arguments(args)
        try:
            if args.verify:
                verify_snapshot_data(engine.container)
            use_mtp = use_mtp_from_arguments(engine, args)
            prefix_cache = None if args.no_cache else open_prefix_cache(engine, args, use_mtp)
            session = Session(engine.model, prefix_cache, policy)
            generator = Generator(engine.model, engine.eos_token_ids, use_mtp=use_mtp,
                                  checkpoint=session.store_progress)
            if args.chat:
                turns = chat(engine, generator, session, params, args)
            else:
                turns = [one_shot(engine, generator, session, Sampler(params), args)]
            if args.stats_json:
                write_stats(args.stats_json, turns, engine, per_turn=args.chat)
        finally:
            engine.close()  # the expert cache's usage scores, for the next run
    except GlmkitError as e:
        print(f"glm-run: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def approx_policy(args: argparse.Namespace) -> ApproxPolicy | None:
    """The approximate-reuse settings of `--reuse approximate`, or None for exact reuse only."""
    if args.reuse == "exact":
        return None
    if args.no_cache:
        raise GlmkitError("--reuse approximate: needs the prefill cache (drop --no-cache)")
    if not 0 <= args.recompute_ratio <= 1:
        raise GlmkitError(f"--recompute-ratio: must be within [0, 1], got {args.recompute_ratio}")
    if not -1 <= args.reuse_threshold:
        raise GlmkitError(f"--reuse-threshold: must be >= -1, got {args.reuse_threshold}")
    try:
        import hnswlib  # noqa: F401
    except ImportError:
        raise GlmkitError("--reuse approximate: needs hnswlib (pip install hnswlib)") from None
    return ApproxPolicy(threshold=args.reuse_threshold, recompute_ratio=args.recompute_ratio,
                        similar=args.reuse_threshold <= 1)


def one_shot(engine: Engine, generator: Generator, session: Session, sampler: Sampler,
             args: argparse.Namespace) -> TurnStats:
    if not args.prompt.strip():
        raise GlmkitError("--prompt: the prompt is empty")
    tok = engine.tokenizer
    if args.raw_prompt:
        ids = tok.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        ids = tok.encode_chat(messages + [{"role": "user", "content": args.prompt}], not args.no_think)
    check_context(engine, len(ids))
    kv, restore_s = prepare(session, ids)
    reply = stream(engine, generator, ids, args.max_tokens, sampler, kv)
    session.commit(ids, reply)
    print(flush=True)
    return TurnStats(generator.stats, session.last_reuse, restore_s)


def chat(engine: Engine, generator: Generator, session: Session, params: SamplingParams,
         args: argparse.Namespace) -> list[TurnStats]:
    """Multi-turn chat: each turn reuses the conversation's KV rows and prefills only what changed.

    With --session the messages are saved after every turn and reloaded on the next run; the prefix
    cache then restores the conversation's KV rows from disk. Returns the statistics of every turn.
    """
    tok = engine.tokenizer
    saved = session_path(args.cache_dir or default_cache_dir(), engine.model_hash, args.session) \
        if args.session else None
    messages = load_messages(saved) if saved else []
    if not messages and args.system:
        messages = [{"role": "system", "content": args.system}]
    sampler = Sampler(params)
    interactive = sys.stdin.isatty()
    if saved and len(messages) > 1 and interactive:
        print(f"(resumed session {args.session!r}: {len(messages)} messages)", file=sys.stderr)
    turns: list[TurnStats] = []
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return turns
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tok.encode_chat(messages, not args.no_think)
        check_context(engine, len(ids))
        kv, restore_s = prepare(session, ids)
        reply = stream(engine, generator, ids, args.max_tokens, sampler, kv)
        session.commit(ids, reply)
        turns.append(TurnStats(generator.stats, session.last_reuse, restore_s))
        messages.append({"role": "assistant", "content": tok.decode(_strip_eos(reply, engine.eos_token_ids))})
        if saved:
            save_messages(saved, messages)
        print(flush=True)


def stream(engine: Engine, generator: Generator, ids: list[int], max_tokens: int, sampler: Sampler,
           cache: KVCache | None) -> list[int]:
    """Generate and print text as it becomes valid UTF-8; returns the generated ids."""
    decoder = StreamDecoder(engine.tokenizer)
    out: list[int] = []
    for token in generator.generate(ids, max_tokens, sampler, cache):
        out.append(token)
        if token in engine.eos_token_ids:
            break
        sys.stdout.write(decoder.push(token))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush())
    return out


def check_context(engine: Engine, n_tokens: int) -> None:
    limit = engine.config.max_position_embeddings
    if n_tokens >= limit:
        raise GlmkitError(f"prompt is {n_tokens} tokens, the model's context is {limit}")


@dataclass
class TurnStats:
    generation: GenerationStats = field(default_factory=GenerationStats)
    reuse: ReuseStats = field(default_factory=ReuseStats)
    restore_s: float = 0.0  # finding and loading cached KV rows, before the prefill


def prepare(session: Session, ids: list[int]) -> tuple[KVCache, float]:
    start = time.perf_counter()
    kv = session.prepare(ids)
    return kv, time.perf_counter() - start


def write_stats(path: Path, turns: list[TurnStats], engine: Engine, per_turn: bool = False) -> None:
    """One JSON record: the (last) generation's numbers, process-wide ones, and with `per_turn` a
    `turns` list holding every chat turn's numbers (e.g. `cached_tokens`: history reused from the KV cache)."""
    record = {
        **_turn_record(turns[-1] if turns else TurnStats()),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "device": engine.device,
        **engine.experts.stats.to_json(),
    }
    if per_turn:
        record["turns"] = [_turn_record(stats) for stats in turns]
    try:
        path.write_text(json.dumps(record, indent=1) + "\n")
    except OSError as e:
        raise GlmkitError(f"--stats-json: cannot write {path} ({e.strerror or e})") from None


def _turn_record(turn: TurnStats) -> dict[str, Any]:
    stats, reuse = turn.generation, turn.reuse
    acceptance = stats.mtp_acceptance
    tpf = stats.tokens_per_forward
    # Session.prepare may compute part of the prompt itself (approximate reuse): that time is prefill, not
    # restore, and those rows are not "cached". Exact reuse: reused_exact == cached_tokens, the rest is 0.
    reused_exact = min(reuse.exact, stats.cached_tokens)
    reused_approx = min(reuse.approx, stats.cached_tokens - reused_exact)
    cached = reused_exact + reused_approx
    prefill_s = stats.prefill_s + reuse.compute_s
    return {
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": cached,
        "cached_from": reuse.to_json(),
        "reused_exact": reused_exact,
        "reused_approx": reused_approx,
        "recomputed": stats.prompt_tokens - cached,
        "approx": {"runs": reuse.runs, "similar_runs": reuse.similar_runs,
                   "recomputed_in_runs": reuse.blend_recomputed},
        "restore_s": round(max(turn.restore_s - reuse.compute_s, 0.0), 6),
        "prefill_s": round(prefill_s, 6),
        "ttft_s": round(turn.restore_s + stats.ttft_s, 6),
        "decode_tokens": stats.decode_tokens,
        "decode_s": round(stats.decode_s, 6),
        "prefill_tok_s": round((stats.prompt_tokens - cached) / prefill_s, 3) if prefill_s else None,
        "decode_tok_s": round((stats.decode_tokens - 1) / stats.decode_s, 3)
        if stats.decode_s and stats.decode_tokens > 1 else None,
        "mtp_acceptance": None if acceptance is None else round(acceptance, 4),
        "tokens_per_forward": None if tpf is None else round(tpf, 4),
        "stop_reason": stats.stop_reason,
    }


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MB (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def _strip_eos(ids: list[int], eos: tuple[int, ...]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


if __name__ == "__main__":
    sys.exit(main())
