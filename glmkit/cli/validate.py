"""`glm-validate SNAPSHOT ORACLE.json`: teacher-forcing and greedy agreement with a transformers oracle.

The oracle holds `prompt_ids`, `full_ids` (prompt + greedy continuation) and `tf_pred` (argmax of the
teacher-forcing logits at every position of full_ids), optionally `tf_logits` and an `mtp` block.
Exit 0 only when the check passes: by default exact agreement and logits within `--logit-tol`;
with `--min-agreement F` (for quantized snapshots) when both agreement fractions reach F.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.generate.engine import FLOAT_ACTIVATIONS_HELP, Engine
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams

MAX_ORACLE_BYTES = 256 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm-validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", help="converted container directory")
    p.add_argument("oracle", type=Path, help="oracle JSON made by tools/make_oracle.py (or colibri's keys)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--min-agreement", type=float,
                   help="pass when teacher-forcing and greedy agreement reach this fraction (quantized snapshots)")
    p.add_argument("--logit-tol", type=float, default=1e-4,
                   help="exact mode: max |logit diff| allowed, relative to the oracle's max |logit| (default 1e-4)")
    p.add_argument("--no-mtp", action="store_true", help="greedy check without MTP speculative decoding")
    p.add_argument("--device", default="auto", help="auto | numpy | opencl[:platform:device]")
    p.add_argument("--float-activations", action="store_true", help=FLOAT_ACTIVATIONS_HELP)
    return p


def load_oracle(path: Path, vocab_size: int) -> dict[str, Any]:
    """Read and check an oracle file (untrusted input)."""
    if not path.is_file():
        raise GlmkitError(f"{path}: oracle file not found")
    if path.stat().st_size > MAX_ORACLE_BYTES:
        raise GlmkitError(f"{path}: oracle larger than {MAX_ORACLE_BYTES >> 20} MB")
    try:
        oracle = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GlmkitError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(oracle, dict):
        raise GlmkitError(f"{path}: oracle must be a JSON object")
    for key in ("prompt_ids", "full_ids", "tf_pred"):
        _check_ids(path, key, oracle.get(key), vocab_size)
    full, prompt = oracle["full_ids"], oracle["prompt_ids"]
    if full[:len(prompt)] != prompt or len(oracle["tf_pred"]) != len(full):
        raise GlmkitError(f"{path}: full_ids must start with prompt_ids and tf_pred must cover every position")
    if oracle.get("tf_logits") is not None:
        oracle["tf_logits"] = _float_matrix(path, "tf_logits", oracle["tf_logits"], (len(full), vocab_size))
    mtp = oracle.get("mtp")
    if mtp is not None:
        # row i uses h_i and full_ids[i+1] and predicts full_ids[i+2]: one row per position but the last
        if not isinstance(mtp, dict) or "pred" not in mtp:
            raise GlmkitError(f"{path}: 'mtp' must be an object with a 'pred' list")
        _check_ids(path, "mtp.pred", mtp["pred"], vocab_size, length=len(full) - 1)
        if mtp.get("logits") is not None:
            mtp["logits"] = _float_matrix(path, "mtp.logits", mtp["logits"], (len(full) - 1, vocab_size))
    return oracle


def _check_ids(path: Path, key: str, ids: Any, vocab_size: int, length: int | None = None) -> None:
    """A non-empty list of token ids (ints, not bools) below vocab_size, of `length` items if given."""
    valid = isinstance(ids, list) and len(ids) > 0 and all(type(i) is int and 0 <= i < vocab_size for i in ids)
    if not valid:
        raise GlmkitError(f"{path}: {key!r} must be a non-empty list of token ids below {vocab_size}")
    if length is not None and len(ids) != length:
        raise GlmkitError(f"{path}: {key!r} has {len(ids)} entries, expected {length}")


def _float_matrix(path: Path, key: str, rows: Any, shape: tuple[int, int]) -> np.ndarray:
    """A finite float32 array of exactly `shape` from nested JSON lists."""
    try:
        array = np.asarray(rows, dtype=np.float32)
    except (TypeError, ValueError):  # ragged rows or non-numbers
        raise GlmkitError(f"{path}: {key!r} must be a {shape[0]} x {shape[1]} matrix of numbers") from None
    if array.shape != shape:
        raise GlmkitError(f"{path}: {key!r} has shape {list(array.shape)}, expected {list(shape)}")
    if not np.isfinite(array).all():
        raise GlmkitError(f"{path}: {key!r} holds non-finite values")
    return array


def validate(engine: Engine, oracle: dict[str, Any], use_mtp: bool) -> dict[str, Any]:
    model = engine.model
    full = np.asarray(oracle["full_ids"], dtype=np.int64)
    prompt = oracle["prompt_ids"]
    logits, hidden = model.forward(full, model.new_cache())
    pred = logits.argmax(axis=1)
    tf = {"match": int((pred == np.asarray(oracle["tf_pred"])).sum()), "total": len(full),
          "first_mismatch": _first_mismatch(pred.tolist(), oracle["tf_pred"])}
    if oracle.get("tf_logits") is not None:
        ref = np.asarray(oracle["tf_logits"], dtype=np.float32)
        tf["max_abs_logit_diff"] = float(np.abs(logits - ref).max())
        tf["logit_scale"] = float(np.abs(ref).max())

    expected = oracle["full_ids"][len(prompt):]
    generator = Generator(model, engine.eos_token_ids, use_mtp=use_mtp)
    got = list(generator.generate(prompt, len(expected), Sampler(SamplingParams())))
    first = _first_mismatch(got, expected)
    greedy = {"match": len(expected) if first is None else first, "total": len(expected), "first_mismatch": first,
              "mtp": generator.use_mtp, "mtp_acceptance": generator.stats.mtp_acceptance,
              "tokens_per_forward": generator.stats.tokens_per_forward}
    result: dict[str, Any] = {"teacher_forcing": tf, "greedy": greedy}

    mtp_ref = oracle.get("mtp")
    if model.has_mtp and isinstance(mtp_ref, dict) and "pred" in mtp_ref:
        mtp_logits, _ = model.mtp_forward(hidden[:-1], full[1:], model.new_cache())
        mtp_pred = mtp_logits.argmax(axis=1)
        ref_pred = np.asarray(mtp_ref["pred"])
        result["mtp"] = {"match": int((mtp_pred == ref_pred).sum()), "total": len(ref_pred)}
        if mtp_ref.get("logits") is not None:
            ref = np.asarray(mtp_ref["logits"], dtype=np.float32)
            result["mtp"]["max_abs_logit_diff"] = float(np.abs(mtp_logits - ref).max())
            result["mtp"]["logit_scale"] = float(np.abs(ref).max())
    return result


def verdict(result: dict[str, Any], min_agreement: float | None, logit_tol: float) -> bool:
    parts = [result["teacher_forcing"], result["greedy"]] + ([result["mtp"]] if "mtp" in result else [])
    if min_agreement is not None:
        return all(p["match"] >= min_agreement * p["total"] for p in parts)
    exact = all(p["match"] == p["total"] for p in parts)
    within = all(p["max_abs_logit_diff"] <= logit_tol * max(p["logit_scale"], 1.0)
                 for p in parts if "max_abs_logit_diff" in p)
    return exact and within


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.min_agreement is not None and not 0 <= args.min_agreement <= 1:
            raise GlmkitError(f"--min-agreement: must be in [0, 1], got {args.min_agreement}")
        engine = Engine(args.snapshot, args.device, load_tokenizer=False, float_activations=args.float_activations)
        oracle = load_oracle(args.oracle, engine.config.vocab_size)
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


def _first_mismatch(got: list[int], expected: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return i
    return None if len(got) >= len(expected) else len(got)


if __name__ == "__main__":
    sys.exit(main())
