#!/usr/bin/env python3
"""Decode speed of the quantization presets against each other: the benchmark model at each preset, one device.

    PYTHONPATH=. python tools/bench_presets.py                                   # q4, q3, q2 on auto, 5 runs
    PYTHONPATH=. python tools/bench_presets.py --presets q4,q3 --device opencl --runs 3

Each run of each preset is one child process (tools/bench.py's worker: a warm-up generation, then a 256-token
prompt and 64 greedy tokens with MTP off and on); runs go round-robin over the presets, so a change of machine load
hits every preset alike, and the table gives medians. Prefill is not timed here (tools/bench.py does). Bytes per
token: the weights one decoded token reads (tools/bench.py's count), so tok/s x MB/token is the weight bandwidth the
decode achieved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench import DECODE, PROMPT, decode_bytes_per_token, run_child  # noqa: E402
from tools.bench_model import DEFAULT_WORK, ensure_bench_snapshot  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="q4,q3,q2", help="comma-separated presets (default %(default)s)")
    p.add_argument("--device", default="auto", help="glmkit device of every run (default %(default)s)")
    p.add_argument("--runs", type=int, default=5, help="runs per preset, round-robin (default %(default)s)")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK, help="where the bench model lives")
    p.add_argument("--timeout", type=float, default=900, help="seconds per child run")
    args = p.parse_args(argv)
    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    snapshots = {preset: ensure_bench_snapshot(preset, args.work) for preset in presets}
    source = args.work / "source"
    heads = json.loads((source / "config.json").read_text())["num_attention_heads"]
    results: dict[str, list[dict]] = {preset: [] for preset in presets}
    for run in range(args.runs):
        for preset in presets:
            spec = {"snapshot": str(snapshots[preset]), "source": str(source), "prefill": [], "prompt": PROMPT,
                    "decode": DECODE, "context": 0, "threads": 2, "heads": heads, "device": args.device}
            t = time.perf_counter()
            r = run_child(spec, 1, args.timeout)
            results[preset].append(r)
            print(f"run {run + 1}/{args.runs} {preset}: " + (r["error"] if "error" in r else
                  f"decode {r['decode_tok_s_mtp_off']:.2f} tok/s on {r['device']} ({time.perf_counter() - t:.0f} s)"),
                  file=sys.stderr)
    lines = [f"Benchmark model (`tools/bench_model.py`), `--device {args.device}`, medians of {args.runs} runs "
             "(round-robin over the presets); decode: 64 greedy tokens after a 256-token prompt, MTP off.", "",
             "| preset | container MB | weights read per token MB | decode tok/s (runs) | weight GB/s | "
             "against the first |", "|---|---|---|---|---|---|"]
    first = None
    for preset in presets:
        ok = [r["decode_tok_s_mtp_off"] for r in results[preset] if "error" not in r]
        if not ok:
            lines.append(f"| {preset} | failed: {results[preset][0].get('error', '')[:100]} |||||")
            continue
        median = statistics.median(ok)
        first = first or median
        size = sum(f.stat().st_size for f in snapshots[preset].glob("*.safetensors"))
        per_token = decode_bytes_per_token(snapshots[preset])
        runs = " / ".join(f"{v:.0f}" for v in ok)
        lines.append(f"| {preset} | {size / 1e6:.0f} | {per_token / 1e6:.1f} | {median:.1f} ({runs}) | "
                     f"{median * per_token / 1e9:.1f} | {median / first:.2f}x |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
