/* Quantized matrix products: decode matvec (one pass over the packed weight), transposed per-head
 * matvec (MLA absorption), tiled prefill matmul, dequantization, and the fused routed-expert MLP.
 * Each is stamped out for f32 (bits 32), int8, int4, nl4 (bits NL4), int3 and int2 weights by the macros at the end.
 *
 * Weight argument block (WARGS): wbuf + w_off: the packed rows (byte offset of row 0); sbuf + s_off: the
 * float scales; n_in: columns; row_bytes: bytes per packed row; group: scale group (0 = per row);
 * n_groups: scales per row.
 */

#define WARGS __global const uchar* wbuf, ulong w_off, __global const uchar* sbuf, ulong s_off, \
              uint n_in, uint row_bytes, uint group, uint n_groups

#define ROW_PTR(r) (wbuf + w_off + (ulong)(r) * row_bytes)
#define SCALE_PTR(r) ((const __global float*)(sbuf + s_off) + (ulong)(r) * n_groups)

#if LANES > 1
#define LANE_SUM(v, red, lane) do { \
        red[lane] = (v); barrier(CLK_LOCAL_MEM_FENCE); \
        for (uint w_ = LANES / 2; w_ > 0; w_ >>= 1) { \
            if ((lane) < w_) red[lane] += red[(lane) + w_]; \
            barrier(CLK_LOCAL_MEM_FENCE); \
        } \
        (v) = red[0]; barrier(CLK_LOCAL_MEM_FENCE); \
    } while (0)
#else
#define LANE_SUM(v, red, lane) do { } while (0)
#endif

/* y[s, h, r] = sum_i x[s, h, i] * W[h * head_rows + row_start + r, i] for r < rows, s < n_s, the rows of `item`.
 * Global (ceil(rows / ROWS) * LANES, heads): a work-item owns ROWS consecutive rows (each chunk of x is
 * arranged once for all of them); each weight row is read from memory once, later inputs hit the cache.
 * codes_out (LANES == 1, work-groups of 64 / ROWS items; n_s 1, rows a multiple of 64, y's heads y_h = rows apart):
 * the 64 rows a work-group wrote also become one block of int8 codes, scale and code sum (common.cl) in yq, ys,
 * ysum, for the next product, which takes y as int8 input: no quantize_x8 launch of its own. */
INLINE void matvec(const int bits, const int x8, const int codes_out, WARGS, __global const float* x,
                   __global const char* xq, __global const float* xs, __global const int* xsum, uint n_s, uint x_s,
                   uint x_h, __global float* y, uint y_s, uint y_h, uint rows, uint head_rows, uint row_start,
                   __global char* yq, __global float* ys, __global int* ysum, uint item, __local float* red) {
    const uint lane = LANES > 1 ? get_local_id(0) : 0;
    const uint r0 = item * ROWS, h = get_global_id(1);
    const uint nrows = r0 < rows ? umin_(ROWS, rows - r0) : 0;
    const ulong wr = (ulong)h * head_rows + row_start + (nrows ? r0 : 0);
    const bool next = r0 + 2 * ROWS <= rows;  /* read ahead into the next item's rows when it has ROWS of them */
    for (uint s = 0; s < n_s; s++) {
        float v[ROWS];
        const uint at = s * x_s + h * x_h;  /* x8: a multiple of 64 (blocks at at / 64, their codes at 2 * at) */
        if (nrows && x8)
            rows_dot_x8(bits, 1, ROW_PTR(wr), ROW_PTR(wr), row_bytes, SCALE_PTR(wr), SCALE_PTR(wr), n_groups, nrows,
                        n_in, group, xq + 2 * at, xs + at / 64, xsum + at / 64, lane, v, ROW_PTR(wr + ROWS),
                        ROW_PTR(wr + ROWS), next ? ROWS * row_bytes : 0);
        else if (nrows)
            rows_dot(bits, 1, ROW_PTR(wr), ROW_PTR(wr), row_bytes, SCALE_PTR(wr), SCALE_PTR(wr), n_groups, nrows,
                     n_in, group, x + at, lane, v, ROW_PTR(wr + ROWS), ROW_PTR(wr + ROWS), next ? ROWS * row_bytes : 0);
        for (uint k = 0; k < ROWS; k++) {
            float vk = k < nrows ? v[k] : 0.0f;
            LANE_SUM(vk, red, lane);
            if (k < nrows && lane == 0) y[s * y_s + h * y_h + r0 + k] = vk;
        }
    }
    if (codes_out) {
        barrier(CLK_GLOBAL_MEM_FENCE);  /* the block's rows were written by the group's other items */
        for (uint s = 0; s < n_s && get_local_id(0) == 0; s++) {
            const uint at = s * y_s + h * y_h + r0 / 64 * 64;
            quantize_block(y + at, yq + 2 * at, ys + at / 64, ysum + at / 64);
        }
    }
}

/* The 8 dequantized values of columns 8j .. 8j+7 of a row (group % 8 == 0 or per-row scales). */
INLINE float8 weights8(const int bits, const __global uchar* row, const __global float* sc, uint j, uint group) {
    float8 w;
    if (bits == 32) return LOAD_F8(j, (const __global float*)row);
    if (bits == 8) {
        const __global char* p = (const __global char*)row + 8 * j;
        w = (float8)((float)p[0], (float)p[1], (float)p[2], (float)p[3], (float)p[4], (float)p[5], (float)p[6],
                     (float)p[7]);
    } else if (STORED_BITS(bits) == 4) {
        const uchar4 b = (uchar4)(row[4 * j], row[4 * j + 1], row[4 * j + 2], row[4 * j + 3]);
        const uchar8 q = (uchar8)(b.x & 15, b.x >> 4, b.y & 15, b.y >> 4, b.z & 15, b.z >> 4, b.w & 15, b.w >> 4);
        w = bits == NL4 ? convert_float8(nl4_values16((uchar16)(q, q)).lo) : convert_float8(q) - 8.0f;
    } else if (bits == 3) {
        w = convert_float8(int3_values8(row + 24 * (j / 8), j % 8)) - 4.0f;
    } else {
        const uchar b0 = row[2 * j], b1 = row[2 * j + 1];
        const uchar8 q = (uchar8)(b0 & 3, (b0 >> 2) & 3, (b0 >> 4) & 3, b0 >> 6, b1 & 3, (b1 >> 2) & 3, (b1 >> 4) & 3,
                                  b1 >> 6);
        w = convert_float8(q) - 2.0f;
    }
    return w * (group ? sc[(8 * j) / group] : sc[0]);
}

/* Whether matvec_t's work-items own a 16-byte chunk of each row (int4, nl4: 32 columns, int8: 16), which lies in
 * one scale group; else 8 columns each. Kernels.bind_matvec_t sizes the launch by the same rule. */
INLINE bool mvt_chunked(const int bits, uint n_in, uint group) {
    const uint cw = chunk_codes(bits);
    return (STORED_BITS(bits) == 4 || bits == 8) && n_in % cw == 0 && group % cw == 0;
}

/* A work-item's chunk c of rows wr0 .. wr0 + rows - 1 (see mvt_chunked): out[i] = sum_r xr[r] * W[wr0 + r, i] for
 * the chunk's columns, one 16-byte load per row, the codes unpacked in registers, their scale applied to xr. */
INLINE void matvec_t_chunk(const int bits, WARGS, const __global float* xr, uint rows, ulong wr0, uint c,
                           __global float* out) {
    const uint gi = group ? c * chunk_codes(bits) / group : 0;
    float8 acc[4] = {(float8)(0.0f), (float8)(0.0f), (float8)(0.0f), (float8)(0.0f)};
    float bias = 0.0f;  /* int4 codes are stored +8: sum (c - 8) v = sum c v - 8 sum v */
    for (uint r = 0; r < rows; r++) {
        const ulong wr = wr0 + r;
        const float v = xr[r] * SCALE_PTR(wr)[gi];
        const uchar16 b = LOAD_U16(c, ROW_PTR(wr));
        if (bits == 4) {  /* byte i: columns 2i (low nibble) and 2i + 1 */
            acc[0] += v * convert_float8(b.lo & (uchar8)15);
            acc[1] += v * convert_float8(b.lo >> (uchar8)4);
            acc[2] += v * convert_float8(b.hi & (uchar8)15);
            acc[3] += v * convert_float8(b.hi >> (uchar8)4);
            bias += v;
        } else if (bits == NL4) {  /* the levels carry their sign: no bias */
            const char16 lo = nl4_values16(b & (uchar16)15), hi = nl4_values16(b >> (uchar16)4);
            acc[0] += v * convert_float8(lo.lo);
            acc[1] += v * convert_float8(hi.lo);
            acc[2] += v * convert_float8(lo.hi);
            acc[3] += v * convert_float8(hi.hi);
        } else {
            acc[0] += v * convert_float8(as_char16(b).lo);
            acc[1] += v * convert_float8(as_char16(b).hi);
        }
    }
    if (STORED_BITS(bits) == 4) {
        for (uint h = 0; h < 2; h++) {
            const float8 even = acc[2 * h] - 8.0f * bias, odd = acc[2 * h + 1] - 8.0f * bias;
            vstore8((float8)(even.s0, odd.s0, even.s1, odd.s1, even.s2, odd.s2, even.s3, odd.s3), 4 * c + 2 * h, out);
            vstore8((float8)(even.s4, odd.s4, even.s5, odd.s5, even.s6, odd.s6, even.s7, odd.s7), 4 * c + 2 * h + 1,
                    out);
        }
    } else {
        vstore8(acc[0], 2 * c, out);
        vstore8(acc[1], 2 * c + 1, out);
    }
}

/* The transposed product: y[s, h, i] = sum_r x[s, h, r] * W[h * head_rows + row_start + r, i], r < rows.
 * Global (ceil(n_in / cols), heads): a work-item owns `cols` consecutive columns (a chunk where mvt_chunked, else
 * 8, one scale group when group % 8 == 0) and walks the rows of its head's block (MLA's kv_b blocks are small). */
INLINE void matvec_t(const int bits, WARGS, __global const float* x, uint n_s, uint x_s, uint x_h,
                     __global float* y, uint y_s, uint y_h, uint rows, uint head_rows, uint row_start) {
    const uint j = get_global_id(0), h = get_global_id(1);
    if (mvt_chunked(bits, n_in, group)) {
        for (uint s = 0; s < n_s; s++)
            matvec_t_chunk(bits, wbuf, w_off, sbuf, s_off, n_in, row_bytes, group, n_groups, x + s * x_s + h * x_h,
                           rows, (ulong)h * head_rows + row_start, j, y + s * y_s + h * y_h);
        return;
    }
    const uint i0 = 8 * j;
    if (i0 >= n_in) return;
    const bool vec = i0 + 8 <= n_in && (bits == 32 || group % 8 == 0);
    for (uint s = 0; s < n_s; s++) {
        const __global float* xs = x + s * x_s + h * x_h;
        float8 acc = (float8)(0.0f);
        for (uint r = 0; r < rows; r++) {
            const ulong wr = (ulong)h * head_rows + row_start + r;
            if (vec) {
                acc += xs[r] * weights8(bits, ROW_PTR(wr), SCALE_PTR(wr), j, group);
            } else {
                float part[8];
                for (uint k = 0; k < 8; k++)
                    part[k] = i0 + k < n_in ? xs[r] * weight_at(bits, ROW_PTR(wr), SCALE_PTR(wr), i0 + k, group) : 0.0f;
                acc += (float8)(part[0], part[1], part[2], part[3], part[4], part[5], part[6], part[7]);
            }
        }
        const float out[8] = {acc.s0, acc.s1, acc.s2, acc.s3, acc.s4, acc.s5, acc.s6, acc.s7};
        for (uint k = 0; k < 8 && i0 + k < n_in; k++) y[s * y_s + h * y_h + i0 + k] = out[k];
    }
}

/* Prefill: Y[s, o] = sum_i X[s, i] W[o, i], tiled for reuse. A work-group (8 x 8 items) owns a 32 x 32
 * output tile; each K step dequantizes a 32 x 32 weight tile once into local memory (k-major, so items
 * with consecutive o read consecutive words) and every item accumulates a 4 x 4 register block. */
#define MM_T 32
#define MM_K 32
INLINE void matmul(const int bits, WARGS, __global const float* x, uint n_s, uint x_s,
                   __global float* y, uint y_s, uint rows, __local float* xt, __local float* wt) {
    const uint lo = get_local_id(0), ls = get_local_id(1), tid = ls * 8 + lo;
    const uint o0 = get_group_id(0) * MM_T, s0 = get_group_id(1) * MM_T;
    float acc[4][4];
    for (uint a = 0; a < 4; a++)
        for (uint b = 0; b < 4; b++) acc[a][b] = 0.0f;
    for (uint k0 = 0; k0 < n_in; k0 += MM_K) {
        for (uint e = tid; e < MM_T * MM_K; e += 64) {
            const uint rr = e / MM_K, kk = e % MM_K, k = k0 + kk;
            const uint s = s0 + rr, o = o0 + rr;
            xt[kk * MM_T + rr] = (s < n_s && k < n_in) ? x[s * x_s + k] : 0.0f;
            wt[kk * MM_T + rr] = (o < rows && k < n_in) ? weight_at(bits, ROW_PTR(o), SCALE_PTR(o), k, group) : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (uint kk = 0; kk < MM_K; kk++) {
            float xv[4], wv[4];
            for (uint a = 0; a < 4; a++) xv[a] = xt[kk * MM_T + ls + 8 * a];
            for (uint b = 0; b < 4; b++) wv[b] = wt[kk * MM_T + lo + 8 * b];
            for (uint a = 0; a < 4; a++)
                for (uint b = 0; b < 4; b++) acc[a][b] += xv[a] * wv[b];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (uint a = 0; a < 4; a++) {
        const uint s = s0 + ls + 8 * a;
        for (uint b = 0; b < 4; b++) {
            const uint o = o0 + lo + 8 * b;
            if (s < n_s && o < rows) y[s * y_s + o] = acc[a][b];
        }
    }
}

/* out[r, i] = W[row_start + r, i] as float (prefill: dequantize once, then a BLAS GEMM). Global (n_in, rows).
 * er_*: row token[t] into out row t, the index read from a buffer (the device decode step's embedding of a
 * device-chosen token). Global (n_in, tokens). */
INLINE void dequant(const int bits, WARGS, __global float* out, uint rows, uint row_start) {
    const uint i = get_global_id(0), r = get_global_id(1);
    if (i >= n_in || r >= rows) return;
    const ulong wr = (ulong)row_start + r;
    out[(ulong)r * n_in + i] = weight_at(bits, ROW_PTR(wr), SCALE_PTR(wr), i, group);
}

/* Fused expert MLP, part 1, over "slots" (one slot = one token routed to one expert):
 * hid[slot, r] = silu(gate_e[r] . x[tok]) * (up_e[r] . x[tok]). offs holds 6 byte offsets per slot into
 * wbuf: gate, gate scales, up, up scales, down, down scales. A slot whose token is 0xffffffff is unused (the
 * device decode step's routing fills a fixed number of slots per weight buffer). Global
 * (ceil(inter / ROWS) * LANES, slots). */
INLINE void expert_gate_up(const int bits, const int x8, __global const uchar* wbuf, __global const ulong* offs,
                           __global const uint* slot_tok, uint n_in, uint row_bytes, uint group, uint n_groups,
                           __global const float* x, uint x_s, __global const char* xq, __global const float* xs,
                           __global const int* xsum, __global float* hid, uint inter, __local float* red) {
    const uint lane = LANES > 1 ? get_local_id(0) : 0;
    const uint r0 = (get_global_id(0) / LANES) * ROWS, slot = get_global_id(1);
    const uint nrows = r0 < inter ? umin_(ROWS, inter - r0) : 0;
    const uint tok = slot_tok[slot];
    if (tok == 0xffffffffu) return;  /* uniform over a work-group: its items share the slot */
    __global const ulong* o = offs + slot * 6;
    float gu[2 * ROWS];  /* gate rows, then up rows: one pass over x for both */
    if (nrows) {
        const ulong first = (ulong)r0, ahead = (first + ROWS) * row_bytes;  /* the next item's rows */
        const uint ahead_bytes = r0 + 2 * ROWS <= inter ? ROWS * row_bytes : 0;
        const __global uchar* gate = wbuf + o[0] + first * row_bytes;
        const __global uchar* up = wbuf + o[2] + first * row_bytes;
        const __global float* gate_sc = (const __global float*)(wbuf + o[1]) + first * n_groups;
        const __global float* up_sc = (const __global float*)(wbuf + o[3]) + first * n_groups;
        if (x8)
            rows_dot_x8(bits, 2, gate, up, row_bytes, gate_sc, up_sc, n_groups, nrows, n_in, group,
                        xq + tok * 2 * n_in, xs + tok * (n_in / 64), xsum + tok * (n_in / 64), lane, gu,
                        wbuf + o[0] + ahead, wbuf + o[2] + ahead, ahead_bytes);
        else
            rows_dot(bits, 2, gate, up, row_bytes, gate_sc, up_sc, n_groups, nrows, n_in, group, x + tok * x_s, lane,
                     gu, wbuf + o[0] + ahead, wbuf + o[2] + ahead, ahead_bytes);
    }
#if LANES == 1 && ROWS == 4
    if (nrows == ROWS) {
        const float4 g = (float4)(gu[0], gu[1], gu[2], gu[3]), u = (float4)(gu[4], gu[5], gu[6], gu[7]);
        vstore4(silu4(g) * u, 0, hid + slot * inter + r0);
        return;
    }
#endif
    for (uint k = 0; k < ROWS; k++) {
        float gk = k < nrows ? gu[k] : 0.0f, uk = k < nrows ? gu[ROWS + k] : 0.0f;
        LANE_SUM(gk, red, lane);
        LANE_SUM(uk, red, lane);
        if (k < nrows && lane == 0) hid[slot * inter + r0 + k] = silu(gk) * uk;
    }
}

/* Part 2: y[t, o] = sum over the slots of token t (slots tok_start[t] .. tok_start[t+1]) of
 * slot_w[slot] * (down_e[o] . hid[slot]). Global (ceil(rows / ROWS) * LANES, tokens). */
INLINE void expert_down(const int bits, __global const uchar* wbuf, __global const ulong* offs,
                        __global const uint* tok_start, __global const float* slot_w, uint n_in, uint row_bytes,
                        uint group, uint n_groups, __global const float* hid, __global float* y, uint y_s, uint rows,
                        __local float* red) {
    const uint lane = LANES > 1 ? get_local_id(0) : 0;
    const uint r0 = (get_global_id(0) / LANES) * ROWS, t = get_global_id(1);
    const uint nrows = r0 < rows ? umin_(ROWS, rows - r0) : 0;
    float acc[ROWS];
    for (uint k = 0; k < ROWS; k++) acc[k] = 0.0f;
    for (uint slot = tok_start[t]; slot < tok_start[t + 1]; slot++) {
        __global const ulong* o = offs + slot * 6;
        float v[ROWS];
        /* read ahead into the next slot's rows (another expert), after the last slot into the next item's */
        const bool last = slot + 1 == tok_start[t + 1];
        const __global uchar* ahead = wbuf + (last ? offs[tok_start[t] * 6 + 4] + (ulong)(r0 + ROWS) * row_bytes
                                                   : o[10] + (ulong)r0 * row_bytes);
        const uint ahead_bytes = nrows == ROWS && (!last || r0 + 2 * ROWS <= rows) ? ROWS * row_bytes : 0;
        const __global uchar* down = wbuf + o[4] + (ulong)r0 * row_bytes;
        const __global float* down_sc = (const __global float*)(wbuf + o[5]) + (ulong)r0 * n_groups;
        if (nrows) rows_dot(bits, 1, down, down, row_bytes, down_sc, down_sc, n_groups, nrows, n_in, group,
                            hid + slot * n_in, lane, v, ahead, ahead, ahead_bytes);
        for (uint k = 0; k < ROWS; k++) {
            float vk = k < nrows ? v[k] : 0.0f;
            LANE_SUM(vk, red, lane);
            acc[k] += slot_w[slot] * vk;
        }
    }
    for (uint k = 0; k < nrows; k++) {
        if (lane == 0) y[t * y_s + r0 + k] = acc[k];
    }
}

/* Part 2 split in two, for the device decode step: expert_down_part computes part[slot, o] = down_e[o] . hid[slot]
 * (x8: hid's int8 codes hq, hs, hsum; else the float rows) with one work-item per (ROWS rows, slot), so the items
 * of a work-group stream one expert's rows (expert_down's items read every slot's rows: interleaved streams of a
 * few hundred bytes, far below streaming bandwidth); then expert_sum (or the next residual norm) adds
 * the slots up in expert_down's order. Slots whose token is 0xffffffff are unused (a slot's row is then left as it
 * is: a later launch over the same slots may fill it).
 * Global (ceil(rows / ROWS) * LANES, slots). */
INLINE void expert_down_part(const int bits, const int x8, __global const uchar* wbuf, __global const ulong* offs,
                             __global const uint* slot_tok, uint n_in,
                             uint row_bytes, uint group, uint n_groups,
                             __global const float* hid, __global const char* hq, __global const float* hs,
                             __global const int* hsum, __global float* part, uint rows, __local float* red) {
    const uint lane = LANES > 1 ? get_local_id(0) : 0;
    const uint r0 = (get_global_id(0) / LANES) * ROWS, slot = get_global_id(1);
    const uint nrows = r0 < rows ? umin_(ROWS, rows - r0) : 0;
    if (slot_tok[slot] == 0xffffffffu) return;  /* uniform over a work-group */
    __global const ulong* o = offs + slot * 6;
    const __global uchar* down = wbuf + o[4] + (ulong)r0 * row_bytes;
    const __global float* down_sc = (const __global float*)(wbuf + o[5]) + (ulong)r0 * n_groups;
    const uint ahead_bytes = r0 + 2 * ROWS <= rows ? ROWS * row_bytes : 0;  /* the next item's rows */
    float v[ROWS];
    if (nrows && x8)
        rows_dot_x8(bits, 1, down, down, row_bytes, down_sc, down_sc, n_groups, nrows, n_in, group,
                    hq + slot * 2 * n_in, hs + slot * (n_in / 64), hsum + slot * (n_in / 64), lane, v,
                    down + ROWS * row_bytes, down + ROWS * row_bytes, ahead_bytes);
    else if (nrows)
        rows_dot(bits, 1, down, down, row_bytes, down_sc, down_sc, n_groups, nrows, n_in, group, hid + slot * n_in,
                 lane, v, down + ROWS * row_bytes, down + ROWS * row_bytes, ahead_bytes);
    for (uint k = 0; k < ROWS; k++) {
        float vk = k < nrows ? v[k] : 0.0f;
        LANE_SUM(vk, red, lane);
        if (k < nrows && lane == 0) part[slot * rows + r0 + k] = vk;
    }
}

/* y[t, o] = sum over token t's slots [tok_start[t], tok_start[t + 1]) of slot_w[slot] * part[slot, o].
 * Global (rows, tokens). */
__kernel void expert_sum(__global const float* part, __global const uint* tok_start, __global const float* slot_w,
                         __global float* y, uint rows) {
    const uint o = get_global_id(0), t = get_global_id(1);
    if (o >= rows) return;
    float acc = 0.0f;
    for (uint slot = tok_start[t]; slot < tok_start[t + 1]; slot++) acc += slot_w[slot] * part[slot * rows + o];
    y[(ulong)t * rows + o] = acc;
}

#define QUANT_KERNELS(SUFFIX, BITS) \
__kernel void mv_##SUFFIX(WARGS, __global const float* x, uint n_s, uint x_s, uint x_h, __global float* y, \
                          uint y_s, uint y_h, uint rows, uint head_rows, uint row_start) { \
    __local float red[LANES]; \
    matvec(BITS, 0, 0, wbuf, w_off, sbuf, s_off, n_in, row_bytes, group, n_groups, x, 0, 0, 0, n_s, x_s, x_h, y, \
           y_s, y_h, rows, head_rows, row_start, 0, 0, 0, get_global_id(0) / LANES, red); \
} \
__kernel void mvt_##SUFFIX(WARGS, __global const float* x, uint n_s, uint x_s, uint x_h, __global float* y, \
                           uint y_s, uint y_h, uint rows, uint head_rows, uint row_start) { \
    matvec_t(BITS, wbuf, w_off, sbuf, s_off, n_in, row_bytes, group, n_groups, x, n_s, x_s, x_h, y, y_s, y_h, \
             rows, head_rows, row_start); \
} \
__kernel __attribute__((reqd_work_group_size(8, 8, 1))) \
void mm_##SUFFIX(WARGS, __global const float* x, uint n_s, uint x_s, __global float* y, uint y_s, uint rows) { \
    __local float xt[MM_K * MM_T]; \
    __local float wt[MM_K * MM_T]; \
    matmul(BITS, wbuf, w_off, sbuf, s_off, n_in, row_bytes, group, n_groups, x, n_s, x_s, y, y_s, rows, xt, wt); \
} \
__kernel void dq_##SUFFIX(WARGS, __global float* out, uint rows, uint row_start) { \
    dequant(BITS, wbuf, w_off, sbuf, s_off, n_in, row_bytes, group, n_groups, out, rows, row_start); \
} \
__kernel void er_##SUFFIX(WARGS, __global const uint* token, __global float* out) { \
    const uint i = get_global_id(0), t = get_global_id(1); \
    if (i >= n_in) return; \
    const ulong r = token[t]; \
    out[(ulong)t * n_in + i] = weight_at(BITS, ROW_PTR(r), SCALE_PTR(r), i, group); \
} \
__kernel void eg_##SUFFIX(__global const uchar* wbuf, __global const ulong* offs, __global const uint* slot_tok, \
                          uint n_in, uint row_bytes, uint group, uint n_groups, __global const float* x, uint x_s, \
                          __global float* hid, uint inter) { \
    __local float red[LANES]; \
    expert_gate_up(BITS, 0, wbuf, offs, slot_tok, n_in, row_bytes, group, n_groups, x, x_s, 0, 0, 0, hid, inter, \
                   red); \
} \
__kernel void ed_##SUFFIX(__global const uchar* wbuf, __global const ulong* offs, __global const uint* tok_start, \
                          __global const float* slot_w, uint n_in, uint row_bytes, uint group, uint n_groups, \
                          __global const float* hid, __global float* y, uint y_s, uint rows) { \
    __local float red[LANES]; \
    expert_down(BITS, wbuf, offs, tok_start, slot_w, n_in, row_bytes, group, n_groups, hid, y, y_s, rows, red); \
} \
__kernel void edp_##SUFFIX(__global const uchar* wbuf, __global const ulong* offs, \
                           __global const uint* slot_tok, uint n_in, uint row_bytes, uint group, uint n_groups, \
                           __global const float* hid, __global float* part, uint rows) { \
    __local float red[LANES]; \
    expert_down_part(BITS, 0, wbuf, offs, slot_tok, n_in, row_bytes, group, n_groups, hid, 0, 0, 0, \
                     part, rows, red); \
}

QUANT_KERNELS(f32, 32)
QUANT_KERNELS(q8, 8)
QUANT_KERNELS(q4, 4)
QUANT_KERNELS(q4nl, NL4)
QUANT_KERNELS(q3, 3)
QUANT_KERNELS(q2, 2)

/* The query of MLA's absorbed decode attention, per head h (the device decode step's): q_abs[h] = x[h, :rows] @
 * W[h * head_rows ...] (matvec_t_chunk: kv_b's nope rows of head h) and q_rot[h] = RoPE of the `rope` values after
 * them, x[h, rows ...] (cs: see rope_rows; done by the head's first work-item, de-interleaved as rope_rows does).
 * x rows x_h apart, q_abs rows n_in apart. The heads of several token rows in one launch: h counts on over the
 * tokens (nh heads each, token h / nh reads cs row h / nh). Global (n_in / chunk columns, tokens * nh):
 * mvt_chunked weights only. */
#define MLA_QUERY(SUFFIX, BITS) \
__kernel void mla_query_##SUFFIX(WARGS, __global const float* x, uint x_h, __global float* q_abs, uint rows, \
                                 uint head_rows, __global const float* cs, __global float* q_rot, uint rope, \
                                 uint nh) { \
    const uint j = get_global_id(0), h = get_global_id(1), n_half = rope / 2; \
    const __global float* xh = x + h * x_h; \
    matvec_t_chunk(BITS, wbuf, w_off, sbuf, s_off, n_in, row_bytes, group, n_groups, xh, rows, \
                   (ulong)(h % nh) * head_rows, j, q_abs + h * n_in); \
    if (j) return; \
    for (uint i = 0; i < n_half; i++) rope_pair(xh + rows, q_rot + h * rope, cs + h / nh * rope, n_half, i); \
}

MLA_QUERY(q8, 8)
MLA_QUERY(q4, 4)
MLA_QUERY(q4nl, NL4)

/* ---- int8 activations (common.cl): the device decode step's int3, int4 and int8 products --------------------
 * quantize_x8: rows of x (stride x_s, n columns, a multiple of 64) -> codes q[2 * (r * n + 64 b) ...] (both
 * orders of common.cl), scales qs[r * n / 64 + b] and code sums qsum[...] per block b. Global (n / 64, rows). */
__kernel void quantize_x8(__global const float* x, uint x_s, uint n, __global char* q, __global float* qs,
                          __global int* qsum) {
    const uint b = get_global_id(0), r = get_global_id(1), at = r * (n / 64) + b;
    quantize_block(x + r * x_s + 64 * b, q + 2 * (r * n + 64 * b), qs + at, qsum + at);
}

/* mv_*_x8, eg_*_x8, edp_*_x8: mv / eg / expert_down_part of int3, int4 and int8 rows over quantized inputs (x: one row
 * per token or head, offsets x_s and x_h counted as for float x; hid: one row per slot). mvq_*_x8: mv_*_x8 also
 * writing its output's int8 codes (codes_out in matvec). mv2_*_x8: two products of one input in one launch (the
 * step's q_a and kv_a both read the normed hidden state): y = W x by the first `items` work-items (ceil(rows /
 * ROWS)), y2 = W2 x by the others, for n_s contiguous input rows (y rows `rows`, y2 rows `rows2` apart); W2 has
 * W's bits, columns and groups. Global ((items + ceil(rows2 / ROWS)) * LANES, 1). */
#define MV_X8(NAME, BITS, CODES) \
__kernel void NAME(WARGS, __global const char* xq, __global const float* xs, __global const int* xsum, uint n_s, \
                   uint x_s, uint x_h, __global float* y, uint y_s, uint y_h, uint rows, uint head_rows, \
                   uint row_start, __global char* yq, __global float* ys, __global int* ysum) { \
    __local float red[LANES]; \
    matvec(BITS, 1, CODES, wbuf, w_off, sbuf, s_off, n_in, row_bytes, group, n_groups, 0, xq, xs, xsum, n_s, x_s, \
           x_h, y, y_s, y_h, rows, head_rows, row_start, yq, ys, ysum, get_global_id(0) / LANES, red); \
}
#define X8_KERNELS(SUFFIX, BITS) \
MV_X8(mv_##SUFFIX##_x8, BITS, 0) \
MV_X8(mvq_##SUFFIX##_x8, BITS, 1) \
__kernel void mv2_##SUFFIX##_x8(WARGS, __global const uchar* wbuf2, ulong w_off2, __global const uchar* sbuf2, \
                                ulong s_off2, __global const char* xq, __global const float* xs, \
                                __global const int* xsum, uint n_s, __global float* y, uint rows, uint items, \
                                __global float* y2, uint rows2) { \
    __local float red[LANES]; \
    const uint item = get_global_id(0) / LANES; \
    if (item < items) \
        matvec(BITS, 1, 0, wbuf, w_off, sbuf, s_off, n_in, row_bytes, group, n_groups, 0, xq, xs, xsum, n_s, n_in, 0, \
               y, rows, 0, rows, 0, 0, 0, 0, 0, item, red); \
    else \
        matvec(BITS, 1, 0, wbuf2, w_off2, sbuf2, s_off2, n_in, row_bytes, group, n_groups, 0, xq, xs, xsum, n_s, n_in, \
               0, y2, rows2, 0, rows2, 0, 0, 0, 0, 0, item - items, red); \
} \
__kernel void eg_##SUFFIX##_x8(__global const uchar* wbuf, __global const ulong* offs, __global const uint* slot_tok, \
                               uint n_in, uint row_bytes, uint group, uint n_groups, __global const char* xq, \
                               __global const float* xs, __global const int* xsum, __global float* hid, uint inter) { \
    __local float red[LANES]; \
    expert_gate_up(BITS, 1, wbuf, offs, slot_tok, n_in, row_bytes, group, n_groups, 0, 0, xq, xs, xsum, hid, inter, \
                   red); \
} \
__kernel void edp_##SUFFIX##_x8(__global const uchar* wbuf, __global const ulong* offs, \
                                __global const uint* slot_tok, uint n_in, \
                                uint row_bytes, uint group, uint n_groups, __global const char* hq, \
                                __global const float* hs, __global const int* hsum, __global float* part, uint rows) { \
    __local float red[LANES]; \
    expert_down_part(BITS, 1, wbuf, offs, slot_tok, n_in, row_bytes, group, n_groups, 0, hq, hs, hsum, \
                     part, rows, red); \
}

X8_KERNELS(q8, 8)
X8_KERNELS(q4, 4)
X8_KERNELS(q4nl, NL4)
X8_KERNELS(q3, 3)
