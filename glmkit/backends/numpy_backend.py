"""Compute backends: every heavy operation of the forward pass, behind one small interface.

The model (`glmkit.model.glm5`) only calls the methods of `Backend`, so an OpenCL backend can
replace `NumpyBackend` without the model changing. All activations are float32 NumPy arrays; a weight
is either a float32 `[O, I]` array or a `QuantWeight` viewed in place from the container.

`NumpyBackend` is the reference and the fallback. Its quantized matmul never dequantizes a whole
matrix per call during decode: it walks the weight in row blocks, unpacks each block's codes into a
small reusable buffer through a byte -> codes lookup table and multiplies it with BLAS. Prefill uses
the same loop with blocks large enough that a typical matrix is dequantized once and hit by one GEMM.

With `workers > 1`, prefill-sized calls split into independent pieces (row blocks of a weight, routed
experts, attention heads, query blocks of the indexer) that run on a thread pool, each piece with
single-threaded BLAS: no piece shares a sum with another, so results only differ from the unsplit call by
the rounding of a GEMM's edge tiles; dequantization and elementwise work run in parallel too (NumPy
releases the GIL), and a core taken by another process slows the pool down instead of stalling it (multi-
threaded BLAS spin-waits for its threads on every call; docs/BENCHMARKS.md, Setup).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from glmkit.format.config import ModelConfig
from glmkit.format.packing import INT3_BLOCK, INT3_BLOCK_BYTES, code_values, unpack
from glmkit.format.tensors import QuantWeight, Weight
from glmkit.model.compute import ExpertArena, ExpertFn, moe_layer
from glmkit.model.layer_spec import LayerSpec, MTPSpec
from glmkit.model.ops import apply_rope, chosen_keys, position_mask, silu, topk_mask

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")
MIN_SPLIT_ROWS = 64  # output rows of one piece of a split product (narrower GEMMs lose BLAS efficiency)
INDEX_ROWS = 64  # queries the DSA indexer scores together
_POOL_THREAD = threading.local()  # `.active` in the worker pools' threads
# glibc keeps freed blocks in its per-thread arenas; prefill temporaries of the pool threads stay resident
# through decode unless handed back
try:
    _MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
except (OSError, TypeError):  # no C library handle of the process (e.g. Windows)
    _MALLOC_TRIM = None


def _mark_pool_thread() -> None:
    _POOL_THREAD.active = True


def _in_pool() -> bool:
    return getattr(_POOL_THREAD, "active", False)


def _code_table(bits: int, scheme: str) -> np.ndarray:
    """Byte value -> the values (before the scale) of the `8 // bits` codes it packs, as float32 `[256, 8 // bits]`."""
    byte = np.arange(256, dtype=np.int16)
    mask = (1 << bits) - 1
    fields = [(byte >> (bits * k)) & mask for k in range(8 // bits)]
    return code_values((np.stack(fields, axis=1) - (1 << (bits - 1))).astype(np.int8), scheme)


# int8 bytes are their codes
_CODE_TABLES = {(bits, scheme): _code_table(bits, scheme) for bits, scheme in ((2, "symmetric"), (4, "symmetric"),
                                                                               (4, "nl4"))}


class NumpyBackend:
    """Reference backend on NumPy + BLAS.

    decode_rows: calls with at most this many input rows take the decode path (cache-sized blocks).
    decode_block / prefill_block: float32 elements of one unpacked weight block on each path.
    query_block: score elements `[nh, rows, T]` materialized at once in attention and the indexer.
    workers: threads that share the pieces of a prefill-sized call (1: the calling thread only); callers
    with workers > 1 keep BLAS single-threaded.
    """

    def __init__(self, decode_rows: int = 4, decode_block: int = 1 << 18, prefill_block: int = 1 << 24,
                 query_block: int = 1 << 20, workers: int = 1) -> None:
        # v5: DSA attention over the gathered chosen keys; v6: 2-3-row products row by row; -wN: the split changes
        # rounding
        self.numerics = "numpy-f32-v6" + (f"-w{workers}" if workers > 1 else "")
        self.decode_rows = decode_rows
        self.decode_block = decode_block
        self.prefill_block = prefill_block
        self.query_block = query_block
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()  # the calling thread's unpacked-weight scratch buffer

    def _map(self, fn: Callable[[_Item], _Result], items: Sequence[_Item]) -> list[_Result]:
        """`[fn(item) for item in items]`, on the worker pool when there is one and more than one item.

        A call from inside a pool thread runs inline (a nested map must not wait on its own pool)."""
        if self.workers <= 1 or len(items) < 2 or _in_pool():
            return [fn(item) for item in items]
        if self._pool is None:
            # the pool holds no reference to this backend: it shuts down when the backend is collected
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="glmkit-numpy",
                                            initializer=_mark_pool_thread)
        return list(self._pool.map(fn, items))

    def _split(self, total: int, parallel: bool, min_size: int = 1) -> list[tuple[int, int]]:
        """`[start, stop)` ranges covering `range(total)`: up to one per worker (of at least min_size) when
        parallel and not already on a pool thread, else just one."""
        parts = max(1, min(self.workers, total // min_size)) if parallel and not _in_pool() else 1
        bounds = [total * i // parts for i in range(parts + 1)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    # ---- matmuls -------------------------------------------------------------------------------

    def linear(self, x: np.ndarray, w: Weight) -> np.ndarray:
        prefill = x.shape[0] > self.decode_rows
        if not isinstance(w, QuantWeight):
            if not prefill or self.workers <= 1:
                return times_transposed(x, w)
            out = np.empty((x.shape[0], w.shape[0]), np.float32)

            def part(span: tuple[int, int]) -> None:
                out[:, span[0]:span[1]] = x @ w[span[0]:span[1]].T

            self._map(part, self._split(w.shape[0], True, MIN_SPLIT_ROWS))
            return out
        return self._quant_linear(x, w, self.prefill_block if prefill else self.decode_block, prefill)

    def _quant_linear(self, x: np.ndarray, w: QuantWeight, block_elems: int, parallel: bool = False) -> np.ndarray:
        """`x @ dequant(w)^T`, unpacking `w` one row block at a time into a reused buffer (per worker)."""
        out_features, in_features = w.shape
        width = _code_width(w)
        if width != in_features:
            # Zero-padding x makes the padding codes contribute nothing, so whole packed rows can be used.
            x_pad = np.zeros((x.shape[0], width), np.float32)
            x_pad[:, :in_features] = x
            x = x_pad
        rows = max(1, min(out_features, block_elems // width))
        out = np.empty((x.shape[0], out_features), np.float32)

        def part(span: tuple[int, int]) -> None:
            for r0 in range(span[0], span[1], rows):
                r1 = min(span[1], r0 + rows)
                codes = self._unpack_rows(w, r0, r1)
                if w.group_size is None:
                    # Per-row scale: dot the integer codes first, scale the outputs.
                    block = times_transposed(x, codes, out[:, r0:r1])
                    block *= w.scales[r0:r1]
                else:
                    _scale_groups(codes, w.scales[r0:r1], w.group_size, in_features)
                    times_transposed(x, codes, out[:, r0:r1])

        self._map(part, self._split(out_features, parallel, MIN_SPLIT_ROWS))
        return out

    def _unpack_rows(self, w: QuantWeight, start: int, stop: int) -> np.ndarray:
        """The code values of rows `[start, stop)` as float32 `[n, width]` in the reused scratch buffer.

        `width >= I`: a row's padding codes (from its last partial byte) come along; callers ignore them.
        """
        n, width = stop - start, _code_width(w)
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.size < n * width:
            scratch = np.empty(n * width, np.float32)
            if not _in_pool():  # pool threads' blocks are freed after use: they would stay resident through decode
                self._local.scratch = scratch
        codes = scratch[: n * width].reshape(n, width)
        if w.bits == 8:
            np.copyto(codes, w.packed[start:stop].view(np.int8), casting="unsafe")
        elif w.bits == 3:  # 3-bit fields straddle bytes: no byte -> codes table
            np.copyto(codes, unpack(w.packed[start:stop], 3, width), casting="unsafe")
        else:
            # One gather through a byte -> codes table unpacks all fields of a byte at once.
            table = _CODE_TABLES[w.bits, w.scheme]
            lanes = codes.reshape(n, w.packed.shape[1], table.shape[1])
            np.take(table, w.packed[start:stop], axis=0, out=lanes, mode="clip")
        return codes

    def head_matmul(self, x: np.ndarray, w: Weight, row_start: int, rows: int, transpose: bool) -> np.ndarray:
        heads, in_features = x.shape[1], w.shape[1]
        stride = w.shape[0] // heads
        outs = []
        for h in range(heads):
            r0 = h * stride + row_start
            if isinstance(w, QuantWeight):
                # Dequantize one head's small block at a time in the scratch buffer.
                block = self._unpack_rows(w, r0, r0 + rows)[:, :in_features]
                if w.group_size is None:
                    block *= w.scales[r0:r0 + rows, None]
                else:
                    _scale_groups(block, w.scales[r0:r0 + rows], w.group_size, in_features)
            else:
                block = w[r0:r0 + rows]
            outs.append(x[:, h] @ (block if transpose else block.T))
        return np.stack(outs, axis=1)

    # ---- norms and MLP -------------------------------------------------------------------------

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        variance = np.mean(x * x, axis=-1, keepdims=True)
        return weight * (x * (1.0 / np.sqrt(variance + np.float32(eps))))

    def layer_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
        centered = x - np.mean(x, axis=-1, keepdims=True)
        variance = np.mean(centered * centered, axis=-1, keepdims=True)
        return centered / np.sqrt(variance + np.float32(eps)) * weight + bias

    def expert_mlp(self, x: np.ndarray, gate: Weight, up: Weight, down: Weight) -> np.ndarray:
        return self.linear(silu(self.linear(x, gate)) * self.linear(x, up), down)

    # ---- attention -----------------------------------------------------------------------------

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray,
                  scale: float) -> np.ndarray:
        seq, heads, _ = q.shape
        q_heads = q.transpose(1, 0, 2)  # [nh, S, dk]
        k_heads = k.transpose(1, 2, 0)  # [kh, dk, T]; kh = 1 broadcasts over the query heads
        v_heads = v.transpose(1, 0, 2)  # [kh, T, dv]
        out = np.empty((seq, heads, v.shape[2]), np.float32)
        step = max(1, self.query_block // (heads * k.shape[0]))
        blocks = [(s0, min(seq, s0 + step)) for s0 in range(0, seq, step)]
        shared_key = k.shape[1] == 1
        spans = [(0, heads)] if shared_key or seq <= self.decode_rows else self._split(heads, True)

        def part(job: tuple[tuple[int, int], tuple[int, int]]) -> None:
            (h0, h1), (s0, s1) = job
            mask = allowed[s0:s1]
            total = _allowed_end(mask)  # keys after the block's last allowed one would get probability 0
            kv_heads = slice(None) if shared_key else slice(h0, h1)
            scores = q_heads[h0:h1, s0:s1] @ k_heads[kv_heads, :, :total]  # [h, s, t]
            scores *= np.float32(scale)
            np.copyto(scores, np.float32(-np.inf), where=~mask[:, :total])
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            out[s0:s1, h0:h1] = (scores @ v_heads[kv_heads, :total]).transpose(1, 0, 2)

        self._map(part, [(span, block) for span in spans for block in blocks])
        return out

    def attention_chosen(self, q: np.ndarray, k: tuple[np.ndarray, ...], v: np.ndarray, chosen: np.ndarray,
                         scale: float) -> np.ndarray:
        seq, heads, dk = q.shape
        kh, dv, width = k[0].shape[1], v.shape[2], chosen.shape[1]
        out = np.empty((seq, heads, dv), np.float32)
        # a block's scores [s, nh, K] and its gathered keys and values [s, K, kh, dk + dv] stay within query_block
        step = max(1, self.query_block // (width * (heads + kh * (dk + dv))))

        def part(s0: int) -> None:
            s1 = min(seq, s0 + step)
            picked = chosen[s0:s1]  # [s, K]
            missing = picked < 0
            rows = np.where(missing, 0, picked)
            keys = np.concatenate([part[rows] for part in k], axis=-1)  # [s, K, kh, dk]
            values = v[rows]  # [s, K, kh, dv]
            if kh == 1:  # one shared key head: a GEMM per query over its own keys
                scores = q[s0:s1] @ keys[:, :, 0].transpose(0, 2, 1)  # [s, nh, K]
            else:
                scores = np.einsum("shd,skhd->shk", q[s0:s1], keys)
            scores *= np.float32(scale)
            np.copyto(scores, np.float32(-np.inf), where=missing[:, None, :])
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            if kh == 1:
                out[s0:s1] = scores @ values[:, :, 0]  # [s, nh, dv]
            else:
                out[s0:s1] = np.einsum("shk,skhd->shd", scores, values)

        self._map(part, range(0, seq, step))
        return out

    def index_topk(self, q: np.ndarray, k: np.ndarray, weights: np.ndarray, scale: float, positions: np.ndarray,
                   topk: int) -> np.ndarray:
        seq, heads, _ = q.shape
        out = np.empty((seq, topk), np.int32)
        # INDEX_ROWS queries against a tile of keys at a time: each key is read once per block of queries, and the
        # per-head products [nh, rows, tile] stay within query_block
        tile = max(64, self.query_block // (heads * INDEX_ROWS))

        def part(s0: int) -> None:
            s1 = min(seq, s0 + INDEX_ROWS)
            rows = s1 - s0
            total = int(positions[s0:s1].max()) + 1  # the block's keys after this are nobody's
            queries = (q[s0:s1] * np.float32(scale)).reshape(rows * heads, -1)  # [s * nh, d]
            head_w = weights[s0:s1, None, :]  # [s, 1, nh]
            scores = np.empty((rows, 1, total), np.float32)
            for t0 in range(0, total, tile):
                t1 = min(total, t0 + tile)
                per_head = (queries @ k[t0:t1].T).reshape(rows, heads, t1 - t0)  # [s, nh, t]: one GEMM
                np.maximum(per_head, 0, out=per_head)
                np.matmul(head_w, per_head, out=scores[:, :, t0:t1])  # [s, 1, t]: the heads' weighted sum
            scores = scores[:, 0]
            out[s0:s1] = chosen_keys(topk_mask(scores, position_mask(positions[s0:s1], total), topk), topk)

        self._map(part, range(0, seq, INDEX_ROWS))
        return out

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:

        return apply_rope(x, cos, sin)

    def moe(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, expert: ExpertFn,
            shared: tuple[Weight, Weight, Weight] | None, done: Callable[[int], None] | None = None) -> np.ndarray:
        # Prefill: several experts (each dequantized once for all of its rows) at a time on the worker pool.
        if x.shape[0] > self.decode_rows and self.workers > 1:
            return moe_layer(self, x, ids, weights, expert, shared, self._map, 2 * self.workers, done)
        return moe_layer(self, x, ids, weights, expert, shared, done=done)

    def release_memory(self) -> None:
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)

    def decode_step(self, config: ModelConfig, layers: Sequence[LayerSpec], weight: Callable[[str], Weight],
                    experts: ExpertArena | None = None, kv_dtype: str = "f32", rows: int = 1,
                    draft: tuple[LayerSpec, MTPSpec] | None = None, span: range | None = None,
                    logits: bool = True, sequences: bool = False, mtp: tuple[LayerSpec, MTPSpec] | None = None
                    ) -> None:
        return None  # the operations above are the decode step


GEMV_ROWS = 4  # up to this many input rows, `times_transposed` runs one GEMV per row


def times_transposed(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`x [S, I] @ w[O, I]^T -> [S, O]` (written into `out` when given: no temporary). OpenBLAS runs this
    transposed GEMM far below GEMV speed when S is a few rows, even for the cache-sized blocks of a quantized weight:
    such calls (MTP verification, a batch of decoded tokens, short chunks) go row by row, each row's product then the
    one it has alone."""
    rows = x.shape[0]
    if 1 < rows <= GEMV_ROWS:
        if out is None:
            return np.stack([w @ row for row in x])
        for i, row in enumerate(x):
            np.matmul(w, row, out=out[i])
        return out
    return np.matmul(x, w.T, out=out)


def _code_width(w: QuantWeight) -> int:
    """Codes per packed row: `I` rounded up to whole bytes (int3: whole blocks of 64)."""
    if w.bits == 3:
        return w.packed.shape[1] // INT3_BLOCK_BYTES * INT3_BLOCK
    return w.packed.shape[1] * (8 // w.bits)


def _allowed_end(allowed: np.ndarray) -> int:
    """One past the last key any row of `allowed [s, T]` may see (every row allows at least one key)."""
    return int(np.flatnonzero(allowed.any(axis=0))[-1]) + 1


def _scale_groups(codes: np.ndarray, scales: np.ndarray, group_size: int, in_features: int) -> None:
    """Multiply codes `[n, >= I]` in place by their group scales `[n, ceil(I / g)]` (columns < I only)."""
    full = in_features // group_size
    head = codes[:, : full * group_size].reshape(codes.shape[0], full, group_size)  # a view: splits one axis
    head *= scales[:, :full, None]
    if full * group_size < in_features:
        codes[:, full * group_size: in_features] *= scales[:, full:full + 1]
