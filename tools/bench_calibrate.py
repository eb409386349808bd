#!/usr/bin/env python3
"""Calibrated conversion in one pass (`glm-convert --calibrate`) against two passes (a temporary q8 conversion,
`glm-calibrate --hessians pooled` on it, then `glm-convert --quantizer gptq --imatrix`): quality, time, peak RSS.

    PYTHONPATH=. python tools/bench_calibrate.py                   # trained fixture, calib_tokens.json, q4
    PYTHONPATH=. python tools/bench_calibrate.py --bench --no-fixture --rounds 1  # bench_convert.py's model

Every conversion runs in a child process (bench_convert.run_child: its wall time and its own peak RSS, wait4's
ru_maxrss; BLAS single-threaded), the variants alternating round by round. Variants: `two-pass` (a temporary q8
conversion, glm-calibrate on it, the conversion with its imatrix), `one-pass` (`--calibrate`: each layer propagated
through its quantized weights) and `one-pass, source` (propagated through the source weights). On the fixture each
output is then compared with the f32 conversion over the held-out windows (eval_tokens.json: KL divergence,
perplexity ratio, top-1), as tools/quality_table.py does. The benchmark model (random weights, 64 experts)
calibrates on random token windows: time and memory only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from glmkit.convert.convert import convert  # noqa: E402
from glmkit.convert.plan import QuantPlan  # noqa: E402
from glmkit.eval.calibration import calibration_windows, collect_imatrix  # noqa: E402
from glmkit.eval.evaluation import evaluate  # noqa: E402
from glmkit.eval.layerwise import LayerwiseCalibration  # noqa: E402
from glmkit.eval.logits_file import LogitsBase, LogitsWriter  # noqa: E402
from glmkit.format.config import ModelConfig  # noqa: E402
from glmkit.format.imatrix import read_imatrix  # noqa: E402
from glmkit.generate.engine import Engine  # noqa: E402
from tools.bench_convert import child_env, ensure_source, run_child, source_dir  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "tiny-trained"
VARIANTS = ("two-pass", "one-pass", "one-pass, source")
WINDOWS = 64  # glm-convert's --calibrate-windows default
BENCH_WINDOWS, BENCH_CTX = 16, 256
# the small products of a layer run on one sequence lose to multi-threaded BLAS's spin-waits on a shared machine
SINGLE_BLAS = {"OPENBLAS_NUM_THREADS": "1"}


def convert_calibrated(variant: str, source: Path, out: Path, calib: Path, preset: str) -> None:
    """One calibrated conversion of `source` into `out` (in this process)."""
    windows = calibration_windows(source, ModelConfig.from_file(source / "config.json"), calib)[:WINDOWS]
    plan = QuantPlan.from_preset(preset, quantizer="gptq")
    if variant == "two-pass":
        temporary = out.with_name(out.name + ".q8")
        convert(source, temporary, QuantPlan.from_preset("q8"), "q8", force=True, progress=False)
        engine = Engine(temporary, "numpy", load_tokenizer=False)
        statistics = collect_imatrix(engine, windows)
        del engine
        shutil.rmtree(temporary)
        path = out.with_name(out.name + ".imatrix.safetensors")
        statistics.write(path)
        convert(source, out, plan, preset, force=True, progress=False, imatrix=read_imatrix(path))
        path.unlink()
    else:
        calibration = LayerwiseCalibration(windows, "source" if variant.endswith("source") else "quantized")
        convert(source, out, plan, preset, force=True, progress=False, calibration=calibration)


def measure(name: str, source: Path, calib: Path, preset: str, rounds: int, work: Path) -> dict[str, dict]:
    """Wall seconds per round and peak RSS of each variant's conversion, alternating."""
    results: dict[str, dict] = {v: {"seconds": [], "peak_rss_mb": 0.0} for v in VARIANTS}
    for r in range(rounds):
        for variant in VARIANTS:
            out = work / f"{name}-{variant.replace(', ', '-')}"
            cmd = [sys.executable, __file__, "--child", variant, str(source), str(out), str(calib), preset]
            rc, wall, rss, text = run_child(cmd, work / f"{name}-{r}.log", child_env(SINGLE_BLAS))
            if rc:
                raise SystemExit(f"{name} {variant} failed:\n{text}")
            results[variant]["seconds"].append(round(wall, 2))
            results[variant]["peak_rss_mb"] = max(results[variant]["peak_rss_mb"], rss / 2**20)
            print(f"{name} round {r} {variant}: {wall:.1f} s, {rss / 2**20:.0f} MB", file=sys.stderr)
    return results


def quality(work: Path, name: str) -> dict[str, dict]:
    """KL divergence etc. of each variant's output against the fixture's f32 conversion."""
    evaluation = json.loads((FIXTURE / "eval_tokens.json").read_text())
    f32 = work / "f32"
    convert(FIXTURE, f32, QuantPlan.from_preset("f32"), "f32", force=True, progress=False)
    engine = Engine(f32, "numpy", load_tokenizer=False)
    writer = LogitsWriter(work / "base.safetensors", engine.model_hash, evaluation, engine.config.vocab_size)
    evaluate(engine, evaluation, save=writer)
    writer.close()
    out = {}
    for variant in VARIANTS:
        engine = Engine(work / f"{name}-{variant.replace(', ', '-')}", "numpy", load_tokenizer=False)
        out[variant] = evaluate(engine, evaluation, LogitsBase(work / "base.safetensors"))
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| model | variant | convert (s, per round) | peak RSS | KLD mean | ppl ratio | top-1 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r.get("quality")
        cells = (f"{q['kld_mean']:.5f} | {q['ppl_ratio']:.4f} | {100 * q['top1_agreement']:.2f}%" if q
                 else "- | - | -")
        lines.append(f"| {r['model']} | {r['variant']} | {', '.join(f'{s:.1f}' for s in r['seconds'])} | "
                     f"{r['peak_rss_mb']:.0f} MB | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=5, metavar=("VARIANT", "SOURCE", "OUT", "CALIB", "PRESET"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="q4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bench", action="store_true", help="also the benchmark model (bench_convert.py's, BF16)")
    ap.add_argument("--no-fixture", action="store_true", help="skip the trained fixture")
    ap.add_argument("--no-quality", action="store_true", help="time and memory only")
    ap.add_argument("--work", type=Path, default=Path("/tmp/glmkit-bench"),
                    help="where the benchmark source is cached (bench_convert.py's --work)")
    ap.add_argument("--json", type=Path, help="write the raw numbers here")
    args = ap.parse_args(argv)
    if args.child:
        variant, source, out, calib, preset = args.child
        convert_calibrated(variant, Path(source), Path(out), Path(calib), preset)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not args.no_fixture:
            fixture = measure("fixture", FIXTURE, FIXTURE / "calib_tokens.json", args.preset, args.rounds, work)
            scores = {} if args.no_quality else quality(work, "fixture")
            rows += [{"model": "tiny-trained", "variant": v, **fixture[v], "quality": scores.get(v)} for v in VARIANTS]
        if args.bench:
            source = source_dir(args.work, fp8=False)
            ensure_source(args.work, fp8=False, shards=10)  # bench_convert.py's default: its cached source
            cfg = ModelConfig.from_file(source / "config.json")
            rng = np.random.default_rng(0)
            calib = work / "bench-calib.json"
            calib.write_text(json.dumps(rng.integers(0, cfg.vocab_size, (BENCH_WINDOWS, BENCH_CTX)).tolist()))
            bench = measure("bench", source, calib, args.preset, args.rounds, work)
            rows += [{"model": "bench (BF16)", "variant": v, **bench[v]} for v in VARIANTS]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
