"""`glm-validate SNAPSHOT ORACLE.json`: teacher-forcing and greedy agreement with a transformers oracle.

The oracle holds `prompt_ids`, `full_ids` (prompt + greedy continuation) and `tf_pred` (argmax of the
teacher-forcing logits at every position of full_ids), optionally `tf_logits` and an `mtp` block; the
greedy check generates as many tokens as the continuation holds, through any EOS id in it. The snapshot's
tensors are first checked against the manifest's sha256 digests. Exit 0 only when the check passes: by
default exact agreement and logits within `--logit-tol`; with `--min-agreement F` (for quantized snapshots)
when every agreement fraction reaches F.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from glmkit.cli.common import add_engine_arguments, engine_from_arguments, verify_snapshot_data
from glmkit.errors import GlmkitError
from glmkit.eval.oracle import load_oracle, validate, verdict


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm-validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", help="converted container directory")
    p.add_argument("oracle", type=Path, help="oracle JSON made by tools/make_oracle.py (or colibri's keys)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--min-agreement", type=float,
                   help="pass when every agreement (teacher forcing, greedy, MTP head) reaches this fraction "
                        "(quantized snapshots)")
    p.add_argument("--logit-tol", type=float, default=1e-4,
                   help="exact mode: max |logit diff| allowed, relative to the oracle's max |logit| (default 1e-4)")
    p.add_argument("--no-mtp", action="store_true", help="greedy check without MTP speculative decoding")
    add_engine_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.min_agreement is not None and not 0 <= args.min_agreement <= 1:
            raise GlmkitError(f"--min-agreement: must be in [0, 1], got {args.min_agreement}")
        if not 0 <= args.logit_tol < math.inf:
            raise GlmkitError(f"--logit-tol: must be a finite number >= 0, got {args.logit_tol}")
        engine = engine_from_arguments(args, load_tokenizer=False)
        verify_snapshot_data(engine.container)  # a flipped bit may change no prediction: check the bytes too
        oracle = load_oracle(args.oracle, engine.config.vocab_size, engine.config.max_position_embeddings)
        result = validate(engine, oracle, use_mtp=not args.no_mtp)
    except GlmkitError as e:
        print(f"glm-validate: error: {e}", file=sys.stderr)
        return 1
    result["passed"] = verdict(result, args.min_agreement, args.logit_tol)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_report(result)
    return 0 if result["passed"] else 1


def print_report(result: dict[str, Any]) -> None:
    for key, label in (("teacher_forcing", "teacher forcing"), ("greedy", "greedy"), ("mtp", "MTP head")):
        if key not in result:
            continue
        p = result[key]
        line = f"{label:16s} {p['match']}/{p['total']} positions agree"
        if "max_abs_logit_diff" in p:
            line += f", max |logit diff| {p['max_abs_logit_diff']:.3g} (logit scale {p['logit_scale']:.3g})"
        if p.get("first_mismatch") is not None:
            line += f", first mismatch at {p['first_mismatch']}"
        if key == "greedy" and p["mtp"]:
            line += f", MTP acceptance {p['mtp_acceptance']:.2f}" if p["mtp_acceptance"] is not None else ""
        print(line)
    print("PASS" if result["passed"] else "FAIL")


if __name__ == "__main__":
    sys.exit(main())
