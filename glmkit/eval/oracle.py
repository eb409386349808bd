"""Agreement of a converted snapshot with a transformers oracle (what `glm-validate` checks).

The oracle holds `prompt_ids`, `full_ids` (prompt + greedy continuation) and `tf_pred` (argmax of the
teacher-forcing logits at every position of full_ids), optionally `tf_logits` and an `mtp` block.
`verdict` passes by default on exact agreement with logits within a tolerance; with a minimum agreement
(for quantized snapshots) when every agreement fraction reaches it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.format.files import read_json_file
from glmkit.generate.engine import Engine
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams

MAX_ORACLE_BYTES = 256 << 20


def load_oracle(path: Path, vocab_size: int, max_positions: int) -> dict[str, Any]:
    """Read and check an oracle file (untrusted input) for a model of `vocab_size` ids and `max_positions`
    positions."""
    if not path.exists():
        raise GlmkitError(f"{path}: oracle file not found")
    oracle = read_json_file(path, MAX_ORACLE_BYTES)  # a regular file, size-capped, nesting bounded
    if not isinstance(oracle, dict):
        raise GlmkitError(f"{path}: oracle must be a JSON object")
    for key in ("prompt_ids", "full_ids", "tf_pred"):
        _check_ids(path, key, oracle.get(key), vocab_size)
    full, prompt = oracle["full_ids"], oracle["prompt_ids"]
    if len(full) > max_positions:  # positions past the context mean nothing, and the work grows with the file
        raise GlmkitError(f"{path}: full_ids has {len(full)} tokens, more than the model's {max_positions} positions")
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
    """Teacher forcing over `full_ids`, greedy generation after `prompt_ids` (exactly as many tokens as the oracle's
    continuation, EOS ids included) and (if both have one) the MTP head; returns `{"teacher_forcing", "greedy"[,
    "mtp"]}`, each with `match` and `total` positions."""
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
    # no EOS ids: the oracle's continuation may run through one (made with EOS disabled), and decides the length
    generator = Generator(model, (), use_mtp=use_mtp)
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
    """Pass: every part's agreement reaches `min_agreement` if given, else exact agreement and every max |logit
    diff| within `logit_tol` times the oracle's logit scale (at least 1)."""
    parts = [result["teacher_forcing"], result["greedy"]] + ([result["mtp"]] if "mtp" in result else [])
    if min_agreement is not None:
        return all(p["match"] >= min_agreement * p["total"] for p in parts)
    exact = all(p["match"] == p["total"] for p in parts)
    within = all(p["max_abs_logit_diff"] <= logit_tol * max(p["logit_scale"], 1.0)
                 for p in parts if "max_abs_logit_diff" in p)
    return exact and within


def _first_mismatch(got: list[int], expected: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return i
    return None if len(got) >= len(expected) else len(got)
