#!/usr/bin/env python3
"""Benchmark `glm-convert` on a synthetic "bench" checkpoint: wall time, throughput, peak RSS, output size.

    PYTHONPATH=. python tools/bench_convert.py                      # BF16 and FP8 sources: f32,q8,q4,q2
    PYTHONPATH=. python tools/bench_convert.py --json /tmp/bc.json --presets q4 --fp8-presets ""

The source snapshots (random weights, real HF layout, multi-shard) are built once and cached under
`--work` (default /tmp/glmkit-bench); converted containers are kept there too (`out-bf16-q4`, ...) for
tools/bench_run.py. Every conversion runs `python -m glmkit.cli.convert` in a child process; its peak RSS
comes from `wait4`'s rusage of that child alone (spawned through a small launcher: see `run_child`). The
converter reads tensor by tensor, so peak RSS should track the largest tensor (as float32, since it
upcasts), not the model: the table reports both, and the peak net of the interpreter baseline (a child that
only imports glmkit and numpy) in units of that tensor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from glmkit.convert.sources.snapshot import HFSnapshot  # noqa: E402
from glmkit.format.config import ModelConfig  # noqa: E402
from glmkit.format.schema import model_tensors  # noqa: E402
from tools.synth import write_snapshot_streaming  # noqa: E402

# ~610M parameters, ~1.2 GB of BF16: 5 layers (1 dense + 4 MoE with 64 experts, top-8) + the MTP layer.
BENCH_CONFIG = {
    "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 32768,
    "hidden_size": 1024, "num_hidden_layers": 5, "num_attention_heads": 16, "q_lora_rank": 512,
    "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "head_dim": 96,
    "intermediate_size": 4096, "moe_intermediate_size": 512, "n_routed_experts": 64, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 8000000.0, "rope_type": "default"}, "index_topk": 256,
    "index_n_heads": 8, "index_head_dim": 64, "index_topk_freq": 2, "index_skip_topk_offset": 2,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 4096, "eos_token_id": [0],
}
SEED = 0
DEFAULT_EXPERTS = 64
PRESETS = ("f32", "q8", "q4", "q2")


def bench_config(experts: int = DEFAULT_EXPERTS) -> dict:
    return {**BENCH_CONFIG, "n_routed_experts": experts}


def _suffix(experts: int) -> str:
    return "" if experts == DEFAULT_EXPERTS else f"-e{experts}"


def source_dir(work: Path, fp8: bool, experts: int = DEFAULT_EXPERTS) -> Path:
    return work / f"src-{'fp8' if fp8 else 'bf16'}{_suffix(experts)}"


def out_dir(work: Path, fp8: bool, preset: str, experts: int = DEFAULT_EXPERTS) -> Path:
    return work / f"out-{'fp8' if fp8 else 'bf16'}{_suffix(experts)}-{preset}"


def ensure_source(work: Path, fp8: bool, shards: int, rebuild: bool = False, experts: int = DEFAULT_EXPERTS
                  ) -> tuple[Path, float | None]:
    """The cached synthetic snapshot (built if missing or stale); returns (dir, seconds spent building)."""
    d = source_dir(work, fp8, experts)
    config = bench_config(experts)
    marker = d / ".bench-complete"
    want = json.dumps({"config": config, "seed": SEED, "shards": shards, "fp8": fp8}, sort_keys=True)
    if not rebuild and marker.is_file() and marker.read_text() == want:
        return d, None
    if d.exists():
        for p in d.iterdir():
            p.unlink()
    start = time.perf_counter()
    write_snapshot_streaming(d, config, shards=shards, fp8=fp8, seed=SEED)
    marker.write_text(want)
    return d, time.perf_counter() - start


def drop_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to drop these files' clean pages (works for files nobody has mapped)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# Linux carries a process's RSS high-water mark across exec, and Python spawns children with vfork: a
# child's ru_maxrss is never below its PARENT's peak RSS at spawn time. A small launcher process in between
# (started fresh, so its own peak is tiny) spawns the real command and reports that grandchild's ru_maxrss.
_LAUNCHER = ("import os, subprocess, sys\n"
             "p = subprocess.Popen(sys.argv[2:])\n"
             "_, status, usage = os.wait4(p.pid, 0)\n"
             "open(sys.argv[1], 'w').write(f'{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}')\n")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def run_child(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[int, float, int, str]:
    """Run `cmd`; returns (exit code, wall seconds, peak RSS bytes of that command alone, its stdout+stderr)."""
    status_file = log.with_suffix(".rusage")
    with open(log, "w+b") as out:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", _LAUNCHER, str(status_file), *cmd], stdout=out,
                       stderr=subprocess.STDOUT, env=env or child_env(), check=False)
        wall = time.perf_counter() - start
        out.seek(0)
        text = out.read().decode(errors="replace")
    try:
        rc, maxrss_kib = (int(x) for x in status_file.read_text().split())
    except (OSError, ValueError):
        return 1, wall, 0, text + "\n(launcher failed)"
    finally:
        status_file.unlink(missing_ok=True)
    return rc, wall, maxrss_kib * 1024, text


def baseline_rss(work: Path) -> int:
    """Peak RSS of a child that only imports what glm-convert imports."""
    code = "import numpy, ml_dtypes, tqdm, glmkit.cli.convert, glmkit.convert.convert"
    rc, _, rss, text = run_child([sys.executable, "-c", code], work / "baseline.log")
    if rc:
        raise SystemExit(f"baseline child failed:\n{text}")
    return rss


def largest_tensor(src: Path) -> tuple[str, int, int]:
    """(name, float32 bytes, source bytes) of the largest source tensor by logical element count."""
    snap = HFSnapshot(src)
    specs = model_tensors(snap.config)
    spec = max(specs, key=lambda s: math.prod(s.shape))
    return spec.name, math.prod(spec.shape) * 4, snap.source_bytes(spec)


def param_count(cfg: ModelConfig) -> int:
    return sum(math.prod(s.shape) for s in model_tensors(cfg))


def bench(work: Path, fp8: bool, presets: list[str], shards: int, baseline: int, cold: bool,
          rebuild: bool, experts: int = DEFAULT_EXPERTS, quantizer: str | None = None) -> list[dict]:
    src, built = ensure_source(work, fp8, shards, rebuild, experts)
    if built is not None:
        print(f"built {src} in {built:.1f} s", file=sys.stderr)
    shard_files = sorted(src.glob("*.safetensors"))
    source_bytes = sum(p.stat().st_size for p in shard_files)
    name, big_f32, big_src = largest_tensor(src)
    params = param_count(ModelConfig.from_file(src / "config.json"))
    rows = []
    for preset in presets:
        out = out_dir(work, fp8, preset, experts)
        if cold:
            drop_page_cache(shard_files)
        cmd = [sys.executable, "-m", "glmkit.cli.convert", str(src), str(out), "--preset", preset, "--quiet",
               "--force", *(["--quantizer", quantizer] if quantizer else [])]
        rc, wall, peak, text = run_child(cmd, work / f"convert-{out.name}.log")
        if rc:
            raise SystemExit(f"glm-convert failed ({rc}):\n{text}")
        out_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        conversion = json.loads((out / "manifest.json").read_text()).get("conversion", {})
        rows.append({
            "source": ("fp8" if fp8 else "bf16") + _suffix(experts), "preset": preset,
            "quantizer": conversion.get("quantizer", "absmax") if preset != "f32" else "-",
            "source_mb": round(source_bytes / 1e6, 1),
            "shards": len(shard_files), "params_m": round(params / 1e6, 1), "wall_s": round(wall, 2),
            "source_mb_s": round(source_bytes / 1e6 / wall, 1), "peak_rss_mb": round(peak / 1e6, 1),
            "baseline_rss_mb": round(baseline / 1e6, 1), "largest_tensor": name,
            "largest_tensor_f32_mb": round(big_f32 / 1e6, 1), "largest_tensor_source_mb": round(big_src / 1e6, 1),
            "net_peak_over_largest_f32": round((peak - baseline) / big_f32, 2),
            "out_mb": round(out_bytes / 1e6, 1), "bits_per_weight": round(out_bytes * 8 / params, 3),
            "cold_source_cache": cold,
        })
        print(f"{rows[-1]['source']} {preset}: {wall:.1f} s, peak {peak / 1e6:.0f} MB", file=sys.stderr)
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| source | preset | quantizer | params M | source MB | wall s | source MB/s | peak RSS MB "
            "| (peak - baseline) / largest f32 | out MB | bits/weight |")
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['source']} | {r['preset']} | {r['quantizer']} | {r['params_m']:.0f} | "
                     f"{r['source_mb']:.0f} | {r['wall_s']:.1f} | {r['source_mb_s']:.0f} | {r['peak_rss_mb']:.0f} | "
                     f"{r['net_peak_over_largest_f32']:.2f} | {r['out_mb']:.0f} | {r['bits_per_weight']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/glmkit-bench"), help="cache dir (default %(default)s)")
    p.add_argument("--presets", default=",".join(PRESETS), help="presets for the BF16 source (default %(default)s)")
    p.add_argument("--fp8-presets", default=",".join(PRESETS),
                   help="presets for the FP8 source ('' = skip; default %(default)s)")
    p.add_argument("--shards", type=int, default=10, help="source shards (default %(default)s)")
    p.add_argument("--cold", action="store_true", help="drop the source files from the page cache before each run")
    p.add_argument("--experts", type=int, default=DEFAULT_EXPERTS,
                   help="routed experts per layer (default %(default)s; other values get their own cache dirs)")
    p.add_argument("--quantizer", help="pass --quantizer to glm-convert (default: glm-convert's default)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached synthetic sources")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    baseline = baseline_rss(args.work)
    rows = []
    for fp8, presets in ((False, args.presets), (True, args.fp8_presets)):
        chosen = [x for x in presets.split(",") if x]
        for preset in chosen:
            if preset not in PRESETS:
                p.error(f"unknown preset {preset!r}")
        if chosen:
            rows += bench(args.work, fp8, chosen, args.shards, baseline, args.cold, args.rebuild, args.experts,
                          args.quantizer)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {_mem_gb():.0f} GB RAM",
            "python": platform.python_version(), "config": bench_config(args.experts),
            "baseline_rss_mb": round(baseline / 1e6, 1)}
    print(markdown(rows))
    print(f"\nlargest tensor: {rows[0]['largest_tensor']} = {rows[0]['largest_tensor_f32_mb']:.0f} MB as f32; "
          f"interpreter + imports baseline RSS {baseline / 1e6:.0f} MB" if rows else "")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


def _mem_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


if __name__ == "__main__":
    sys.exit(main())
