#!/usr/bin/env python3
"""Microbenchmarks of the OpenCL side of decode: what a launch costs and how fast the int4 kernels run.

    PYTHONPATH=. python tools/bench_kernels.py                  # the first OpenCL device (PoCL's CPU here)
    POCL_MAX_PTHREAD_COUNT=1 PYTHONPATH=. python tools/bench_kernels.py   # per-core numbers on PoCL

- launch: an empty kernel launched and waited for, one at a time, and launched back to back with one wait
  (the host round trip against the driver's own dispatch cost);
- matvec: `mv_q4` (int4 group 64) over a cache-resident 8 MB and a streamed 64 MB matrix, one input row;
- experts: the fused expert kernels (`eg_q4` gate+up with SiLU, `ed_q4` down) over 9 of 32 experts with the
  benchmark model's shapes (hidden 1024, moe_intermediate 512), one token, experts picked at random per run;
- int8 activations (a prototype, not a glmkit kernel): the same cache-resident int4 g64 matvec with the input
  rounded to int8 (one scale per row) and 16-bit integer products, checked against its own arithmetic. It
  changes the numerics (the input is rounded to 8 bits), which glmkit's backends do not allow today.
Kernel times come from an OpenCL profiling queue: medians over `--runs` launches after 10 warm-up launches.
On a shared machine compare rows measured in one run, never across runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmkit.kernels_cl import launch  # noqa: E402

HIDDEN, INTER, GROUP, SLOTS, EXPERTS = 1024, 512, 64, 9, 32


def profiled(kernels: launch.Kernels) -> launch.Kernels:
    kernels.queue = launch.cl.CommandQueue(kernels.ctx,
                                           properties=launch.cl.command_queue_properties.PROFILING_ENABLE)
    return kernels


def seconds(event) -> float:
    event.wait()
    return (event.profile.end - event.profile.start) * 1e-9


def host_buffer(kernels: launch.Kernels, arr: np.ndarray):
    flags = launch.cl.mem_flags.READ_ONLY | launch.cl.mem_flags.USE_HOST_PTR
    return launch.cl.Buffer(kernels.ctx, flags, hostbuf=arr)


def bench_launch(kernels: launch.Kernels, runs: int) -> dict[str, float]:
    """Microseconds per empty-kernel launch: waited for one by one, and queued back to back."""
    program = launch.cl.Program(kernels.ctx, "__kernel void nop(__global float* y) { }").build()
    nop = launch.cl.Kernel(program, "nop")
    buf = launch.cl.Buffer(kernels.ctx, launch.cl.mem_flags.READ_WRITE, 4096)  # kept alive while nop runs
    nop.set_args(buf)
    for _ in range(50):
        launch.cl.enqueue_nd_range_kernel(kernels.queue, nop, (64,), (4,)).wait()
    t = time.perf_counter()
    for _ in range(runs):
        launch.cl.enqueue_nd_range_kernel(kernels.queue, nop, (64,), (4,)).wait()
    waited = (time.perf_counter() - t) / runs
    t = time.perf_counter()
    for _ in range(runs):
        event = launch.cl.enqueue_nd_range_kernel(kernels.queue, nop, (64,), (4,))
    event.wait()
    queued = (time.perf_counter() - t) / runs
    return {"launch_and_wait_us": waited * 1e6, "queued_us": queued * 1e6}


def bench_matvec(kernels: launch.Kernels, rows: int, runs: int, rng: np.random.Generator) -> dict[str, float]:
    """`mv_q4` over a random int4 g64 matrix `[rows, HIDDEN]`: G codes/s and GB/s of packed weights."""
    packed = rng.integers(0, 256, (rows, HIDDEN // 2), dtype=np.uint8)
    scales = np.full((rows, HIDDEN // GROUP), 0.01, np.float32)
    w = launch.ClWeight(host_buffer(kernels, packed), 0, host_buffer(kernels, scales), 0, 4, GROUP,
                        HIDDEN // GROUP, rows, HIDDEN, HIDDEN // 2)
    xb = kernels.put("x", rng.standard_normal((1, HIDDEN), dtype=np.float32))
    yb = kernels.out("y", rows * 4)
    g0, local = kernels._rows_global(rows)
    kernel = kernels.kernel("mv_q4")
    times = [seconds(kernel(kernels.queue, (g0, 1), local, *w.args(), xb, 1, HIDDEN, HIDDEN, yb, rows, rows,
                            rows, 0, 0)) for _ in range(runs + 10)][10:]
    t = float(np.median(times))
    return {"ms": t * 1e3, "gcodes_s": rows * HIDDEN / t / 1e9, "gb_s": packed.nbytes / t / 1e9}


def expert_blob(rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """EXPERTS experts laid out like a container: gate, gate scales, up, up scales, down, down scales."""
    sizes = [INTER * HIDDEN // 2, INTER * (HIDDEN // GROUP) * 4] * 2 + [HIDDEN * INTER // 2,
                                                                        HIDDEN * (INTER // GROUP) * 4]
    per = sum(sizes)
    blob = rng.integers(0, 256, EXPERTS * per, dtype=np.uint8)
    starts = [sum(sizes[:k]) for k in range(6)]
    for e in range(EXPERTS):
        for k in (1, 3, 5):  # scale regions hold valid floats
            blob[e * per + starts[k]: e * per + starts[k] + sizes[k]].view(np.float32)[:] = 0.01
    return blob, [e * per for e in range(EXPERTS)] + starts


def bench_experts(kernels: launch.Kernels, runs: int, rng: np.random.Generator) -> dict[str, float]:
    """The fused expert kernels over SLOTS random experts for one token: G codes/s of each."""
    blob, layout = expert_blob(rng)
    expert_starts, starts = layout[:EXPERTS], layout[EXPERTS:]
    buf = host_buffer(kernels, blob)
    x = kernels.put("x", rng.standard_normal((1, HIDDEN), dtype=np.float32))
    slot_tok = kernels.put("slot_tok", np.zeros(SLOTS, np.uint32), np.uint32)
    tok_start = kernels.put("tok_start", np.array([0, SLOTS], np.uint32), np.uint32)
    slot_w = kernels.put("slot_w", np.ones(SLOTS, np.float32))
    hid, y = kernels.out("hid", SLOTS * INTER * 4), kernels.out("y", HIDDEN * 4)
    gate_up, down = kernels.kernel("eg_q4"), kernels.kernel("ed_q4")
    times: dict[str, list[float]] = {"gate_up": [], "down": []}
    for _ in range(runs + 10):
        chosen = rng.choice(EXPERTS, SLOTS, replace=False)
        offs = np.array([[expert_starts[e] + s for s in starts] for e in chosen], np.uint64)
        ob = kernels.put("offs", offs, np.uint64)
        g0, local = kernels._rows_global(INTER)
        times["gate_up"].append(seconds(gate_up(kernels.queue, (g0, SLOTS), local, buf, ob, slot_tok, HIDDEN,
                                                HIDDEN // 2, GROUP, HIDDEN // GROUP, x, HIDDEN, hid, INTER)))
        g0, local = kernels._rows_global(HIDDEN)
        times["down"].append(seconds(down(kernels.queue, (g0, 1), local, buf, ob, tok_start, slot_w, INTER,
                                          INTER // 2, GROUP, INTER // GROUP, hid, y, HIDDEN, HIDDEN)))
    codes = {"gate_up": 2 * SLOTS * INTER * HIDDEN, "down": SLOTS * HIDDEN * INTER}
    out = {}
    for name, ts in times.items():
        t = float(np.median(ts[10:]))
        out[f"{name}_ms"] = t * 1e3
        out[f"{name}_gcodes_s"] = codes[name] / t / 1e9
    return out


INT8_ACTIVATION_SOURCE = r"""
typedef struct __attribute__((packed)) { uchar16 v; } u16_t;
typedef struct __attribute__((packed)) { char16 v; } c16_t;
/* y[r] = sx * sum_g sw[r, g] * (sum_{i in g} code_i * xq_i - 8 * xsum[g]), group 64, 4 rows per work-item.
 * xq: per 32-column chunk its 16 even then its 16 odd columns (the low and high nibbles of 16 packed bytes). */
__kernel void mv_q4_x8(__global const uchar* w, __global const float* sw, __global const char* xq,
                       __global const int* xsum, float sx, uint n_in, __global float* y) {
    const uint r0 = get_global_id(0) * 4, row_bytes = n_in / 2, groups = n_in / 64;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (uint g = 0; g < groups; g++) {
        const __global c16_t* xc = (const __global c16_t*)xq + 4 * g;
        const short16 e0 = convert_short16(xc[0].v), o0 = convert_short16(xc[1].v);
        const short16 e1 = convert_short16(xc[2].v), o1 = convert_short16(xc[3].v);
        for (uint k = 0; k < 4; k++) {
            const __global u16_t* b = (const __global u16_t*)(w + (ulong)(r0 + k) * row_bytes + 32 * g);
            const uchar16 b0 = b[0].v, b1 = b[1].v;
            const short16 s = convert_short16(b0 & (uchar16)15) * e0 + convert_short16(b0 >> (uchar16)4) * o0
                            + convert_short16(b1 & (uchar16)15) * e1 + convert_short16(b1 >> (uchar16)4) * o1;
            const int8 t = convert_int8(s.lo) + convert_int8(s.hi);
            const int4 u = t.lo + t.hi;
            acc[k] += sw[(r0 + k) * groups + g] * (float)((u.x + u.y) + (u.z + u.w) - 8 * xsum[g]);
        }
    }
    for (uint k = 0; k < 4; k++) y[r0 + k] = acc[k] * sx;
}
"""


def bench_int8_activations(kernels: launch.Kernels, rows: int, runs: int, rng: np.random.Generator
                           ) -> dict[str, float]:
    """The int8-activation prototype over a random int4 g64 matrix `[rows, HIDDEN]` (rows % 4 == 0)."""
    codes = rng.integers(0, 16, (rows, HIDDEN), dtype=np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # the container's int4 packing
    scales = (rng.random((rows, HIDDEN // GROUP), dtype=np.float32) * 0.01).astype(np.float32)
    x = rng.standard_normal(HIDDEN).astype(np.float32)
    sx = float(np.abs(x).max() / 127)
    xq = np.clip(np.rint(x / sx), -127, 127).astype(np.int8)
    arranged = np.concatenate([np.concatenate([c[0::2], c[1::2]]) for c in xq.reshape(-1, 32)])
    xsum = xq.reshape(-1, GROUP).astype(np.int32).sum(axis=1).astype(np.int32)
    flags = launch.cl.mem_flags.READ_ONLY | launch.cl.mem_flags.COPY_HOST_PTR
    args = [host_buffer(kernels, packed), host_buffer(kernels, scales),
            launch.cl.Buffer(kernels.ctx, flags, hostbuf=arranged), launch.cl.Buffer(kernels.ctx, flags, hostbuf=xsum)]
    y = np.empty(rows, np.float32)
    out = launch.cl.Buffer(kernels.ctx, launch.cl.mem_flags.WRITE_ONLY, y.nbytes)
    kernel = launch.cl.Kernel(launch.cl.Program(kernels.ctx, INT8_ACTIVATION_SOURCE).build(), "mv_q4_x8")
    kernel.set_args(*args, np.float32(sx), np.uint32(HIDDEN), out)
    times = [seconds(launch.cl.enqueue_nd_range_kernel(kernels.queue, kernel, (rows // 4,), (4,)))
             for _ in range(runs + 10)][10:]
    launch.cl.enqueue_copy(kernels.queue, y, out)
    want = ((codes.astype(np.float64) - 8).reshape(rows, -1, GROUP) * scales[:, :, None]).reshape(rows, HIDDEN) \
        @ (xq.astype(np.float64) * sx)
    t = float(np.median(times))
    return {"ms": t * 1e3, "gcodes_s": rows * HIDDEN / t / 1e9,
            "rel_err": float(np.abs(y - want).max() / np.abs(want).max())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200, help="launches per measurement (default %(default)s)")
    args = ap.parse_args(argv)
    if not launch.available():
        print("bench_kernels: no OpenCL device", file=sys.stderr)
        return 1
    info = launch.list_devices()[0]
    kernels = profiled(launch.Kernels(info))
    rng = np.random.default_rng(0)
    print(f"device: {info.platform} / {info.name} ({info.kind}), kernels {kernels.version}")
    r = bench_launch(kernels, args.runs * 10)
    print(f"launch: {r['launch_and_wait_us']:.1f} us launched and waited for, {r['queued_us']:.1f} us queued")
    for label, rows in (("cache-resident 8 MB", 16384), ("streamed 64 MB", 131072)):
        r = bench_matvec(kernels, rows, args.runs // 4 if rows > 16384 else args.runs, rng)
        print(f"matvec int4 g64, {label}: {r['ms']:.3f} ms, {r['gcodes_s']:.1f} G codes/s, {r['gb_s']:.1f} GB/s")
    r = bench_int8_activations(kernels, 16384, args.runs, rng)
    print(f"prototype, int8 activations, same 8 MB matrix: {r['ms']:.3f} ms, {r['gcodes_s']:.1f} G codes/s "
          f"(max error {r['rel_err']:.1e} of its own arithmetic)")
    r = bench_experts(kernels, args.runs, rng)
    print(f"experts ({SLOTS} of {EXPERTS}, one token): gate+up {r['gate_up_ms']:.3f} ms "
          f"({r['gate_up_gcodes_s']:.1f} G codes/s), down {r['down_ms']:.3f} ms ({r['down_gcodes_s']:.1f} G codes/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
