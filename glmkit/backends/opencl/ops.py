"""One OpenCL device as `Kernels`: its context and queue, the built program, its buffers, and a launcher per
operation that takes and returns float32 NumPy arrays.

Every launcher stages its inputs in named slots (`Buffers.put`), runs its kernels and reads the result back, so
each kernel can be checked against the NumPy reference directly (tests/test_kernels_cl.py) and the backend
(glmkit.backends.opencl.backend) stays small. The device decode step binds the same kernels between buffers
that stay put instead (glmkit.backends.opencl.decode_launches).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from glmkit.backends.opencl.buffers import Buffers, Int8Codes
from glmkit.backends.opencl.device import DeviceInfo, cl
from glmkit.backends.opencl.kernels import kernel_version
from glmkit.backends.opencl.program import Launch, Program
from glmkit.backends.opencl.weights import X8_BLOCK, ClWeight, ExpertShape, mvt_global
from glmkit.model.kv_cache import F16_ROW_MAX, SHADOW_BLOCK

KV_TYPES = {"f32": 0, "bf16": 1, "fp8": 2, "f16": 3}  # kv.cl's KV_TYPE for each of kv_cache.KV_DTYPES


class Kernels:
    """One device: context, in-order queue, the built program, its buffers and a launcher per operation.

    lanes: work-items per matvec row (1 on CPUs; a power of two, e.g. 32, on GPUs); red_lanes: work-group
    size of the row-reduction kernels; direct: read/write staging memory without transfer commands
    (default: CPU devices); cpu_loads: vector loads as plain unaligned loads instead of vloadn (default: CPU
    devices, whose PoCL compiler leaves vloadn as calls).
    """

    def __init__(self, info: DeviceInfo, lanes: int | None = None, red_lanes: int | None = None,
                 direct: bool | None = None, items_per_group: int | None = None,
                 cpu_loads: bool | None = None) -> None:
        if cl is None:
            raise RuntimeError("pyopencl is not installed")
        self.info = info
        device = info.open()
        gpu = info.kind == "gpu"
        self.lanes = lanes or (32 if gpu else 1)
        self.red_lanes = red_lanes or (64 if gpu else 16)
        self.rows_per_item = 1 if self.lanes > 1 else 4  # matvec rows per work-item (ROWS in the kernels)
        self.items_per_group = items_per_group or (1 if self.lanes > 1 else 4)
        self.direct = (info.kind == "cpu") if direct is None else direct
        self.fp64 = "cl_khr_fp64" in device.extensions  # float64 arithmetic: sample.cl is built only with it
        self.ctx = cl.Context([device])
        self.queue = cl.CommandQueue(self.ctx)
        options = [f"-DLANES={self.lanes}", f"-DRED_LANES={self.red_lanes}", f"-DROWS={self.rows_per_item}",
                   f"-DSHADOW_BLOCK={SHADOW_BLOCK}"]
        self.cpu_loads = (info.kind == "cpu") if cpu_loads is None else cpu_loads
        if self.cpu_loads:
            options.append("-DCPU_LOADS")  # plain unaligned vector loads (PoCL does not inline vloadn)
        self.options = options
        self.program = Program(self.ctx, options)
        self._kv_programs: dict[str, Program] = {}
        self.buffers = Buffers(self.ctx, self.queue, self.direct, max(1, device.mem_base_addr_align // 8),
                               info.max_alloc)
        self.version = f"{kernel_version()}-l{self.lanes}r{self.red_lanes}w{self.rows_per_item}" + (
            "c" if self.cpu_loads else "")

    # ---- the queue ---------------------------------------------------------------------------------

    def bind(self, name: str, size: tuple[int, ...], local: tuple[int, ...] | None, kv_dtype: str = "f32",
             **args: Any) -> Launch:
        """A launch of kernel `name` with its arguments set once, by name (see `Launch`); kv_dtype: the cache rows'
        precision that kv.cl's kernels are built for (`KV_TYPES`)."""
        return Launch(self.kv_program(kv_dtype), self.queue, name, size, local, args)

    def kv_program(self, kv_dtype: str) -> Program:
        """The program built for cache rows at `kv_dtype` (f32: the program itself; others on first use)."""
        if kv_dtype == "f32":
            return self.program
        if kv_dtype not in self._kv_programs:
            self._kv_programs[kv_dtype] = Program(self.ctx, [*self.options, f"-DKV_TYPE={KV_TYPES[kv_dtype]}",
                                                             f"-DF16_ROW_MAX={F16_ROW_MAX:.1f}f"])
        return self._kv_programs[kv_dtype]

    def _run(self, name: str, size: tuple[int, ...], local: tuple[int, ...] | None, **args: Any) -> Any:
        """Enqueue kernel `name` once with every argument named; its event."""
        return self.program.run(self.queue, name, size, local, **args)

    def enable_profiling(self) -> None:
        """Replace the queue with one that records each command's device times (`event.profile`); launches bound
        before keep the queue they were bound with."""
        props = cl.command_queue_properties.PROFILING_ENABLE
        self.queue = self.buffers.queue = cl.CommandQueue(self.ctx, properties=props)

    def finish(self) -> None:
        self.queue.finish()

    def flush(self) -> None:
        """Hand the queued commands to the device without waiting for them."""
        self.queue.flush()

    def user_event(self) -> Any:
        """An event the host completes (`complete`): commands queued behind it wait for the host."""
        return cl.UserEvent(self.ctx)

    @staticmethod
    def complete(event: Any) -> None:
        """Complete a `user_event`: what waits for it may run."""
        event.set_status(cl.command_execution_status.COMPLETE)

    def on_complete(self, event: Any, fn: Callable[[], None]) -> None:
        """Call `fn()` from the OpenCL runtime's callback thread once the command of `event` completed."""
        event.set_callback(cl.command_execution_status.COMPLETE, lambda status: fn())

    # ---- work sizes --------------------------------------------------------------------------------

    def rows_global(self, rows: int) -> tuple[int, tuple[int, int]]:
        """Global size along dim 0 and the local size for the row-parallel kernels (ROWS rows per item)."""
        items = -(-rows // self.rows_per_item)
        if self.lanes > 1:
            return items * self.lanes, (self.lanes, 1)
        g = self.items_per_group
        return -(-items // g) * g, (g, 1)

    def open_sizes(self, size: tuple[int, ...], items: int = 16) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """Global and local size of a launch of a kernel that checks its dimension-0 id against its bound and takes
        any work-group: the driver's choice on GPUs; on CPU builds work-groups of `items` along dimension 0 (the
        global size rounded up to them), since PoCL builds a kernel anew for each work-group size it picks and
        picks by the global size: each new prompt length would wait for builds."""
        if self.lanes > 1:
            return size, None
        return (-(-size[0] // items) * items, *size[1:]), (items, *(1,) * (len(size) - 1))

    def topk_kernel(self, rows: int) -> tuple[str, tuple[int, ...], tuple[int, ...] | None]:
        """The top-k selection kernel for `rows` rows, with its global and local size (the rows along the last
        dimension): one work-group per row on GPUs (LANES > 1: one item's serial passes are slow there), one
        work-item per row on CPUs."""
        if self.lanes > 1:
            return "topk_select_group", (self.red_lanes, rows), (self.red_lanes, 1)
        return "topk_select", (rows,), None

    @property
    def heads_apart(self) -> bool:
        """Whether per-key attention kernels give each head its own work-items (GPUs), rather than one item every
        head of a key (CPUs: the key is read once)."""
        return self.lanes > 1

    @property
    def writes_codes(self) -> bool:
        """Whether products can write their output's int8 codes themselves (`codes_out` in quant.cl): a
        work-group of X8_BLOCK / ROWS items then owns one block of output rows (one lane per row only)."""
        return self.lanes == 1 and X8_BLOCK % self.rows_per_item == 0

    # ---- quantized products ----------------------------------------------------------------------

    def matvec(self, w: ClWeight, x: np.ndarray, heads: int = 1, head_rows: int = 0, row_start: int = 0,
               rows: int | None = None) -> np.ndarray:
        """`y[s, h, r] = x[s, h] . W[h * head_rows + row_start + r]`; x `[S, I]` (heads 1) or `[S, heads, I]`.

        Returns `[S, rows]` for 2-D x, `[S, heads, rows]` otherwise. One pass over each weight row."""
        rows = w.rows if rows is None else rows
        n_s = x.shape[0]
        b = self.buffers
        g0, local = self.rows_global(rows)
        evt = self._run("mv_" + w.suffix, (g0, heads), local, **w.args(), x=b.put("x", x), n_s=n_s,
                        x_s=heads * w.n_in, x_h=w.n_in, y=b.out("y", n_s * heads * rows * 4), y_s=heads * rows,
                        y_h=rows, rows=rows, head_rows=head_rows, row_start=row_start)
        shape = (n_s, rows) if x.ndim == 2 else (n_s, heads, rows)
        return b.get("y", shape, evt)

    def matvec_t(self, w: ClWeight, x: np.ndarray, head_rows: int, row_start: int, rows: int) -> np.ndarray:
        """`y[s, h] = x[s, h] @ W[h * head_rows + row_start : ... + rows]` (x `[S, heads, rows]`) -> `[S, heads, I]`."""
        n_s, heads = x.shape[0], x.shape[1]
        b = self.buffers
        evt = self._run("mvt_" + w.suffix, mvt_global(w, heads), None, **w.args(), x=b.put("x", x), n_s=n_s,
                        x_s=heads * rows, x_h=rows, y=b.out("y", n_s * heads * w.n_in * 4), y_s=heads * w.n_in,
                        y_h=w.n_in, rows=rows, head_rows=head_rows, row_start=row_start)
        return b.get("y", (n_s, heads, w.n_in), evt)

    def matmul(self, w: ClWeight, x: np.ndarray) -> np.ndarray:
        """Prefill `x [S, I] @ W^T -> [S, O]` with the tiled kernel."""
        n_s = x.shape[0]
        b = self.buffers
        gx, gy = -(-w.rows // 32) * 8, -(-n_s // 32) * 8
        evt = self._run("mm_" + w.suffix, (gx, gy), (8, 8), **w.args(), x=b.put("x", x), n_s=n_s, x_s=w.n_in,
                        y=b.out("y", n_s * w.rows * 4), y_s=w.rows, rows=w.rows)
        return b.get("y", (n_s, w.rows), evt)

    def dequant(self, w: ClWeight, row_start: int = 0, rows: int | None = None, copy: bool = True) -> np.ndarray:
        """Rows `[row_start, row_start + rows)` of W as float32 `[rows, I]`.

        copy=False may return the staging memory itself (valid until the next dequant): for an immediate GEMM."""
        rows = w.rows - row_start if rows is None else rows
        out = self.buffers.out("dq", rows * w.n_in * 4)
        evt = self._run("dq_" + w.suffix, (w.n_in, rows), None, **w.args(), out=out, rows=rows, row_start=row_start)
        return self.buffers.get("dq", (rows, w.n_in), evt, copy=copy)

    def experts(self, wbuf: Any, shape: ExpertShape, x: np.ndarray, offs: np.ndarray, slot_tok: np.ndarray,
                tok_start: np.ndarray, slot_w: np.ndarray) -> np.ndarray:
        """Fused expert MLPs over slots (token, expert): `y[t] = sum_slot w * down(silu(gate x_t) * up x_t)`.

        wbuf holds every slot's weights, read as `shape` says; offs `[slots, 6]` their byte offsets (gate, gate
        scales, up, up scales, down, down scales); slot_tok `[slots]`; tok_start `[T + 1]` (slots sorted by
        token); slot_w `[slots]`.
        """
        n_tok, n_slots = x.shape[0], len(slot_tok)
        b = self.buffers
        xb, ob = b.put("x", x), b.put("offs", offs, np.uint64)
        sb, tb = b.put("slot_tok", slot_tok, np.uint32), b.put("tok_start", tok_start, np.uint32)
        wb = b.put("slot_w", slot_w)
        hid, yb = b.out("hid", n_slots * shape.inter * 4), b.out("y", n_tok * shape.n_in * 4)
        g0, local = self.rows_global(shape.inter)
        self._run("eg_" + shape.suffix, (g0, n_slots), local, wbuf=wbuf, offs=ob, slot_tok=sb, **shape.gate_up_args(),
                  x=xb, x_s=shape.n_in, hid=hid, inter=shape.inter)
        g0, local = self.rows_global(shape.n_in)
        evt = self._run("ed_" + shape.suffix, (g0, n_tok), local, wbuf=wbuf, offs=ob, tok_start=tb, slot_w=wb,
                        **shape.down_args(), hid=hid, y=yb, y_s=shape.n_in, rows=shape.n_in)
        return b.get("y", (n_tok, shape.n_in), evt)

    def experts_x8(self, wbuf: Any, shape: ExpertShape, x: np.ndarray, offs: np.ndarray, slot_tok: np.ndarray,
                   tok_start: np.ndarray, slot_w: np.ndarray) -> np.ndarray:
        """`experts` with int8-quantized activations (`x8_eligible` experts): x's rows and the slots' hidden rows
        quantized per block of X8_BLOCK, the products summed as integers (2.5x the float kernels' speed on PoCL,
        tools/bench_kernels.py); down per slot, each token's slots then summed on the host in slot order."""
        n_tok, n_slots = x.shape[0], len(slot_tok)
        n_in, inter = shape.n_in, shape.inter
        b = self.buffers
        x_codes = Int8Codes(b.out("xq", 2 * x.size), b.out("xs", 4 * (x.size // X8_BLOCK)),
                            b.out("xsum", 4 * (x.size // X8_BLOCK)))
        hid_codes = Int8Codes(b.out("hq", 2 * n_slots * inter), b.out("hs", 4 * (n_slots * inter // X8_BLOCK)),
                              b.out("hsum", 4 * (n_slots * inter // X8_BLOCK)))
        ob = b.put("offs", offs, np.uint64)
        hid, part = b.out("hid", n_slots * inter * 4), b.out("part", n_slots * n_in * 4)
        g_inter, l_inter = self.rows_global(inter)
        g_out, l_out = self.rows_global(n_in)
        tokens = b.put("slot_tok", slot_tok, np.uint32)
        # one work-group per row: a size left to the driver follows the row count (PoCL builds each size anew)
        self._run("quantize_x8", (n_in // X8_BLOCK, n_tok), (n_in // X8_BLOCK, 1), x=b.put("x", x), x_s=n_in, n=n_in,
                  **x_codes.args())
        self._run(f"eg_{shape.suffix}_x8", (g_inter, n_slots), l_inter, wbuf=wbuf, offs=ob, slot_tok=tokens,
                  **shape.gate_up_args(), **x_codes.args("x"), hid=hid, inter=inter)
        self._run("quantize_x8", (inter // X8_BLOCK, n_slots), (inter // X8_BLOCK, 1), x=hid, x_s=inter, n=inter,
                  **hid_codes.args())
        evt = self._run(f"edp_{shape.suffix}_x8", (g_out, n_slots), l_out, wbuf=wbuf, offs=ob, slot_tok=tokens,
                        **shape.down_args(), **hid_codes.args("h"), part=part, rows=n_in)
        part = b.get("part", (n_slots, n_in), evt) * slot_w[:, None]
        return np.stack([part[tok_start[t]:tok_start[t + 1]].sum(0) for t in range(n_tok)])

    # ---- norms, rope, activations ----------------------------------------------------------------

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        n = x.shape[-1]
        rows = x.size // n if n else 0
        b = self.buffers
        evt = self._run("rms_norm", (rows * self.red_lanes,), (self.red_lanes,), x=b.put("x", x),
                        w=b.put("nw", weight), y=b.out("y", x.size * 4), n=n, eps=eps)
        return b.get("y", x.shape, evt)

    def layer_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
        n = x.shape[-1]
        rows = x.size // n if n else 0
        b = self.buffers
        evt = self._run("layer_norm", (rows * self.red_lanes,), (self.red_lanes,), x=b.put("x", x),
                        w=b.put("nw", weight), b=b.put("nb", bias), y=b.out("y", x.size * 4), n=n, eps=eps)
        return b.get("y", x.shape, evt)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, offset: int = 0, width: int | None = None
             ) -> np.ndarray:
        """RoPE on dims `[offset, offset + width)` of `x [S, ..., D]` (default: all D), the rest copied."""
        n_s, dim = x.shape[0], x.shape[-1]
        width = dim if width is None else width
        heads = x.size // (n_s * dim) if x.size else 0
        b = self.buffers
        xb = b.put("x", x)
        yb = b.put("y", x) if width < dim else b.out("y", x.size * 4)
        evt = self._run("rope", *self.open_sizes((width // 2, n_s * heads)), x=xb, y=yb, cos_t=b.put("cos", cos),
                        sin_t=b.put("sin", sin), heads=heads, stride=dim, off=offset, n_half=width // 2)
        return b.get("y", x.shape, evt)

    def silu_mul(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        b = self.buffers
        evt = self._run("silu_mul", *self.open_sizes((g.size,), 256), g=b.put("x", g), u=b.put("u", u),
                        y=b.out("y", g.size * 4), n=g.size)
        return b.get("y", g.shape, evt)

    # ---- attention and the indexer ---------------------------------------------------------------

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray, scale: float
                  ) -> np.ndarray:
        """q `[S, nh, dk]`, k `[T, kh, dk]`, v `[T, kh, dv]` (kh = nh or 1), allowed `[S, T]` -> `[S, nh, dv]`."""
        n_s, heads, dk = q.shape
        n_keys, kh, dv = k.shape[0], k.shape[1], v.shape[2]
        b = self.buffers
        evt = self._run("attention", (heads * self.red_lanes, n_s), (self.red_lanes, 1), q=b.put("q", q),
                        k=b.put("k", k), v=b.put("v", v), allowed=b.put("mask", allowed, np.uint8),
                        scores=b.out("scores", n_s * heads * n_keys * 4), out=b.out("y", n_s * heads * dv * 4),
                        nh=heads, n_keys=n_keys, dk=dk, dv=dv, k_row=kh * dk, k_head=dk if kh > 1 else 0,
                        v_row=kh * dv, v_head=dv if kh > 1 else 0, scale=scale)
        return b.get("y", (n_s, heads, dv), evt)

    def topk(self, scores: np.ndarray, allowed: np.ndarray, k: int) -> np.ndarray:
        """The k largest allowed scores of each row of `[S, T]` (every allowed key when fewer than k), as key indices
        `[S, k]` int32 (ascending, -1 padded: `chosen_keys`)."""
        self.buffers.put("scores", scores)
        return self._topk(allowed, k, scores.shape)

    def index_topk(self, q: np.ndarray, k: np.ndarray, weights: np.ndarray, scale: float, allowed: np.ndarray,
                   topk: int) -> np.ndarray:
        """DSA selection: the indexer's scores of q `[S, nh, d]` against the keys k `[T, d]` with head weights
        `[S, nh]` (`I[s, t] = sum_h weights[s, h] * relu(q[s, h] . k[t] * scale)`), then the top-k of each row's
        allowed keys `[S, T]`, in one round trip (the scores stay on the device): `[S, topk]` as `topk`."""
        n_s, heads, d = q.shape
        n_keys = k.shape[0]
        b = self.buffers
        keys = b.put("k", k)
        self._run("index_scores", *self.open_sizes((n_keys, n_s)), q=b.put("q", q), k=keys, k_scale=keys,
                  w=b.put("iw", weights), out=b.out("scores", n_s * n_keys * 4), nh=heads, d=d, n_keys=n_keys,
                  scale=scale, w_scale=1.0)
        return self._topk(allowed, topk, (n_s, n_keys))

    def _topk(self, allowed: np.ndarray, k: int, shape: tuple[int, int]) -> np.ndarray:
        """The selection over the scores staged in slot "scores" `shape = [S, T]`."""
        n_s, n_keys = shape
        b = self.buffers
        name, size, local = self.topk_kernel(n_s)
        if local is None:
            size, local = self.open_sizes(size)
        evt = self._run(name, size, local, scores=b.staged("scores"), allowed=b.put("mask", allowed, np.uint8),
                        selected=b.out("sel", n_s * n_keys), chosen=b.out("chosen", 4 * n_s * k), n_keys=n_keys, k=k,
                        n_rows=n_s)
        chosen = b.get("chosen", (n_s, k), evt, np.uint32).astype(np.int32)
        chosen[np.arange(k)[None, :] >= allowed.sum(axis=1)[:, None]] = -1  # rows of fewer keys fill only a part
        return chosen
