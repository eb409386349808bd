#!/usr/bin/env python3
"""Measure `glm-convert` from a (fake, local) Hub: throughput, and peak disk used in OUT vs the final output.

    PYTHONPATH=. python tools/hub_convert_bench.py [--src DIR] [--preset q4] [--max-inflight 0 16G]

Serves a local snapshot (default: tools/bench_convert.py's synthetic BF16 source, ~1.2 GB in 10 shards, built under
`--work` if missing) from
tests/fake_hub.py on 127.0.0.1, runs `python -m glmkit.cli.convert REPO OUT` in a child process for each
`--max-inflight` value, polls OUT's allocated bytes every 10 ms (peak disk), and converts the same
snapshot from the local directory for comparison. Loopback "downloads" measure glm-convert's own
overhead (transfer, sha256 verification, staging, deletion), not a network.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fake_hub import FakeHub, read_dir  # noqa: E402
from tools.bench_convert import ensure_source  # noqa: E402


def allocated_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def run(cmd: list[str], out: Path, env: dict[str, str]) -> tuple[float, int]:
    """(wall seconds, peak allocated bytes under `out`) of one conversion."""
    peak = 0
    stop = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, allocated_bytes(out) if out.exists() else 0)
            time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    stop.set()
    poller.join()
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr}")
    print("   ", proc.stdout.strip())
    return wall, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, help="snapshot to serve (default: the bench_convert BF16 source)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/glmkit-hub-bench"), help="where the source is built")
    ap.add_argument("--preset", default="q4")
    ap.add_argument("--max-inflight", nargs="+", default=["0", "16G"])
    args = ap.parse_args()
    src = args.src or ensure_source(args.work, fp8=False, shards=10)[0]
    files = {k: v for k, v in read_dir(src).items() if not k.startswith(".")}
    shards = {k: len(v) for k, v in files.items() if k.endswith(".safetensors")}
    source = sum(shards.values())
    print(f"source {src}: {len(shards)} shards, {source / 1e6:.1f} MB (largest {max(shards.values()) / 1e6:.1f} MB)")
    hub = FakeHub()
    hub.add_repo("bench/model", files)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    with tempfile.TemporaryDirectory(prefix="hub-bench-") as tmp:
        env.update(HF_HOME=f"{tmp}/hf-home", NO_PROXY="127.0.0.1,localhost", PYTHONPATH=str(ROOT))
        base = [sys.executable, "-m", "glmkit.cli.convert", "--quiet", "--preset", args.preset]
        out = Path(tmp) / "local"
        wall, _ = run([*base, str(src), str(out)], out, env)
        output = allocated_bytes(out)
        print(f"local directory: {wall:.2f} s, {source / wall / 1e6:.0f} MB/s of source; output {output / 1e6:.1f} MB")
        for budget in args.max_inflight:
            out = Path(tmp) / f"hub-{budget}"
            wall, peak = run([*base, "bench/model", str(out), "--endpoint", hub.endpoint, "--max-inflight", budget],
                             out, env)
            final = allocated_bytes(out)
            print(f"fake Hub, --max-inflight {budget}: {wall:.2f} s, {source / wall / 1e6:.0f} MB/s of source; "
                  f"peak disk in OUT {peak / 1e6:.1f} MB = final {final / 1e6:.1f} MB + {(peak - final) / 1e6:.1f} MB "
                  f"({peak / final:.2f}x)")
    hub.close()


if __name__ == "__main__":
    main()
