"""The product kernels bound between buffers that stay put: the building blocks of the device decode step
(glmkit.backends.opencl.decode_graph) for one token - weight products of one input row, with float or
int8-quantized inputs, the query's absorption, the embedding lookup and the fused experts.

Each function returns bound launches (`Launch`), enqueued in order on the device's queue as often as needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glmkit.backends.opencl.buffers import Int8Codes
from glmkit.backends.opencl.ops import Kernels
from glmkit.backends.opencl.program import Launch
from glmkit.backends.opencl.weights import X8_BLOCK, ClWeight, ExpertShape, mvt_chunked, mvt_global


@dataclass(frozen=True)
class ExpertSlots:
    """The buffers of the expert slots of `tokens` consecutive tokens, as the fused expert kernels read them: per slot
    the 6 byte offsets of its expert's tensors (offs: gate, gate scales, up, up scales, down, down scales), its token
    (slot_tok; 0xffffffff: unused) and routing weight (slot_w); token t's slot range [tok_start[t], tok_start[t + 1]);
    `count` slots."""

    offs: Any
    slot_tok: Any
    tok_start: Any
    slot_w: Any
    count: int
    tokens: int = 1


def bind_matvec(k: Kernels, w: ClWeight, x: Any, y: Any, heads: int = 1, x_h: int = 0, head_rows: int = 0,
                row_start: int = 0, rows: int | None = None, tokens: int = 1) -> Launch:
    """`y[t, h, r] = x[t, h] . W[h * head_rows + row_start + r]` for `tokens` tokens (x rows `x_h` floats apart, a
    token's `heads * n_in`; y rows `rows`); x, y: buffers."""
    rows = w.rows if rows is None else rows
    g0, local = k.rows_global(rows)
    return k.bind("mv_" + w.suffix, (g0, heads), local, **w.args(), x=x, n_s=tokens, x_s=heads * w.n_in, x_h=x_h,
                  y=y, y_s=heads * rows, y_h=rows, rows=rows, head_rows=head_rows, row_start=row_start)


def bind_quantize(k: Kernels, x: Any, n: int, rows: int, codes: Int8Codes) -> Launch:
    """int8 codes, scales and code sums (into `codes`) of `rows` contiguous rows of n floats (n a multiple of
    X8_BLOCK): the inputs of the int8-input products."""
    return k.bind("quantize_x8", (n // X8_BLOCK, rows), None, x=x, x_s=n, n=n, **codes.args())


def bind_matvec_x8(k: Kernels, w: ClWeight, x_codes: Int8Codes, y: Any, heads: int = 1, head_rows: int = 0,
                   row_start: int = 0, rows: int | None = None, codes_out: Int8Codes | None = None,
                   tokens: int = 1) -> Launch:
    """`bind_matvec` of contiguous input rows (x_h = n_in) with int8 activations (`x8_eligible`): x_codes holds the
    rows quantized (`bind_quantize`). codes_out: y's own codes written there too (`Kernels.writes_codes` devices,
    rows a multiple of X8_BLOCK), for a product that takes y as int8 input."""
    rows = w.rows if rows is None else rows
    g0, local = k.rows_global(rows)
    name = f"mv_{w.suffix}_x8"
    if codes_out is not None:
        assert k.writes_codes and rows % X8_BLOCK == 0
        name, local = f"mvq_{w.suffix}_x8", (X8_BLOCK // k.rows_per_item, 1)
    y_codes = codes_out or Int8Codes.unused(y)  # mv_*_x8 does not write them
    return k.bind(name, (g0, heads), local, **w.args(), **x_codes.args("x"), n_s=tokens, x_s=heads * w.n_in,
                  x_h=w.n_in,
                  y=y, y_s=heads * rows, y_h=rows, rows=rows, head_rows=head_rows, row_start=row_start,
                  **y_codes.args("y"))


def bind_matvec_pair(k: Kernels, w: ClWeight, w2: ClWeight, x_codes: Int8Codes, y: Any, y2: Any,
                     tokens: int = 1) -> Launch:
    """`y = W x` and `y2 = W2 x` in one launch, over `tokens` input rows quantized in x_codes (`bind_quantize`); W
    and W2 alike in weight type (bits and quant scheme), columns and groups, both `x8_eligible`."""
    assert (w.suffix, w.n_in, w.group, w.row_bytes) == (w2.suffix, w2.n_in, w2.group, w2.row_bytes)
    items = -(-w.rows // k.rows_per_item)
    g0, local = k.rows_global(items * k.rows_per_item + w2.rows)
    return k.bind(f"mv2_{w.suffix}_x8", (g0, 1), local, **w.args(), **w2.location("2"), **x_codes.args("x"), n_s=tokens,
                  y=y, rows=w.rows, items=items, y2=y2, rows2=w2.rows)


def bind_embed_row(k: Kernels, w: ClWeight, token: Any, out: Any, tokens: int = 1) -> Launch:
    """Rows `token[t]` of W (a buffer holding `tokens` uints) as float into rows t of `out`: an embedding lookup on
    the device."""
    return k.bind("er_" + w.suffix, (w.n_in, tokens), None, **w.args(), token=token, out=out)


def bind_matvec_t(k: Kernels, w: ClWeight, x: Any, y: Any, heads: int, x_h: int, head_rows: int, row_start: int,
                  rows: int, tokens: int = 1) -> Launch:
    """`y[t, h] = x[t, h, :rows] @ W[h * head_rows + row_start ...]` for `tokens` tokens (x rows `x_h` floats
    apart)."""
    return k.bind("mvt_" + w.suffix, mvt_global(w, heads), None, **w.args(), x=x, n_s=tokens, x_s=heads * x_h,
                  x_h=x_h,
                  y=y, y_s=heads * w.n_in, y_h=w.n_in, rows=rows, head_rows=head_rows, row_start=row_start)


def bind_mla_query(k: Kernels, w: ClWeight, x: Any, x_h: int, q_abs: Any, rows: int, head_rows: int, heads: int,
                   cs: Any, q_rot: Any, rope: int, tokens: int = 1) -> Launch:
    """MLA's decode query per head (`mla_query` in quant.cl): q_abs[t, h] = x[t, h, :rows] @ W[h * head_rows ...] and
    q_rot[t, h] = RoPE(x[t, h, rows:rows + rope]) for `tokens` tokens (cs: each position's cos and sin, `[tokens,
    rope]`); W `mvt_chunked`."""
    assert mvt_chunked(w)
    return k.bind("mla_query_" + w.suffix, mvt_global(w, heads * tokens), None, **w.args(), x=x, x_h=x_h,
                  q_abs=q_abs, rows=rows, head_rows=head_rows, cs=cs, q_rot=q_rot, rope=rope, nh=heads)


def bind_experts(k: Kernels, wbuf: Any, shape: ExpertShape, x: Any, slots: ExpertSlots, hid: Any, part: Any,
                 y: Any, summed: bool = True) -> tuple[Launch, ...]:
    """The fused experts of one token over its `slots` (on the device), float inputs x: gate+up into hid, down per
    slot into part (`[slots.count, n_in]` floats), then (when summed) the slots' weighted sum into y."""
    g_inter, l_inter = k.rows_global(shape.inter)
    g_out, l_out = k.rows_global(shape.n_in)
    launches = (k.bind("eg_" + shape.suffix, (g_inter, slots.count), l_inter, wbuf=wbuf, offs=slots.offs,
                       slot_tok=slots.slot_tok, **shape.gate_up_args(), x=x, x_s=shape.n_in, hid=hid,
                       inter=shape.inter),
                k.bind("edp_" + shape.suffix, (g_out, slots.count), l_out, wbuf=wbuf, offs=slots.offs,
                       slot_tok=slots.slot_tok, **shape.down_args(), hid=hid, part=part,
                       rows=shape.n_in))
    return _summed(k, launches, summed, part, slots, y, shape.n_in)


def bind_experts_x8(k: Kernels, wbuf: Any, shape: ExpertShape, x_codes: Int8Codes, slots: ExpertSlots, hid: Any,
                    hid_codes: Int8Codes, part: Any, y: Any, summed: bool = True) -> tuple[Launch, ...]:
    """`bind_experts` for int4/int8 experts with int8 activations (`x8_eligible`): gate+up over x quantized in
    x_codes (`bind_quantize`), the slots' hidden rows quantized into hid_codes, down per slot into part, then
    (when summed) the slots' weighted sum into y."""
    g_inter, l_inter = k.rows_global(shape.inter)
    g_out, l_out = k.rows_global(shape.n_in)
    launches = (k.bind(f"eg_{shape.suffix}_x8", (g_inter, slots.count), l_inter, wbuf=wbuf, offs=slots.offs,
                       slot_tok=slots.slot_tok, **shape.gate_up_args(), **x_codes.args("x"), hid=hid,
                       inter=shape.inter),
                bind_quantize(k, hid, shape.inter, slots.count, hid_codes),
                k.bind(f"edp_{shape.suffix}_x8", (g_out, slots.count), l_out, wbuf=wbuf, offs=slots.offs,
                       slot_tok=slots.slot_tok, **shape.down_args(), **hid_codes.args("h"),
                       part=part, rows=shape.n_in))
    return _summed(k, launches, summed, part, slots, y, shape.n_in)


def _summed(k: Kernels, launches: tuple[Launch, ...], summed: bool, part: Any, slots: ExpertSlots, y: Any,
            n: int) -> tuple[Launch, ...]:
    """The experts' launches, then (when summed) expert_sum of their per-slot down rows into y."""
    return (*launches, bind_expert_sum(k, part, slots, y, n)) if summed else launches


def bind_expert_sum(k: Kernels, part: Any, slots: ExpertSlots, y: Any, n: int) -> Launch:
    """Each token's slots' down rows (`part`, `[slots.count, n]`) weighted by slot_w and summed in slot order into
    its row of y."""
    return k.bind("expert_sum", (n, slots.tokens), None, part=part, tok_start=slots.tok_start, slot_w=slots.slot_w,
                  y=y, rows=n)
