#!/usr/bin/env python3
"""Measure every quantization preset against the f32 conversion of the trained fixture: docs/QUALITY.md's table.

    python tools/quality_table.py                        # tests/fixtures/tiny-trained, prints markdown
    python tools/quality_table.py --json quality.json    # also the raw numbers

For each variant: convert (timed), container size and bits per weight (all stored bytes x 8 / logical
parameters), perplexity and KL divergence against the f32 conversion's log-probabilities over the held-out
windows (eval_tokens.json; what `glm-perplexity --kl-base` computes), top-1 agreement, and the MTP draft
acceptance: during greedy generation (Generator stats; prompts: the first 64 tokens of each held-out window,
64 new tokens) and along the held-out text itself (`mtp_acceptance_on_text`).
The imatrix and gptq variants use `glm-calibrate` statistics of the f32 model over calib_tokens.json (training
text, not the evaluation windows), with Hessians for every weight (`--hessians all`), with routed experts'
gate/up sharing their layer's MoE-input Hessian (`pooled`, the default) or with none for routed experts
(`dense`). Same commands by hand:

    glm-convert tests/fixtures/tiny-trained /tmp/f32 --preset f32
    glm-perplexity /tmp/f32 --tokens tests/fixtures/tiny-trained/eval_tokens.json --save-logits /tmp/base.st
    glm-calibrate /tmp/f32 --tokens tests/fixtures/tiny-trained/calib_tokens.json -o /tmp/imatrix.st --hessians all
    glm-convert tests/fixtures/tiny-trained /tmp/q4 --preset q4 --quantizer gptq --imatrix /tmp/imatrix.st
    glm-perplexity /tmp/q4 --tokens tests/fixtures/tiny-trained/eval_tokens.json --kl-base /tmp/base.st --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmkit.convert.convert import convert  # noqa: E402
from glmkit.convert.plan import QuantPlan  # noqa: E402
from glmkit.eval.calibration import collect_imatrix  # noqa: E402
from glmkit.eval.evaluation import evaluate  # noqa: E402
from glmkit.eval.logits_file import LogitsBase, LogitsWriter  # noqa: E402
from glmkit.format.imatrix import read_imatrix  # noqa: E402
from glmkit.generate.engine import Engine  # noqa: E402
from glmkit.generate.generator import Generator  # noqa: E402
from glmkit.generate.sampling import Sampler, SamplingParams  # noqa: E402

# (label, preset, group size (None: the preset's; 0 = per row), quantizer, calibration statistics: None or a
# --hessians choice, the 4-bit grid: "nl" (the default) or "uniform")
VARIANTS: list[tuple[str, str, int | None, str, str | None, str]] = [
    ("f32", "f32", None, "absmax", None, "nl"),
    ("q8 absmax", "q8", None, "absmax", None, "nl"),
    ("q8 mse", "q8", None, "mse", None, "nl"),
    ("q8 gptq", "q8", None, "gptq", "all", "nl"),
    ("q8 gptq, pooled expert Hessians", "q8", None, "gptq", "pooled", "nl"),
    ("q8 mse, group 64 for every weight", "q8", 64, "mse", None, "nl"),
    ("q8 gptq, pooled expert Hessians, group 64 for every weight", "q8", 64, "gptq", "pooled", "nl"),
    ("q8 per-row mse", "q8", 0, "mse", None, "nl"),
    ("q8 per-row gptq", "q8", 0, "gptq", "all", "nl"),
    ("q4 absmax", "q4", None, "absmax", None, "nl"),
    ("q4 mse", "q4", None, "mse", None, "nl"),
    ("q4 mse+imatrix", "q4", None, "mse", "all", "nl"),
    ("q4 gptq", "q4", None, "gptq", "all", "nl"),
    ("q4 gptq, pooled expert Hessians", "q4", None, "gptq", "pooled", "nl"),
    ("q4 gptq, no expert Hessians", "q4", None, "gptq", "dense", "nl"),
    ("q4 per-row absmax", "q4", 0, "absmax", None, "nl"),
    ("q4 per-row mse+imatrix", "q4", 0, "mse", "all", "nl"),
    ("q4 per-row gptq", "q4", 0, "gptq", "all", "nl"),
    ("q4 absmax, uniform grid", "q4", None, "absmax", None, "uniform"),
    ("q4 mse, uniform grid", "q4", None, "mse", None, "uniform"),
    ("q4 gptq, uniform grid", "q4", None, "gptq", "all", "uniform"),
    ("q4 gptq, pooled expert Hessians, uniform grid", "q4", None, "gptq", "pooled", "uniform"),
    ("q3 absmax", "q3", None, "absmax", None, "nl"),
    ("q3 mse", "q3", None, "mse", None, "nl"),
    ("q3 gptq, pooled expert Hessians", "q3", None, "gptq", "pooled", "nl"),
    ("q2 absmax", "q2", None, "absmax", None, "nl"),
    ("q2 mse", "q2", None, "mse", None, "nl"),
    ("q2 mse+imatrix", "q2", None, "mse", "all", "nl"),
    ("q2 gptq", "q2", None, "gptq", "all", "nl"),
    ("q2 gptq, pooled expert Hessians", "q2", None, "gptq", "pooled", "nl"),
]
MTP_PROMPTS = 32
MTP_PROMPT_TOKENS = 64
MTP_NEW_TOKENS = 64


def logical_params(engine: Engine) -> int:
    return sum(math.prod(e.shape) for e in engine.container.manifest.tensors.values() if e.role != "scales")


def mtp_acceptance(engine: Engine, windows: list[list[int]]) -> dict[str, Any]:
    """Accepted / drafted MTP tokens over greedy generations from held-out prompts (Generator stats)."""
    drafts = accepted = 0
    for w in windows[:MTP_PROMPTS]:
        gen = Generator(engine.model, engine.eos_token_ids, use_mtp=True)
        list(gen.generate(w[:MTP_PROMPT_TOKENS], MTP_NEW_TOKENS, Sampler(SamplingParams())))
        drafts += gen.stats.mtp_drafts
        accepted += gen.stats.mtp_accepted
    return {"mtp_acceptance": accepted / drafts if drafts else None, "mtp_drafts": drafts}


def mtp_acceptance_on_text(engine: Engine, windows: list[list[int]]) -> float:
    """The same accept rule along fixed held-out text: the draft for position i+2 (MTP from `h_i` and the token
    at i+1) counts as accepted when it equals the main model's argmax at i+1. Unlike greedy generation, every
    variant is measured on the same tokens, so a degraded model's repetitive output cannot inflate it."""
    model = engine.model
    hits = total = 0
    for w in windows:
        ids = np.asarray(w, dtype=np.int64)
        logits, hidden = model.forward(ids, model.new_cache())
        draft, _ = model.mtp_forward(hidden[:-2], ids[1:-1], model.new_cache())
        hits += int((draft.argmax(axis=1) == logits[1:-1].argmax(axis=1)).sum())
        total += len(ids) - 2
    return hits / total


def run(fixture: Path, work: Path, only: list[str] | None) -> list[dict[str, Any]]:
    windows = json.loads((fixture / "eval_tokens.json").read_text())
    calib = json.loads((fixture / "calib_tokens.json").read_text())
    base_path = work / "base.safetensors"
    rows: list[dict[str, Any]] = []
    for label, preset, group, quantizer, hessians, grid in VARIANTS:
        if only and label not in only and label != "f32":
            continue
        out = work / label.replace(" ", "_").replace("+", "_").replace(",", "")
        plan = QuantPlan.from_preset(preset, group_size=group, quantizer=quantizer, grid=grid)
        imatrix = read_imatrix(work / f"imatrix-{hessians}.safetensors") if hessians else None
        t0 = time.perf_counter()
        convert(fixture, out, plan, preset, force=True, progress=False, imatrix=imatrix)
        seconds = time.perf_counter() - t0
        engine = Engine(out, "numpy", load_tokenizer=False)
        if label == "f32":
            writer = LogitsWriter(base_path, engine.model_hash, windows, engine.config.vocab_size)
            metrics = evaluate(engine, windows, save=writer)
            writer.close()
            for kind in ("all", "pooled", "dense"):
                collect_imatrix(engine, calib, hessians=kind).write(work / f"imatrix-{kind}.safetensors")
        else:
            metrics = evaluate(engine, windows, LogitsBase(base_path))
        row = {"variant": label, "preset": preset, "group_size": group or None, "quantizer": quantizer,
               "hessians": hessians, "grid": grid, "bytes": engine.container.nbytes,
               "bpw": engine.container.nbytes * 8 / logical_params(engine), "convert_s": seconds, **metrics,
               **mtp_acceptance(engine, windows), "mtp_acceptance_text": mtp_acceptance_on_text(engine, windows)}
        rows.append(row)
        print(f"{label}: {json.dumps({k: v for k, v in row.items() if k != 'variant'})}", file=sys.stderr)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| variant | size | bpw | convert | ppl | ppl ratio | KLD mean | KLD p99 | top-1 | MTP accept (greedy) "
           "| MTP accept (text) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kl = kl_cells(r) if "kld_mean" in r else "1 | 0 | 0 | 100%"
        out.append(f"| {r['variant']} | {r['bytes'] / 1e6:.2f} MB | {r['bpw']:.2f} | {r['convert_s']:.1f} s | "
                   f"{r['ppl']:.4f} | {kl} | {100 * r['mtp_acceptance']:.1f}% | "
                   f"{100 * r['mtp_acceptance_text']:.1f}% |")
    return "\n".join(out)


def kl_cells(r: dict[str, Any]) -> str:
    """The `ppl ratio | KLD mean | KLD p99 | top-1` cells of a row measured against the f32 base."""
    return (f"{r['ppl_ratio']:.4f} | {r['kld_mean']:.5f} | {r['kld_p99']:.4f} | {100 * r['top1_agreement']:.2f}% "
            f"± {100 * r['top1_se']:.2f}")


FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny-trained"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", type=Path, default=FIXTURE)
    ap.add_argument("--work", type=Path, help="where the containers go (default: a temporary directory)")
    ap.add_argument("--json", type=Path, help="write the raw numbers here")
    ap.add_argument("--only", action="append", help="measure only this variant (repeatable; f32 always runs)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = run(args.fixture, work, args.only)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
