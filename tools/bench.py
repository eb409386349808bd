#!/usr/bin/env python3
"""Backend benchmark: NumPy vs OpenCL (every operation a kernel) vs auto (measured placement) vs transformers.

    PYTHONPATH=. python tools/bench.py --model bench --preset q4 --devices numpy,opencl   # table + JSON
    PYTHONPATH=. python tools/bench.py --runs 3 --json /tmp/bench.json --md /tmp/bench.md # the documented run

The model is the benchmark-size random checkpoint of tools/bench_model.py (converted on first use), or with
`--snapshot` a converted one (e.g. the trained fixture, its own text as the prompt: `--prompt-tokens`). Per
device and preset, each run is one child process (`--worker`), runs go round-robin over the devices (so
a change in machine load hits every device alike) and the table shows medians over `--runs`:
- prefill tok/s at 256 and 1,024 tokens: `model.forward(ids, new cache, last_logits_only=True)` (after a
  short warm-up generation with and without MTP, so kernel builds and first page faults are not counted);
- TTFT: a 256-token prompt through `Generator` until its first token;
- decode tok/s over 64 tokens (`--decode`) after that prompt, MTP off and on (greedy, no EOS: always that many
  tokens; the random model's MTP head rarely agrees, so MTP on mostly costs); `--mtp-rounds N` decodes MTP off
  then on N times per run, alternately, and reports the medians and each alternation's on / off ratio;
- peak RSS during decode (VmHWM reset through /proc/self/clear_refs once the first token is out, i.e. after
  the prompt's prefill) next to the process's RSS before the snapshot was opened (interpreter, NumPy, OpenCL
  runtime and built kernels):
  the RSS check is `peak - baseline < container bytes + KV cache bytes` (the mapping is never copied);
- the bandwidth ceiling: bytes of weights one decoded token reads (every non-expert tensor of the main
  layers, the lm_head, `num_experts_per_tok` routed experts per MoE layer; MTP off) divided by the best
  memory read bandwidth measured in the run (NumPy on one thread, an OpenCL kernel on every core; measured
  before every round, the best taken); for a row on a GPU, its own memory's read bandwidth (a kernel streaming
  a matrix uploaded to it, glmkit.backends.devices). Beside the ceiling fraction (median decode / best sample), a
  host row also lists each round's decode over the bandwidth sampled just before that round.
With `--context N`, glmkit rows also decode 32 greedy tokens after an N-token prompt (MTP off): decode at long
context, where the attention and the indexer read N keys (the table's figures are at 256 tokens).
Devices: `numpy@N` = NumPy with N OpenBLAS threads (`numpy` = --blas-threads), `opencl[:P:D]` = every
operation as an OpenCL kernel, `auto` = the measured placement (glmkit.backends.devices), `transformers` =
GlmMoeDsaForCausalLM (transformers 5.23.0, float32, eager attention) on the same BF16 source weights
(needs the `oracle` extra; skipped with a note otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench_run import proc_status  # noqa: E402

PREFILL = (256, 1024)
PROMPT = 256
DECODE = 64
CONTEXT_DECODE = 32  # tokens decoded after the --context prompt


# ---- child side ---------------------------------------------------------------------------------

def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def token_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab - 2, n).tolist()  # the last ids are the eos ids


def worker_glmkit(spec: dict) -> dict:
    import numpy as np

    from glmkit.generate.engine import Engine
    from glmkit.generate.generator import Generator
    from glmkit.generate.sampling import Sampler, SamplingParams

    device = spec["device"]
    if device.startswith("opencl") or device == "auto":
        from glmkit.backends.devices import parse_device, pick
        from glmkit.backends.opencl.device import list_devices
        from glmkit.backends.opencl.ops import Kernels

        _, p, d = parse_device("opencl" if device == "auto" else device)
        found = list_devices()
        if found:
            Kernels(pick(found, p, d))  # the OpenCL runtime and a built program belong to the baseline
    baseline = proc_status()["VmRSS"]
    t = time.perf_counter()
    engine = Engine(spec["snapshot"], device.split("@")[0], load_tokenizer=False,
                    expert_cache=spec.get("expert_cache", 0))
    open_s = time.perf_counter() - t
    model, vocab = engine.model, engine.config.vocab_size
    result: dict = {"device": engine.device, "numerics": engine.backend.numerics, "open_s": open_s,
                    "baseline_rss": baseline}
    # warm-up: every kernel is built on its first launch (PoCL caches the builds on disk), not while timed
    for mtp in (False, True):
        list(Generator(model, (), use_mtp=mtp).generate(token_ids(8, vocab, 9), 3, Sampler(SamplingParams())))
    for n in spec["prefill"]:
        ids = np.array(token_ids(n, vocab))
        t = time.perf_counter()
        model.forward(ids, model.new_cache(), last_logits_only=True)
        result[f"prefill_{n}_tok_s"] = n / (time.perf_counter() - t)
    prompt = spec.get("prompt_ids") or token_ids(spec["prompt"], vocab)
    speeds: dict[str, list[float]] = {"mtp_off": [], "mtp_on": []}
    for mtp in (False, True) * spec.get("mtp_rounds", 1):  # MTP off and on alternately, the medians reported
        gen = Generator(model, (), use_mtp=mtp)
        cache = model.new_cache()
        stream = gen.generate(prompt, spec["decode"] + 1, Sampler(SamplingParams()), cache)
        tokens = [next(stream)]  # the prompt's prefill: its temporaries are not decode's
        reset_peak_rss()
        tokens += list(stream)
        key = "mtp_on" if mtp else "mtp_off"
        stats = gen.stats
        speeds[key].append((len(tokens) - 1) / stats.decode_s)
        result[f"ttft_s_{key}"] = stats.ttft_s
        result[f"peak_rss_decode_{key}"] = proc_status()["VmHWM"]
        if mtp:
            result["mtp_acceptance"] = stats.mtp_acceptance
        kv = sum(a.nbytes for layer in cache.layers for a in layer._data.values())
        result[f"kv_bytes_{key}"] = kv
    for key, values in speeds.items():
        result[f"decode_tok_s_{key}"] = statistics.median(values)
        result[f"decode_tok_s_{key}_rounds"] = values
    if spec.get("short_prompt"):  # TTFT of a short prompt: on the step, queued or each token waiting; batched
        short = token_ids(spec["short_prompt"], vocab, 2)
        ttft: dict[str, list[float]] = {"step": [], "step_waiting": [], "batch": []}
        for _ in range(spec.get("mtp_rounds", 1)):
            for name, rows, queued in (("step", len(short), True), ("step_waiting", len(short), False),
                                       ("batch", 0, True)):
                gen = Generator(model, (), use_mtp=False, step_prefill=rows, queue_prompt=queued)
                list(gen.generate(short, 1, Sampler(SamplingParams())))
                ttft[name].append(gen.stats.ttft_s)
        for name, values in ttft.items():
            result[f"ttft_short_{name}_s"] = statistics.median(values)
        # the queued step over the waiting one, per round (alternated: a change of load hits both alike)
        result["ttft_short_queued_ratios"] = [q / w for q, w in zip(ttft["step"], ttft["step_waiting"], strict=True)]
    if spec.get("context"):
        gen = Generator(model, (), use_mtp=False)
        list(gen.generate(token_ids(spec["context"], vocab, 1), CONTEXT_DECODE + 1, Sampler(SamplingParams())))
        result["decode_tok_s_context"] = CONTEXT_DECODE / gen.stats.decode_s
    result["status_end"] = proc_status()
    result["cpu_s"] = time.process_time()
    kernels = getattr(engine.backend, "k", None)
    if kernels is not None and kernels.info.kind != "cpu":  # after the measurements: it uploads 64 MB
        from glmkit.backends.devices import measure_bandwidth as device_bandwidth

        result["device_read_gbs"] = device_bandwidth(kernels)["device_read_gbs"]
    return result


def worker_transformers(spec: dict) -> dict:
    import torch
    from transformers import GenerationConfig, GlmMoeDsaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(spec["threads"])
    baseline = proc_status()["VmRSS"]
    t = time.perf_counter()
    # the bench config omits num_key_value_heads (glmkit does not use it); transformers' default (64) is wrong
    model = GlmMoeDsaForCausalLM.from_pretrained(spec["source"], dtype=torch.float32, attn_implementation="eager",
                                                 num_key_value_heads=spec["heads"]).eval()
    result: dict = {"device": f"transformers (fp32, eager attention, {spec['threads']} threads)",
                    "open_s": time.perf_counter() - t, "baseline_rss": baseline}
    vocab = model.config.vocab_size
    with torch.no_grad():
        model(torch.tensor([token_ids(8, vocab, 9)]), use_cache=False, logits_to_keep=1)  # warm-up
        for n in spec["prefill"]:
            ids = torch.tensor([token_ids(n, vocab)])
            t = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            result[f"prefill_{n}_tok_s"] = n / (time.perf_counter() - t)
        prompt = torch.tensor([token_ids(spec["prompt"], vocab)])

        class TokenTimes:  # a transformers streamer: when each token arrives (the prompt is put first)
            def __init__(self) -> None:
                self.times: list[float] = []

            def put(self, _value: object) -> None:
                self.times.append(time.perf_counter())
                if len(self.times) == 2:  # the first token: decode's RSS peak starts here, as for glmkit
                    reset_peak_rss()

            def end(self) -> None:
                pass

        n = spec["decode"] + 1
        cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                               pad_token_id=0)
        arrivals = TokenTimes()
        t = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=cfg, streamer=arrivals)
        result["peak_rss_decode_mtp_off"] = proc_status()["VmHWM"]
    first, last = arrivals.times[1], arrivals.times[-1]  # one run: TTFT and decode cannot overlap
    result["ttft_s_mtp_off"] = first - t
    result["decode_tok_s_mtp_off"] = (len(arrivals.times) - 2) / (last - first)
    result["status_end"] = proc_status()
    return result


def worker(spec: dict) -> dict:
    if spec["device"] == "transformers":
        return worker_transformers(spec)
    return worker_glmkit(spec)


# ---- parent side --------------------------------------------------------------------------------

def decode_bytes_per_token(snapshot: Path) -> int:
    """Weight bytes one decoded token reads (MTP off): see the module docstring."""
    from glmkit.backends.devices import decode_bytes_per_token as count
    from glmkit.format.reader import Container

    c = Container(snapshot)
    try:
        return count(c)
    finally:
        c.close()


def measure_bandwidth(nbytes: int = 512 << 20) -> dict[str, float]:
    """Best memory read bandwidth in GB/s: NumPy on one thread and an OpenCL kernel on every core."""
    import numpy as np

    data = np.ones(nbytes // 4, np.float32)
    out = {}
    times = []
    for _ in range(5):
        t = time.perf_counter()
        data.sum(dtype=np.float64)
        times.append(time.perf_counter() - t)
    out["numpy_read_gbs"] = nbytes / min(times) / 1e9
    try:
        from glmkit.backends.opencl.backend import OpenCLBackend, Placement
        from glmkit.backends.opencl.device import list_devices
        from glmkit.backends.opencl.ops import Kernels

        found = [d for d in list_devices() if d.kind == "cpu"]
        if found:
            k = Kernels(found[0])
            backend = OpenCLBackend(k, Placement.all_cl(k.direct))
            matrix = data.reshape(8192, -1)
            cw = backend._cw(matrix)
            x = np.ones((1, matrix.shape[1]), np.float32)
            times = []
            for _ in range(5):
                t = time.perf_counter()
                k.matvec(cw, x)
                times.append(time.perf_counter() - t)
            out["opencl_read_gbs"] = nbytes / min(times) / 1e9
    except Exception as e:  # noqa: BLE001 - the ceiling then rests on NumPy's number alone
        out["opencl_error"] = str(e)[:200]
    return out


def run_child(spec: dict, blas_threads: int, timeout: float) -> dict:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(blas_threads), "OMP_NUM_THREADS": str(blas_threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    notices = [line for line in proc.stderr.splitlines() if line.startswith("glmkit:")]
    return {**result, "notices": notices} if notices else result


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def summarize(results: dict[str, list[dict]], bytes_per_token: int, bandwidth: float, container: int,
              round_bandwidth: list[float] | None = None) -> dict[str, dict]:
    """Per device: medians over its runs, the "% of ceiling" (median decode / the best bandwidth sample; a GPU row:
    its own memory's), and for host rows also each round's decode over the bandwidth sampled just before that
    round (`round_bandwidth`, GB/s per round; information beside the ceiling fraction)."""
    table = {}
    for name, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        row = {"runs": len(ok), "errors": [r["error"] for r in runs if "error" in r]}
        if ok:
            row["device"] = ok[0]["device"]
            for key in ("prefill_256_tok_s", "prefill_1024_tok_s", "ttft_s_mtp_off", "decode_tok_s_mtp_off",
                        "decode_tok_s_mtp_on", "mtp_acceptance", "peak_rss_decode_mtp_off", "baseline_rss",
                        "kv_bytes_mtp_off", "decode_tok_s_context", "ttft_short_step_s", "ttft_short_step_waiting_s",
                        "ttft_short_batch_s"):
                row[key] = median(ok, key)
            row["all_decode_tok_s_mtp_off"] = [round(r["decode_tok_s_mtp_off"], 2) for r in ok]
            row["ttft_short_queued_ratios"] = [x for r in ok for x in r.get("ttft_short_queued_ratios", ())]
            # MTP on over off per alternation (each on-decode beside the off-decode just before it)
            row["mtp_round_ratios"] = [round(on / off, 3) for r in ok for off, on in
                                       zip(r.get("decode_tok_s_mtp_off_rounds", ()),
                                           r.get("decode_tok_s_mtp_on_rounds", ()), strict=True)]
            # a GPU's ceiling is its own memory's read bandwidth, not the host's
            device_bw = [r["device_read_gbs"] for r in ok if r.get("device_read_gbs")]
            row["bandwidth_gbs"] = max(device_bw) if device_bw else bandwidth
            ceiling = row["bandwidth_gbs"] * 1e9 / bytes_per_token
            if row["decode_tok_s_mtp_off"]:
                row["ceiling_fraction"] = row["decode_tok_s_mtp_off"] / ceiling
            if not device_bw and round_bandwidth and len(round_bandwidth) == len(runs):
                row["round_ceiling_fractions"] = [r["decode_tok_s_mtp_off"] * bytes_per_token / (gbs * 1e9)
                                                  for r, gbs in zip(runs, round_bandwidth, strict=True)
                                                  if "error" not in r]
            if row.get("peak_rss_decode_mtp_off") and row.get("baseline_rss") is not None:
                row["decode_rss_over_baseline"] = row["peak_rss_decode_mtp_off"] - row["baseline_rss"]
                row["rss_limit"] = container + (row.get("kv_bytes_mtp_off") or 0)
        table[name] = row
    return table


def fmt(v, digits=1, scale=1.0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def markdown(table: dict[str, dict], meta: dict) -> str:
    lines = [
        f"Model: {meta.get('model') or 'benchmark-size random GLM-5 (`tools/bench_model.py`)'}, preset "
        f"{meta['preset']}, container "
        f"{meta['container_bytes'] / 1e6:.0f} MB; {meta['cpu']}, {meta['cores']} cores, load average at start "
        f"{meta['load_start']}. Medians of {meta['runs']} runs (round-robin over the devices).",
        f"Bandwidth ceiling: {meta['bytes_per_token'] / 1e6:.1f} MB of weights per decoded token / "
        f"{meta['bandwidth_gbs']:.1f} GB/s best measured read bandwidth = {meta['ceiling_tok_s']:.0f} tok/s.",
        *[f"{name}: its ceiling is the device's own read bandwidth, {row['bandwidth_gbs']:.1f} GB/s = "
          f"{row['bandwidth_gbs'] * 1e9 / meta['bytes_per_token']:.0f} tok/s." for name, row in table.items()
          if row.get("bandwidth_gbs") not in (None, meta["bandwidth_gbs"])],
        "",
        "| device | prefill 256 tok/s | prefill 1024 tok/s | TTFT 256 s | decode tok/s MTP off | decode tok/s MTP on "
        "(acceptance) | % of BW ceiling | decode peak RSS MB (over baseline) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in table.items():
        if not row.get("runs"):
            lines.append(f"| {name} | failed: {'; '.join(row['errors'])[:120]} |||||||")
            continue
        mtp = fmt(row.get("decode_tok_s_mtp_on"), 2)
        if row.get("mtp_acceptance") is not None:
            mtp += f" ({row['mtp_acceptance']:.2f})"
        rss = fmt(row.get("peak_rss_decode_mtp_off"), 0, 1e-6)
        if row.get("decode_rss_over_baseline") is not None:
            rss += f" ({row['decode_rss_over_baseline'] / 1e6:.0f})"
        lines.append(f"| {name}: {row['device']} | {fmt(row.get('prefill_256_tok_s'))} | "
                     f"{fmt(row.get('prefill_1024_tok_s'))} | {fmt(row.get('ttft_s_mtp_off'), 2)} | "
                     f"{fmt(row.get('decode_tok_s_mtp_off'), 2)} | {mtp} | {fmt(row.get('ceiling_fraction'), 1, 100)} "
                     f"| {rss} |")
    if meta.get("context"):
        lines += ["", f"Decode at {meta['context']} tokens of context (MTP off, {CONTEXT_DECODE} tokens): " + ", ".join(
            f"{name} {fmt(row.get('decode_tok_s_context'), 2)} tok/s" for name, row in table.items()
            if row.get("decode_tok_s_context"))]
    return "\n".join(lines)


def ratios(table: dict[str, dict]) -> list[str]:
    def best(prefix: str, key: str) -> tuple[str, float] | None:
        rows = [(n, r[key]) for n, r in table.items() if n.startswith(prefix) and r.get(key)]
        return max(rows, key=lambda x: x[1]) if rows else None

    out = []
    tf_dec, tf_pre = best("transformers", "decode_tok_s_mtp_off"), best("transformers", "prefill_1024_tok_s")
    np_dec = best("numpy", "decode_tok_s_mtp_off")
    for name in [n for n in table if n.startswith(("opencl", "auto"))]:
        row = table[name]
        dec = row.get("decode_tok_s_mtp_off")
        if not dec:
            continue
        parts = [f"{name}: decode"]
        if tf_dec:
            parts.append(f"{dec / tf_dec[1]:.1f}x transformers")
        if np_dec:
            parts.append(f"{dec / np_dec[1]:.2f}x {np_dec[0]}")
        if row.get("ceiling_fraction") is not None:
            parts.append(f"{row['ceiling_fraction'] * 100:.0f}% of the ceiling")
        if row.get("round_ceiling_fractions"):
            each = " / ".join(f"{f * 100:.0f}%" for f in row["round_ceiling_fractions"])
            parts.append(f"per round against that round's bandwidth sample {each}")
        if tf_pre and row.get("prefill_1024_tok_s"):
            parts.append(f"prefill 1024 {row['prefill_1024_tok_s'] / tf_pre[1]:.2f}x transformers")
        if row.get("mtp_round_ratios"):
            each = statistics.median(row["mtp_round_ratios"])
            parts.append(f"MTP on / off {each:.2f}x (median of {len(row['mtp_round_ratios'])} alternations, "
                         f"{min(row['mtp_round_ratios']):.2f}-{max(row['mtp_round_ratios']):.2f})")
        if row.get("decode_rss_over_baseline") is not None:
            parts.append(f"decode RSS over baseline {row['decode_rss_over_baseline'] / 1e6:.0f} MB vs container + KV "
                         f"{row['rss_limit'] / 1e6:.0f} MB")
        out.append(", ".join(parts))
    return out


def prompt_from_file(path: Path, n: int) -> list[int]:
    """The first n token ids of a JSON list (or of the first list in a list of lists)."""
    ids = json.loads(path.read_text())
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids[:n]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", default="bench", choices=["bench"], help="the benchmark-size model (bench_model.py)")
    p.add_argument("--preset", default="q4", help="conversion preset (default %(default)s)")
    p.add_argument("--devices", default="numpy@1,numpy@2,opencl,auto,transformers",
                   help="comma-separated: numpy[@BLAS_THREADS], opencl[:P:D], auto, transformers")
    p.add_argument("--runs", type=int, default=3, help="runs per device, round-robin (default %(default)s)")
    p.add_argument("--blas-threads", type=int, default=2, help="OpenBLAS threads of `numpy` rows (default 2)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for transformers (default 2)")
    p.add_argument("--work", type=Path, help="where the bench model lives (default tools/bench_model.DEFAULT_WORK)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child run")
    p.add_argument("--json", type=Path, help="write every run and the summary here")
    p.add_argument("--md", type=Path, help="write the markdown table here")
    p.add_argument("--context", type=int, default=0, help="glmkit rows: also decode after a prompt of this many "
                                                             "tokens (e.g. 4000; default off)")
    p.add_argument("--snapshot", type=Path, help="a converted snapshot to measure instead of the bench model "
                                                 "(glmkit rows only)")
    p.add_argument("--prompt-tokens", type=Path, help="JSON token ids (a list, or a list of lists: the first) for "
                                                      "the decode prompt, its first --prompt (default random ids)")
    p.add_argument("--decode", type=int, default=DECODE, help="tokens decoded per measurement (default %(default)s)")
    p.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens before the decode (default %(default)s)")
    p.add_argument("--mtp-rounds", type=int, default=1, help="decode MTP off, then on, this many times per run "
                                                             "(medians; default %(default)s)")
    p.add_argument("--short-prompt", type=int, default=0, help="glmkit rows: also the TTFT of a prompt of this many "
                                                               "tokens prefilled on the decode step (its forwards "
                                                               "queued, and each waiting for its logits) and as one "
                                                               "batched forward, alternately (--mtp-rounds times)")
    p.add_argument("--expert-cache", type=int, default=0, help="glmkit rows: the routed experts in an expert cache "
                                                               "of this many bytes (glm-run's --expert-cache; default "
                                                               "the page cache)")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    from tools.bench_model import DEFAULT_WORK, ensure_bench_snapshot

    work = args.work or DEFAULT_WORK
    snapshot = args.snapshot or ensure_bench_snapshot(args.preset, work)
    source = snapshot if args.snapshot else work / "source"
    container = sum(f.stat().st_size for f in snapshot.glob("*.safetensors"))
    bytes_per_token = decode_bytes_per_token(snapshot)
    load_start = os.getloadavg()[0]
    # the bandwidth is measured before every round and the best taken: a measurement the machine's other load
    # disturbed can only lower it, and a low ceiling would flatter the "% of ceiling" column
    samples = [measure_bandwidth()]
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if args.snapshot and "transformers" in devices:
        print("--snapshot: no transformers row (it runs the bench model's BF16 source)", file=sys.stderr)
        devices.remove("transformers")
    if "transformers" in devices:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError:
            print("transformers/torch not installed (pip install -e '.[oracle]'): skipping that row", file=sys.stderr)
            devices.remove("transformers")
    base = {"snapshot": str(snapshot), "source": str(source), "prefill": list(PREFILL), "prompt": args.prompt,
            "decode": args.decode, "context": args.context, "short_prompt": args.short_prompt, "threads": args.threads,
            "mtp_rounds": args.mtp_rounds, "expert_cache": args.expert_cache,
            "prompt_ids": prompt_from_file(args.prompt_tokens, args.prompt) if args.prompt_tokens else None,
            "heads": json.loads((source / "config.json").read_text())["num_attention_heads"]}
    results: dict[str, list[dict]] = {d: [] for d in devices}
    for run in range(args.runs):
        if run:
            samples.append(measure_bandwidth())
        for device in devices:
            threads = int(device.split("@")[1]) if "@" in device else args.blas_threads
            t = time.perf_counter()
            r = run_child({**base, "device": device}, threads, args.timeout)
            r["wall_s"] = time.perf_counter() - t
            results[device].append(r)
            print(f"run {run + 1}/{args.runs} {device}: "
                  + (r["error"] if "error" in r else f"decode {r['decode_tok_s_mtp_off']:.2f} tok/s, "
                     f"prefill 1024 {r['prefill_1024_tok_s']:.1f} tok/s ({r['wall_s']:.0f} s)"), file=sys.stderr)
            for line in r.get("notices", []):  # e.g. a device that fell back to numpy
                print(f"  {line}", file=sys.stderr)
    bw = {key: max(sample.get(key, 0.0) for sample in samples) for key in samples[0] if key.endswith("_gbs")}
    rounds = [max(v for k, v in sample.items() if k.endswith("_gbs")) for sample in samples]  # each round's best path
    bandwidth = max(rounds)
    table = summarize(results, bytes_per_token, bandwidth, container, rounds)
    meta = {"preset": args.preset, "model": str(args.snapshot or ""), "container_bytes": container,
            "bytes_per_token": bytes_per_token,
            "bandwidth": bw, "bandwidth_samples": samples, "bandwidth_gbs": bandwidth,
            "ceiling_tok_s": bandwidth * 1e9 / bytes_per_token,
            "runs": args.runs, "context": args.context, "cores": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(),
            "load_start": round(load_start, 1), "load_end": round(os.getloadavg()[0], 1),
            "command": "python tools/bench.py " + " ".join(sys.argv[1:])}
    text = markdown(table, meta) + "\n\n" + "\n".join(f"- {line}" for line in ratios(table))
    for device, row in table.items():
        if row.get("ttft_short_step_s"):
            ratios_short = sorted(round(x, 3) for x in row["ttft_short_queued_ratios"])
            text += (f"\n- {device}: TTFT of a {args.short_prompt}-token prompt {row['ttft_short_step_s']:.3f} s "
                     f"on the decode step with its forwards queued, {row['ttft_short_step_waiting_s']:.3f} s one "
                     f"token per forward each waiting for its logits, {row['ttft_short_batch_s']:.3f} s as one "
                     f"batched forward; queued over waiting per round {statistics.median(ratios_short):.3f}x "
                     f"({ratios_short[0]}-{ratios_short[-1]})")
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "summary": table, "runs": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
