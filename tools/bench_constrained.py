#!/usr/bin/env python3
"""What constrained decoding costs per token: a JSON schema (`response_format`) and a forced, strict tool call
(`tool_choice`), against free decoding.

    PYTHONPATH=. python tools/bench_constrained.py                       # bench model, q4, --device auto
    PYTHONPATH=. python tools/bench_constrained.py --rounds 5 --vocab 154880 --json /tmp/constrained.json

Decode: the benchmark model (tools/bench_model.py; the tiny fixture's tokenizer, whose 372 tokens are the only ones
a grammar can allow of the model's 8,192) through `Generator`, greedy, in six modes alternated `--rounds` times:
`free` (the device picks each token, the next forward in flight), `host` (a no-op logit bias: each token chosen on
the host from the logits), `json` (an array of `--items` integers) and `tool` (a forced call of a strict tool with
that array as its argument), pipelined as `free` is on a CPU OpenCL device (the device masks the logits by the
grammar's bitmask), and `json-host` / `tool-host`: the same grammars through the host's choice, as `host` (the path
before the device masked). Per mode: ms per decoded token (from the first token to the last) and the constraint's
own time per token (its bitmask or mask, and its advance).

Mask alone (`--vocab N`, 0 to skip): the two grammars over a synthetic byte-level vocabulary of N tokens (GLM-5 has
154,880): random strings of 1-12 letters, digits and JSON punctuation, half with a leading space. Per token, the mask
and the advance, over `--tokens` tokens each drawn at random from what the grammar allows, with the time of the
mask's parts: llguidance's bitmask, and applying it to `[V]` logits. Then what a request pays before its first token
for 1, 10 and 30 strict tools shaped like a coding agent's (glm-serve builds each request's grammar): the grammar
made and compiled into a matcher, and the first mask.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llguidance.numpy as llnp
import numpy as np
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from glmkit.generate.constraint import GrammarTokenizer, TokenConstraint, json_grammar  # noqa: E402
from glmkit.generate.engine import Engine  # noqa: E402
from glmkit.generate.generator import Generator  # noqa: E402
from glmkit.generate.sampling import Sampler, SamplingParams  # noqa: E402
from glmkit.serve.tool_grammar import MARKERS, ToolChoice, tool_call_grammar  # noqa: E402
from tools.bench_model import DEFAULT_WORK, ensure_bench_snapshot  # noqa: E402
from tools.bench_serve import servable  # noqa: E402

MODES = ("free", "host", "json", "tool", "json-host", "tool-host")


def numbers_schema(items: int) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": items,
            "maxItems": items}


def grammars(gt: GrammarTokenizer, items: int) -> dict[str, str]:
    tool = {"type": "function", "function": {"name": "record", "strict": True, "parameters": {
        "type": "object", "properties": {"values": numbers_schema(items)}, "required": ["values"]}}}
    return {"json": json_grammar(numbers_schema(items)),
            "tool": tool_call_grammar([tool], ToolChoice(required=True, parallel=False), False,
                                      gt.added_token_ids(MARKERS))}


class TimedConstraint:
    """A TokenConstraint that adds up the time of its mask (or bitmask, where the device masks) and its advance."""

    def __init__(self, inner: TokenConstraint) -> None:
        self.inner, self.seconds = inner, 0.0

    def _timed(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.seconds += time.perf_counter() - start
        return out

    def mask(self, logits: np.ndarray) -> np.ndarray:
        return self._timed(self.inner.mask, logits)

    def allowed_bits(self) -> np.ndarray:
        return self._timed(self.inner.allowed_bits)

    def accept(self, token: int) -> None:
        self._timed(self.inner.accept, token)

    def rollback(self, tokens: int) -> None:
        self.inner.rollback(tokens)


def decode_once(engine: Engine, gt: GrammarTokenizer, end: tuple[int, ...], mode: str, grammar: dict[str, str],
                prompt: list[int], max_tokens: int) -> dict[str, float]:
    kind, _, through = mode.partition("-")
    constraint = TimedConstraint(gt.constraint(grammar[kind])) if kind in grammar else None
    params = SamplingParams(0.0, logit_bias=((0, 0.0),)) if mode == "host" else SamplingParams(0.0)
    gen = Generator(engine.model, end, use_mtp=False, pipelined=through != "host")
    stamps = []
    for _ in gen.generate(prompt, max_tokens, Sampler(params, constraint)):
        stamps.append(time.perf_counter())
    per_token = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    mask = constraint.seconds / len(stamps) if constraint is not None else 0.0
    return {"tokens": len(stamps), "ms_per_token": 1e3 * per_token, "mask_ms_per_token": 1e3 * mask}


def synthetic_tokenizer(n: int, path: Path) -> Path:
    """A byte-level BPE tokenizer.json of `n` tokens (no merges: only its vocabulary is read) and an end token."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = iter(range(256, 512))
    byte_tokens = [chr(b) if b in printable else chr(next(others)) for b in range(256)]  # the byte-level alphabet
    vocab, rng = {t: i for i, t in enumerate(dict.fromkeys(byte_tokens))}, random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" + '",:{}[]'
    while len(vocab) < n - 1:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(1, 12)))
        vocab.setdefault(("\u0120" if rng.random() < 0.5 else "") + word, len(vocab))
    end = len(vocab)
    spec = {"version": "1.0", "added_tokens": [{"id": end, "content": "<|end|>", "single_word": False,
                                                  "lstrip": False, "rstrip": False, "normalized": False,
                                                  "special": True}],
            "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                                  "use_regex": True},
            "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                                "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                      "merges": []}}
    path.write_text(json.dumps(spec))
    return path


def synthetic_grammar_tokenizer(vocab: int) -> tuple[GrammarTokenizer, float]:
    """llguidance's view of a synthetic vocabulary of `vocab` tokens (its last the end), and the seconds it took."""
    with tempfile.TemporaryDirectory() as tmp:
        tok = Tokenizer.from_file(str(synthetic_tokenizer(vocab, Path(tmp) / "tokenizer.json")))
    start = time.perf_counter()
    gt = GrammarTokenizer(tok, vocab, (vocab - 1,))
    return gt, time.perf_counter() - start


def agent_tools(n: int) -> list[dict[str, Any]]:
    """n strict tools shaped like a coding agent's: a path, a line, a mode, nested options, tags."""
    parameters = {"type": "object", "properties": {
        "path": {"type": "string", "maxLength": 200}, "line": {"type": "integer", "minimum": 0},
        "mode": {"type": "string", "enum": ["read", "write", "append"]},
        "options": {"type": "object", "properties": {"recursive": {"type": "boolean"}, "depth": {"type": "integer"}},
                    "required": ["recursive"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10}}, "required": ["path", "mode"]}
    return [{"type": "function", "function": {"name": f"tool_{i}", "strict": True, "parameters": parameters}}
            for i in range(n)]


def compile_costs(gt: GrammarTokenizer, counts: tuple[int, ...] = (1, 10, 30)) -> dict[int, dict[str, float]]:
    """What a request with n strict tools pays before its first token (medians of 3): its grammar made and
    compiled into a matcher, and the first mask."""
    out = {}
    for n in counts:
        times: dict[str, list[float]] = {"matcher_ms": [], "first_mask_ms": []}
        for _ in range(3):
            start = time.perf_counter()
            grammar = tool_call_grammar(agent_tools(n), ToolChoice(), True, gt.added_token_ids(MARKERS))
            constraint = gt.constraint(grammar)
            built = time.perf_counter()
            constraint.allowed_bits()
            done = time.perf_counter()
            times["matcher_ms"].append(1e3 * (built - start))
            times["first_mask_ms"].append(1e3 * (done - built))
        out[n] = {"grammar_kb": len(grammar) / 1024, **{k: statistics.median(v) for k, v in times.items()}}
    return out


def mask_alone(gt: GrammarTokenizer, vocab: int, items: int, tokens: int) -> dict[str, dict[str, float]]:
    out = {}
    for name, grammar in grammars(gt, items).items():
        constraint, rng = gt.constraint(grammar), np.random.default_rng(0)
        logits = np.zeros(vocab, np.float32)
        fill = apply = total = 0.0
        done = 0
        for _ in range(tokens):
            start = time.perf_counter()
            allowed = np.flatnonzero(np.isfinite(constraint.mask(logits)))
            middle = time.perf_counter()
            token = int(rng.choice(allowed))
            if token == vocab - 1:
                break
            constraint.accept(token)
            total += middle - start + time.perf_counter() - middle
            done += 1
        # the mask's parts, timed apart over the grammar's state at the end
        for _ in range(20):
            start = time.perf_counter()
            llnp.fill_next_token_bitmask(constraint.matcher, constraint.bitmask, 0)
            fill += time.perf_counter() - start
            start = time.perf_counter()
            constraint.mask(logits)
            apply += time.perf_counter() - start
        out[name] = {"tokens": done, "ms_per_token": 1e3 * total / max(done, 1), "bitmask_ms": 1e3 * fill / 20,
                     "mask_ms": 1e3 * apply / 20}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="where the bench model lives")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--items", type=int, default=40, help="integers in the JSON array (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--vocab", type=int, default=154880, help="synthetic vocabulary for the mask alone (0: skip)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens of the mask-alone run (default %(default)s)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(servable(ensure_bench_snapshot("q4", args.work), Path(tmp)), args.device)
    # the bench model's own end ids lie past the fixture tokenizer's tokens: the tokenizer's end token ends a reply
    end = (engine.tokenizer.tokenizer.token_to_id("<|endoftext|>"),)
    gt = GrammarTokenizer(engine.tokenizer.tokenizer, engine.config.vocab_size, end)
    grammar = grammars(gt, args.items)
    prompt = engine.tokenizer.encode("Write the numbers:")
    for mode in MODES:  # warm-up: builds the step and the grammars' first states
        decode_once(engine, gt, end, mode, grammar, prompt, 8)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(decode_once(engine, gt, end, mode, grammar, prompt, args.max_tokens))
    print(f"decode ({engine.config.vocab_size} logits, device {args.device}; medians of {args.rounds} rounds)")
    print("| mode | tokens | ms per token | constraint ms per token | vs free |")
    print("|---|---:|---:|---:|---:|")
    free = statistics.median(r["ms_per_token"] for r in runs["free"])
    for mode in MODES:
        ms = statistics.median(r["ms_per_token"] for r in runs[mode])
        mask = statistics.median(r["mask_ms_per_token"] for r in runs[mode])
        tokens = statistics.median(r["tokens"] for r in runs[mode])
        print(f"| {mode} | {tokens:.0f} | {ms:.2f} | {mask:.3f} | {ms / free:.2f}x |")
    alone: dict[str, dict[str, float]] = {}
    costs: dict[int, dict[str, float]] = {}
    if args.vocab:
        synthetic, seconds = synthetic_grammar_tokenizer(args.vocab)
        alone = mask_alone(synthetic, args.vocab, args.items, args.tokens)
        print(f"\nmask alone over a synthetic vocabulary of {args.vocab} tokens (llguidance's view of it: "
              f"{seconds:.2f} s, once per process)")
        print("| grammar | tokens | mask + advance ms per token | bitmask ms | bitmask + applied to logits ms |")
        print("|---|---:|---:|---:|---:|")
        for name, r in alone.items():
            print(f"| {name} | {r['tokens']} | {r['ms_per_token']:.3f} | {r['bitmask_ms']:.3f} | {r['mask_ms']:.3f} |")
        costs = compile_costs(synthetic)
        print("\na request's grammar before its first token (strict tools, thinking first)")
        print("| strict tools | grammar KB | grammar + matcher ms | first mask ms |")
        print("|---:|---:|---:|---:|")
        for n, r in costs.items():
            print(f"| {n} | {r['grammar_kb']:.1f} | {r['matcher_ms']:.1f} | {r['first_mask_ms']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"decode": runs, "mask_alone": alone, "compile": costs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
