"""`glm-perplexity SNAPSHOT (--text FILE | --tokens FILE)`: perplexity, and KL divergence against a reference.

The text is cut into consecutive windows of `--ctx` tokens (a shorter tail is dropped); `--tokens` gives the
windows directly (a JSON list of token-id lists). Each window is one forward pass from an empty cache and
scores its positions 0..n-2 (each predicts the next token). `--save-logits BASE` writes this model's
log-probabilities; `--kl-base BASE` compares against such a file (made by the reference, e.g. the f32
conversion, over the same windows): mean and 99th percentile KL divergence per token, top-1 agreement and
the perplexity ratio, like llama.cpp's `--kl-divergence`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from glmkit.cli.common import (
    add_engine_arguments,
    add_window_arguments,
    check_output_path,
    check_window_arguments,
    engine_from_arguments,
    windows_from_arguments,
)
from glmkit.errors import GlmkitError
from glmkit.eval.evaluation import evaluate
from glmkit.eval.logits_file import LogitsBase, LogitsWriter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm-perplexity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", help="converted container directory")
    add_window_arguments(p)
    p.add_argument("--save-logits", type=Path, metavar="BASE", help="save this model's log-probabilities to BASE")
    p.add_argument("--kl-base", type=Path, metavar="BASE",
                   help="compare against BASE (saved with --save-logits over the same windows)")
    p.add_argument("--json", action="store_true",
                   help='print {"tokens", "ppl"} (+ "kld_mean", "kld_p99", "top1_agreement", "top1_se", "ppl_ratio")')
    add_engine_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    writer = None
    try:
        check_window_arguments(args)
        if args.save_logits is not None:
            check_output_path(args.save_logits, "--save-logits")
        engine = engine_from_arguments(args, load_tokenizer=args.text is not None)
        vocab = engine.config.vocab_size
        windows = windows_from_arguments(engine, args)
        base = None
        if args.kl_base is not None:
            base = LogitsBase(args.kl_base)
            base.check_matches(windows, vocab)
        if args.save_logits is not None:
            writer = LogitsWriter(args.save_logits, engine.model_hash, windows, vocab)
        result = evaluate(engine, windows, base, writer, progress=not args.quiet)
        if writer is not None:
            writer.close()
            writer = None
    except GlmkitError as e:
        if writer is not None:
            writer.abort()
        print(f"glm-perplexity: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if writer is not None:
            writer.abort()
        print("glm-perplexity: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['tokens']} tokens in {len(windows)} windows: perplexity {result['ppl']:.4f}")
    if base is not None:
        same = " (same model)" if base.model_hash == engine.model_hash else ""
        print(f"vs {args.kl_base}{same}: KL divergence mean {result['kld_mean']:.6f}, p99 {result['kld_p99']:.6f}; "
              f"top-1 agreement {100 * result['top1_agreement']:.2f}% ± {100 * result['top1_se']:.2f}; "
              f"perplexity ratio {result['ppl_ratio']:.4f}")
    if args.save_logits is not None:
        print(f"saved log-probabilities to {args.save_logits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
