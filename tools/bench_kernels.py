#!/usr/bin/env python3
"""Microbenchmarks of the OpenCL side of decode: what a launch costs and how fast the int4 kernels run.

    PYTHONPATH=. python tools/bench_kernels.py                  # the first OpenCL device (PoCL's CPU here)
    POCL_MAX_PTHREAD_COUNT=1 PYTHONPATH=. python tools/bench_kernels.py   # per-core numbers on PoCL
    PYTHONPATH=. python tools/bench_kernels.py --glm5           # the experts only, at GLM-5's shapes
    PYTHONPATH=. python tools/bench_kernels.py --expert-bits 4,3,2 --glm5   # the experts at int4, int3 and int2
    PYTHONPATH=. python tools/bench_kernels.py --expert-bits 4,nl4          # uniform int4 against the nl4 table

- launch: an empty kernel launched and waited for, one at a time, and launched back to back with one wait
  (the host round trip against the driver's own dispatch cost); and the device's idle time between queued
  launches, after a one-work-group kernel and after a kernel that ran on every worker thread;
- matvec: `mv_q4` (int4 group 64) over a cache-resident 8 MB and a streamed 64 MB matrix, one input row, with
  float inputs and with int8-quantized ones (`mv_q4_x8`, the device decode step's default);
- experts: the device decode step's expert kernels over 9 of 32 experts with the benchmark model's shapes (hidden
  1024, moe_intermediate 512), one token, experts picked at random per run: float inputs (`eg_q4` gate+up with
  SiLU; `edp_q4` + `expert_sum`, down per slot and the slots' sum) and int8 inputs (`eg_q4_x8`; `edp_q4_x8` +
  `expert_sum`); with `--glm5`, at GLM-5's shapes (hidden 6144, moe_intermediate 2048: 19 MB per expert, a pool
  of 24 so that a token's experts are not in the cache from the token before), and two of its attention
  products (q_a, o_proj) with int8 inputs;
- with `--expert-bits`, only the experts, at each of those widths in turn (int2 experts take float inputs only;
  `nl4`: 4-bit codes of the nl4 table, q4's default), the widths alternated over `--rounds` rounds (medians of
  each round's median).
GB/s counts the codes and the float scales (one per 64 columns) read. Kernel times come from an OpenCL
profiling queue: medians over `--runs` launches after 10 warm-up launches.
On a shared machine compare rows measured in one run, never across runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmkit.backends.opencl.buffers import Int8Codes  # noqa: E402
from glmkit.backends.opencl.decode_launches import (  # noqa: E402
    ExpertSlots,
    bind_experts,
    bind_experts_x8,
    bind_matvec,
    bind_matvec_x8,
    bind_quantize,
)
from glmkit.backends.opencl.device import available, cl, list_devices  # noqa: E402
from glmkit.backends.opencl.ops import Kernels  # noqa: E402
from glmkit.backends.opencl.weights import X8_BLOCK, ClWeight, ExpertShape, x8_eligible  # noqa: E402
from glmkit.format.packing import packed_row_bytes  # noqa: E402

HIDDEN, INTER, GROUP, SLOTS, EXPERTS = 1024, 512, 64, 9, 32


def seconds(event) -> float:
    event.wait()
    return (event.profile.end - event.profile.start) * 1e-9


def bench_launch(kernels: Kernels, runs: int) -> dict[str, float]:
    """Microseconds per empty-kernel launch: waited for one by one, and queued back to back."""
    program = cl.Program(kernels.ctx, "__kernel void nop(__global float* y) { }").build()
    nop = cl.Kernel(program, "nop")
    buf = kernels.buffers.device_buffer(4096)  # kept alive while nop runs
    nop.set_args(buf)
    for _ in range(50):
        cl.enqueue_nd_range_kernel(kernels.queue, nop, (64,), (4,)).wait()
    t = time.perf_counter()
    for _ in range(runs):
        cl.enqueue_nd_range_kernel(kernels.queue, nop, (64,), (4,)).wait()
    waited = (time.perf_counter() - t) / runs
    t = time.perf_counter()
    for _ in range(runs):
        event = cl.enqueue_nd_range_kernel(kernels.queue, nop, (64,), (4,))
    event.wait()
    queued = (time.perf_counter() - t) / runs
    return {"launch_and_wait_us": waited * 1e6, "queued_us": queued * 1e6, **bench_gaps(kernels, runs // 10)}


def bench_gaps(kernels: Kernels, runs: int) -> dict[str, float]:
    """Device idle (us, median, from the profiling queue) between queued launches: after a one-work-group kernel,
    and after a kernel of many work-groups that keeps every worker thread busy for ~50-100 us (on PoCL's pthread
    device the gap after the latter is what a decoded token's ~150 launches mostly pay)."""
    n_big = 1 << 18
    src, dst = kernels.buffers.array(n_big), kernels.buffers.array(n_big)
    small = kernels.bind("add_into", (16,), (16,), y=dst.buffer, a=src.buffer, n=16)
    big = kernels.bind("add_into", (n_big,), None, y=dst.buffer, a=src.buffer, n=n_big)
    gaps: dict[str, list[float]] = {"gap_after_small_us": [], "gap_after_big_us": []}
    for i in range(runs + 10):
        events = [small.enqueue(), small.enqueue(), big.enqueue(), small.enqueue()]
        events[-1].wait()
        if i >= 10:
            gaps["gap_after_small_us"].append((events[1].profile.start - events[0].profile.end) * 1e-3)
            gaps["gap_after_big_us"].append((events[3].profile.start - events[2].profile.end) * 1e-3)
    return {name: float(np.median(values)) for name, values in gaps.items()}


def x8_scratch(kernels: Kernels, name: str, n: int) -> Int8Codes:
    """Buffers for n int8-quantized inputs: codes (both orders, 2n bytes), scales and code sums per block."""
    blocks, b = n // X8_BLOCK, kernels.buffers
    return Int8Codes(b.out(name + "_q", 2 * n), b.out(name + "_s", 4 * blocks), b.out(name + "_sum", 4 * blocks))


def bench_matvec(kernels: Kernels, rows: int, runs: int, rng: np.random.Generator, x8: bool,
                 n_in: int = HIDDEN) -> dict[str, float]:
    """`mv_q4` (x8: `mv_q4_x8` after quantizing the input once) over a random int4 g64 matrix `[rows, n_in]`:
    G codes/s and GB/s of packed weights."""
    packed = rng.integers(0, 256, (rows, n_in // 2), dtype=np.uint8)
    scales = np.full((rows, n_in // GROUP), 0.01, np.float32)
    b = kernels.buffers
    w = ClWeight(b.read_only_in_place(packed), 0, b.read_only_in_place(scales), 0, 4, GROUP, n_in // GROUP, rows,
                 n_in, n_in // 2)
    xb = b.put("x", rng.standard_normal((1, n_in), dtype=np.float32))
    yb = b.out("y", rows * 4)
    if x8:
        scratch = x8_scratch(kernels, "x", n_in)
        bind_quantize(kernels, xb, n_in, 1, scratch).enqueue().wait()
        product = bind_matvec_x8(kernels, w, scratch, yb)
    else:
        product = bind_matvec(kernels, w, xb, yb)
    times = [seconds(product.enqueue()) for _ in range(runs + 10)][10:]
    t = float(np.median(times))
    return {"ms": t * 1e3, "gcodes_s": rows * n_in / t / 1e9, "gb_s": packed.nbytes / t / 1e9}


def expert_blob(rng: np.random.Generator, hidden: int, inter: int, experts: int, bits: int = 4
                ) -> tuple[np.ndarray, list[int]]:
    """`experts` g64 experts of `bits`-bit random codes laid out like a container: gate, gate scales, up, up scales,
    down, down scales."""
    sizes = [inter * packed_row_bytes(hidden, bits), inter * (hidden // GROUP) * 4] * 2 + [
        hidden * packed_row_bytes(inter, bits), hidden * (inter // GROUP) * 4]
    per = sum(sizes)
    blob = rng.integers(0, 256, experts * per, dtype=np.uint8)
    starts = [sum(sizes[:k]) for k in range(6)]
    for e in range(experts):
        for k in (1, 3, 5):  # scale regions hold valid floats
            blob[e * per + starts[k]: e * per + starts[k] + sizes[k]].view(np.float32)[:] = 0.01
    return blob, [e * per for e in range(experts)] + starts


def bench_experts(kernels: Kernels, runs: int, rng: np.random.Generator, x8: bool, hidden: int = HIDDEN,
                  inter: int = INTER, experts: int = EXPERTS, bits: int = 4, scheme: str = "symmetric"
                  ) -> dict[str, float]:
    """The device decode step's expert kernels over SLOTS of `experts` random `bits`-bit experts (of quant scheme
    `scheme`) for one token, float or int8 inputs: G codes/s and GB/s (codes and scales) of gate+up and of down
    (down per slot plus the slots' sum)."""
    blob, layout = expert_blob(rng, hidden, inter, experts, bits)
    expert_starts, starts = layout[:experts], layout[experts:]
    b = kernels.buffers
    buf = b.read_only_in_place(blob)
    x = b.put("x", rng.standard_normal((1, hidden), dtype=np.float32))
    slots = ExpertSlots(b.out("offs", SLOTS * 6 * 8), b.put("slot_tok", np.zeros(SLOTS, np.uint32), np.uint32),
                        b.put("tok_start", np.array([0, SLOTS], np.uint32), np.uint32),
                        b.put("slot_w", np.ones(SLOTS, np.float32)), SLOTS)
    hid, y, part = b.out("hid", SLOTS * inter * 4), b.out("y", hidden * 4), b.out("part", SLOTS * hidden * 4)
    shape = ExpertShape(bits, GROUP, hidden // GROUP, hidden, inter, packed_row_bytes(hidden, bits),
                        packed_row_bytes(inter, bits), inter // GROUP, scheme)
    quantize = None
    if x8:
        x_codes = x8_scratch(kernels, "x", hidden)
        bind_quantize(kernels, x, hidden, 1, x_codes).enqueue().wait()
        gate_up, quantize, down, total = bind_experts_x8(kernels, buf, shape, x_codes, slots, hid,
                                                         x8_scratch(kernels, "hid", SLOTS * inter), part, y)
    else:
        gate_up, down, total = bind_experts(kernels, buf, shape, x, slots, hid, part, y)
    times: dict[str, list[float]] = {"gate_up": [], "down": []}
    for _ in range(runs + 10):
        chosen = rng.choice(experts, SLOTS, replace=False)
        b.put("offs", np.array([[expert_starts[e] + s for s in starts] for e in chosen], np.uint64), np.uint64)
        times["gate_up"].append(seconds(gate_up.enqueue()))
        if quantize is not None:
            quantize.enqueue()
        times["down"].append(seconds(down.enqueue()) + seconds(total.enqueue()))
    codes = {"gate_up": 2 * SLOTS * inter * hidden, "down": SLOTS * hidden * inter}
    out = {}
    for name, ts in times.items():
        t = float(np.median(ts[10:]))
        out[f"{name}_ms"] = t * 1e3
        out[f"{name}_gcodes_s"] = codes[name] / t / 1e9
        out[f"{name}_gb_s"] = codes[name] * (bits / 8 + 4 / GROUP) / t / 1e9  # codes and a float scale per group
    return out


def compare_expert_bits(kernels: Kernels, widths: list[str], args: argparse.Namespace,
                        rng: np.random.Generator) -> None:
    """The expert kernels at each code width ("4", "3", "2" or "nl4"), alternated over rounds; prints one line per
    width and input type."""
    hidden, inter, experts = (6144, 2048, 24) if args.glm5 else (HIDDEN, INTER, EXPERTS)
    kinds = {w: (4, "nl4") if w == "nl4" else (int(w), "symmetric") for w in widths}
    cases = [(w, x8) for w in widths for x8 in (False, True) if not x8 or x8_eligible(kinds[w][0], GROUP, hidden,
                                                                                      inter)]
    got: dict[tuple[str, bool], list[dict[str, float]]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        for w, x8 in cases:
            got[w, x8].append(bench_experts(kernels, args.runs, rng, x8, hidden, inter, experts, *kinds[w]))
    for (w, x8), rounds in got.items():
        med = {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]}
        label = "nl4" if w == "nl4" else "int" + w
        print(f"experts {label} g64 ({SLOTS} of {experts}, hidden {hidden}, inter {inter}), "
              f"{'int8' if x8 else 'float'} inputs: gate+up {med['gate_up_ms']:.3f} ms ({med['gate_up_gb_s']:.1f} "
              f"GB/s), down {med['down_ms']:.3f} ms ({med['down_gb_s']:.1f} GB/s), per token "
              f"{med['gate_up_ms'] + med['down_ms']:.3f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200, help="launches per measurement (default %(default)s)")
    ap.add_argument("--glm5", action="store_true",
                    help="GLM-5's shapes only: two attention products and the experts (hidden 6144, "
                    "moe_intermediate 2048; 24 experts)")
    ap.add_argument("--expert-bits", help="comma-separated code widths (e.g. 4,3,2; nl4: the nl4 table's 4-bit "
                    "codes): the experts only, at each")
    ap.add_argument("--rounds", type=int, default=3, help="with --expert-bits: rounds over the widths (default 3)")
    args = ap.parse_args(argv)
    if not available() or not list_devices():
        print("bench_kernels: no OpenCL device", file=sys.stderr)
        return 1
    info = list_devices()[0]
    kernels = Kernels(info)
    kernels.enable_profiling()
    rng = np.random.default_rng(0)
    print(f"device: {info.platform} / {info.name} ({info.kind}), kernels {kernels.version}")
    if args.expert_bits:
        compare_expert_bits(kernels, args.expert_bits.split(","), args, rng)
        return 0
    if args.glm5:
        for label, rows, n_in in (("q_a [2048, 6144]", 2048, 6144), ("o_proj [6144, 16384]", 6144, 16384)):
            r = bench_matvec(kernels, rows, args.runs, rng, True, n_in)
            print(f"GLM-5 matvec int4 g64, int8 inputs, {label}: {r['ms']:.3f} ms, {r['gb_s']:.1f} GB/s")
        for inputs, x8 in (("float", False), ("int8", True)):
            r = bench_experts(kernels, args.runs, rng, x8, 6144, 2048, 24)
            print(f"GLM-5 experts ({SLOTS} of 24, one token), {inputs} inputs: gate+up {r['gate_up_ms']:.2f} ms "
                  f"({r['gate_up_gb_s']:.1f} GB/s), down {r['down_ms']:.2f} ms ({r['down_gb_s']:.1f} GB/s)")
        return 0
    r = bench_launch(kernels, args.runs * 10)
    print(f"launch: {r['launch_and_wait_us']:.1f} us launched and waited for, {r['queued_us']:.1f} us queued; device "
          f"idle before the next queued launch: {r['gap_after_small_us']:.1f} us after a one-work-group kernel, "
          f"{r['gap_after_big_us']:.1f} us after one on every thread")
    for inputs, x8 in (("float", False), ("int8", True)):
        for label, rows in (("cache-resident 8 MB", 16384), ("streamed 64 MB", 131072)):
            r = bench_matvec(kernels, rows, args.runs // 4 if rows > 16384 else args.runs, rng, x8)
            print(f"matvec int4 g64, {inputs} inputs, {label}: {r['ms']:.3f} ms, {r['gcodes_s']:.1f} G codes/s, "
                  f"{r['gb_s']:.1f} GB/s")
        r = bench_experts(kernels, args.runs, rng, x8)
        print(f"experts ({SLOTS} of {EXPERTS}, one token), {inputs} inputs: gate+up {r['gate_up_ms']:.3f} ms "
              f"({r['gate_up_gcodes_s']:.1f} G codes/s, {r['gate_up_gb_s']:.1f} GB/s), down {r['down_ms']:.3f} ms "
              f"({r['down_gcodes_s']:.1f} G codes/s, {r['down_gb_s']:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
