/* The kernels that read or write KV cache rows, at the precision the rows are stored in (kv_cache.KV_DTYPES),
 * chosen when the program is built: KV_TYPE 0 f32 (the default build), 1 bf16 (a float's top 16 bits, rounded to
 * nearest even), 2 fp8 e4m3 codes times one f32 scale per row (the `*_scale` arrays, unused by f32 and bf16), 3 IEEE
 * half codes (rounded to nearest even) times one f32 scale per row: 1, or the least power of two that brings the
 * row's largest magnitude within F16_ROW_MAX (kv_cache.F16_ROW_MAX, given at build time). Codes are decoded as they
 * are loaded; a row's scale multiplies its dot products, not each value. */
#ifndef KV_TYPE
#define KV_TYPE 0
#endif
#define KV_SCALED (KV_TYPE >= 2)

/* e4m3 (bias 7, no infinities) to float: normal codes by moving their bits into a float's, subnormal ones
 * (exponent 0) as mantissa * 2^-9. */
INLINE float e4m3_float(uchar b) {
    const uint m = b & 0x7f;
    const float v = m >= 8 ? as_float((m << 20) + (120u << 23)) : (float)m * 0x1p-9f;
    return (b & 0x80) ? -v : v;
}

INLINE float8 e4m3_float8(uchar8 b) {
    const uint8 m = convert_uint8(b & (uchar8)(0x7f));
    const float8 v = select(convert_float8(m) * 0x1p-9f, as_float8((m << 20) + (uint8)(120u << 23)), m >= (uint8)(8));
    return as_float8(as_uint8(v) | (convert_uint8(b & (uchar8)(0x80)) << 24));
}

/* float to e4m3, rounded to nearest even, |x| <= 448: the quantum is 2^(e - 3) in binade e (2^-9 below 2^-6). */
INLINE uchar float_e4m3(float x) {
    const uint sign = (as_uint(x) >> 24) & 0x80;
    const float a = fabs(x);
    const int e = max((int)(as_uint(a) >> 23) - 127, -6);
    const float r = rint(a * ldexp(1.0f, 3 - e)) * ldexp(1.0f, e - 3);
    const int er = (int)(as_uint(r) >> 23) - 127;  /* a rounded up may start the next binade */
    const uint code = er < -6 ? (uint)(r * 512.0f) : ((uint)(er + 7) << 3) | ((as_uint(r) >> 20) & 7);
    return (uchar)(sign | code);
}

INLINE ushort float_bf16(float x) {
    const uint u = as_uint(x);
    return (ushort)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if KV_TYPE == 0
typedef float kv_t;
#define LOAD_KV8(i, p) LOAD_F8(i, p)
#define KV_AT(p, i) ((p)[i])
#elif KV_TYPE == 1
typedef ushort kv_t;
#define LOAD_KV8(i, p) as_float8(convert_uint8(LOAD_US8(i, p)) << 16)
#define KV_AT(p, i) as_float((uint)(p)[i] << 16)
#elif KV_TYPE == 3
typedef half kv_t;  /* only loaded and stored through vload_half / vstore_half: no half arithmetic needed */
#define LOAD_KV8(i, p) vload_half8((i), (p))
#define KV_AT(p, i) vload_half((i), (p))
#else
typedef uchar kv_t;
#define LOAD_KV8(i, p) e4m3_float8(LOAD_U8(i, p))
#define KV_AT(p, i) e4m3_float((p)[i])
#endif
#define ROW_SCALE(s, t) (KV_SCALED ? (s)[t] : 1.0f)
#define KV_LINE (64 / sizeof(kv_t))  /* values per cache line */

/* Stores one f32 row x [n] as row `row` of a cache field (`out`, and its scales at fp8 and f16): fp8 scales by the
 * row's largest magnitude / 448 (1 for a zero row), f16 by a power of two (frexp is exact), as
 * kv_cache.encode_kv_rows. One work-group. */
INLINE void store_kv_row(const __global float* x, __global kv_t* out, __global float* scales, uint row, uint n,
                         __local float* red) {
    const uint l = get_local_id(0);
    __global kv_t* o = out + (ulong)row * n;
#if KV_TYPE == 2
    float m = 0.0f;
    for (uint i = l; i < n; i += RED_LANES) m = fmax_(m, fabs(x[i]));
    m = group_max(m, red);
    const float inv = m > 0.0f ? 448.0f / m : 1.0f;
    if (l == 0 && n > 0) scales[row] = m > 0.0f ? m / 448.0f : 1.0f;
    for (uint i = l; i < n; i += RED_LANES) o[i] = float_e4m3(x[i] * inv);
#elif KV_TYPE == 3
    float m = 0.0f;
    for (uint i = l; i < n; i += RED_LANES) m = fmax_(m, fabs(x[i]));
    m = group_max(m, red);
    int e = 0;
    const float f = frexp(m * (1.0f / F16_ROW_MAX), &e);
    const int power = m > F16_ROW_MAX ? (f == 0.5f ? e - 1 : e) : 0;
    if (l == 0 && n > 0) scales[row] = ldexp(1.0f, power);
    const float inv = ldexp(1.0f, -power);
    for (uint i = l; i < n; i += RED_LANES) vstore_half_rte(x[i] * inv, i, o);
#elif KV_TYPE == 1
    for (uint i = l; i < n; i += RED_LANES) o[i] = float_bf16(x[i]);
#else
    for (uint i = l; i < n; i += RED_LANES) o[i] = x[i];
#endif
}

/* The token's cache rows, which token_rows wrote in f32 (lat [kvl], rot [rope], and idx [ihd] when `index`), stored
 * as row `row` of kv_lat, k_rot and index_k at the program's KV_TYPE. Token r of several: its rows r stored as row
 * `row + r`. One work-group per token: global (RED_LANES, tokens). */
__kernel void kv_store_rows(__global const float* lat, __global const float* rot, __global const float* idx,
                            __global kv_t* kv_lat, __global float* kv_lat_scale, __global kv_t* k_rot,
                            __global float* k_rot_scale, __global kv_t* index_k, __global float* index_k_scale,
                            uint row, uint kvl, uint rope, uint ihd, uint index) {
    __local float red[RED_LANES];
    const uint r = get_global_id(1);
    store_kv_row(lat + r * kvl, kv_lat, kv_lat_scale, row + r, kvl, red);
    store_kv_row(rot + r * rope, k_rot, k_rot_scale, row + r, rope, red);
    /* no barrier under a condition */
    store_kv_row(idx + r * ihd, index_k, index_k_scale, row + r, index ? ihd : 0, red);
}

/* The keys token row r of `rows` attends: n (the key list's length) capped by its causal keys, n_total - (rows - 1 - r)
 * (the last row's: every key). A row past the launch's rows (a sequence's own launch at a global offset, its cache's
 * last row: `Launch.at_row`) attends all n. */
INLINE uint row_keys(uint n, uint n_total, uint r, uint rows) {
    return r < rows ? min(n, n_total - (rows - 1 - r)) : n;
}

/* Absorbed MLA attention of one query token, in two launches: these scores, then `mla_decode_values`, over n keys:
 * key j is keys[j] when use_keys (the indexer's choice, `topk_select`'s chosen list), else j (every key).
 * scores[h, j] = (q_lat[h] . kv_lat[t] + q_rot[h] . k_rot[t]) * scale for t = key j.
 * q_lat [nh, kvl], q_rot [nh, rope], kv_lat [T, kvl], k_rot [T, rope] (fp8: times their row scales).
 * One work-item per key and every get_global_size(1)-th head: global (n, 1) on CPUs (an item reads its key once for
 * every head), (n, nh) on GPUs (a head's dot per item: the heads in parallel). Several consecutive query tokens:
 * global dimension 2 counts them; token r reads its queries, its key list (keys + r * n) and its scores' rows from
 * row r of each ([rows, nh, ...]) and attends `row_keys` keys (n_total: the keys in the cache). */
__kernel void mla_decode_scores(__global const float* q_lat, __global const float* q_rot,
                                __global const kv_t* kv_lat, __global const float* kv_lat_scale,
                                __global const kv_t* k_rot, __global const float* k_rot_scale,
                                __global const uint* keys, uint use_keys, __global float* scores, uint nh,
                                uint n, uint n_total, uint kvl, uint rope, float scale) {
    const uint j = get_global_id(0), r = get_global_id(2), count = row_keys(n, n_total, r, get_global_size(2));
    if (j >= count) return;
    keys += r * n;
    q_lat += (ulong)r * nh * kvl;
    q_rot += (ulong)r * nh * rope;
    scores += (ulong)r * nh * n;
    const ulong t = use_keys ? keys[j] : j;
    const __global kv_t* kl = kv_lat + t * kvl;
    const __global kv_t* kr = k_rot + t * rope;
    if (use_keys && j + 1 < count) {  /* the next item's key (the chosen rows are scattered: no hardware prefetch) */
        const ulong next = keys[j + 1];
        for (uint i = 0; i < kvl; i += KV_LINE) PREFETCH(kv_lat + next * kvl + i);
        for (uint i = 0; i < rope; i += KV_LINE) PREFETCH(k_rot + next * rope + i);
    }
    const uint lat8 = kvl / 8, rope8 = rope / 8;
    for (uint h = get_global_id(1); h < nh; h += get_global_size(1)) {
        const __global float* ql = q_lat + (ulong)h * kvl;
        const __global float* qr = q_rot + (ulong)h * rope;
        float8 acc = (float8)(0.0f);
        for (uint i = 0; i < lat8; i++) acc += LOAD_F8(i, ql) * LOAD_KV8(i, kl);
#if KV_SCALED  /* the two parts have scales of their own */
        float dot_ = hsum8(acc);
        for (uint i = lat8 * 8; i < kvl; i++) dot_ += ql[i] * KV_AT(kl, i);
        acc = (float8)(0.0f);
        for (uint i = 0; i < rope8; i++) acc += LOAD_F8(i, qr) * LOAD_KV8(i, kr);
        float rot = hsum8(acc);
        for (uint i = rope8 * 8; i < rope; i++) rot += qr[i] * KV_AT(kr, i);
        dot_ = dot_ * kv_lat_scale[t] + rot * k_rot_scale[t];
#else
        for (uint i = 0; i < rope8; i++) acc += LOAD_F8(i, qr) * LOAD_KV8(i, kr);
        float dot_ = hsum8(acc);
        for (uint i = lat8 * 8; i < kvl; i++) dot_ += ql[i] * KV_AT(kl, i);
        for (uint i = rope8 * 8; i < rope; i++) dot_ += qr[i] * KV_AT(kr, i);
#endif
        scores[(ulong)h * n + j] = dot_ * scale;
    }
}

/* out[h] = softmax(scores[h]) @ kv_lat over the n keys of `mla_decode_scores` (keys, use_keys as there), one
 * work-group (RED_LANES items) per head: the row's maximum and sum (the probabilities replace the scores in
 * place), then each item owns groups of VALUE_COLS latent columns. Past index_topk keys of context the indexer's
 * choice keeps both launches at index_topk keys. With `quantize`, also out's int8 codes, scales and code sums per
 * head (common.cl; kvl a multiple of 64). scores [nh, n], kv_lat [T, kvl]. Several consecutive query tokens: the
 * work-groups of token r (global dimension 1) read its `row_keys` keys (keys + r * n) and its rows of scores and
 * out (h counting on over the tokens' heads). Global (nh * RED_LANES, tokens). */
__kernel void mla_decode_values(__global float* scores, __global const kv_t* kv_lat,
                                __global const float* kv_lat_scale, __global float* out, uint n, uint n_total,
                                uint kvl, uint quantize, __global char* q, __global float* qs, __global int* qsum,
                                __global const uint* keys, uint use_keys) {
    __local float red[RED_LANES];
    const uint l = get_local_id(0), r = get_global_id(1), stride = n;
    const uint h = r * get_num_groups(0) + get_group_id(0);
    keys += r * stride;
    n = row_keys(n, n_total, r, get_global_size(1));
    __global float* p = scores + (ulong)h * stride;
    const uint n8 = n / 8;  /* chunks of 8 keys: vector exp (scalar exp per key cost more than the sums) */
    float8 m8 = (float8)(-INFINITY);
    for (uint c = l; c < n8; c += RED_LANES) m8 = fmax(m8, LOAD_F8(c, p));
    const float4 m4 = fmax(m8.lo, m8.hi);
    float m = fmax_(fmax_(m4.x, m4.y), fmax_(m4.z, m4.w));
    for (uint j = 8 * n8 + l; j < n; j += RED_LANES) m = fmax_(m, p[j]);
    m = group_max(m, red);
    float8 sum8 = (float8)(0.0f);
    for (uint c = l; c < n8; c += RED_LANES) {
        const float8 e = exp(LOAD_F8(c, p) - m);
        vstore8(e, c, p);
        sum8 += e;
    }
    float sum = hsum8(sum8);
    for (uint j = 8 * n8 + l; j < n; j += RED_LANES) {
        const float e = exp(p[j] - m);
        p[j] = e;
        sum += e;
    }
    sum = group_sum(sum, red);
    barrier(CLK_GLOBAL_MEM_FENCE);  /* every item's probabilities are visible to the whole group */
    __global float* o = out + (ulong)h * kvl;
    /* CPUs: an item owns 32 columns, per key one probability load for four vector sums (a work-group runs on one
     * core, so fewer, longer items cost less than many short ones); GPUs: one column, the group's loads coalesce */
    for (uint i0 = VALUE_COLS * l; i0 < kvl; i0 += VALUE_COLS * RED_LANES) {
        if (VALUE_COLS == 32 && i0 + 32 <= kvl) {
            float8 a0 = (float8)(0.0f), a1 = a0, a2 = a0, a3 = a0;
            const __global kv_t* kv = kv_lat + i0;
            for (uint j = 0; j < n; j++) {
                const ulong t = use_keys ? keys[j] : j;
                const float pj = p[j] * ROW_SCALE(kv_lat_scale, t);
                const __global kv_t* row = kv + t * kvl;
                a0 += pj * LOAD_KV8(0, row);
                a1 += pj * LOAD_KV8(1, row);
                a2 += pj * LOAD_KV8(2, row);
                a3 += pj * LOAD_KV8(3, row);
            }
            vstore8(a0 / sum, 0, o + i0);
            vstore8(a1 / sum, 1, o + i0);
            vstore8(a2 / sum, 2, o + i0);
            vstore8(a3 / sum, 3, o + i0);
        } else {
            for (uint i = i0; i < min(i0 + VALUE_COLS, kvl); i++) {
                float acc = 0.0f;
                for (uint j = 0; j < n; j++) {
                    const ulong t = use_keys ? keys[j] : j;
                    acc += p[j] * ROW_SCALE(kv_lat_scale, t) * KV_AT(kv_lat, t * kvl + i);
                }
                o[i] = acc / sum;
            }
        }
    }
    if (!quantize) return;
    barrier(CLK_GLOBAL_MEM_FENCE);  /* a block is read by another item than the ones that wrote it */
    const uint nb = kvl / 64;
    for (uint b = l; b < nb; b += RED_LANES) quantize_block(o + 64 * b, q + 2 * h * kvl + 128 * b, qs + h * nb + b,
                                                            qsum + h * nb + b);
}

/* DSA indexer scores: out[s, t] = sum_h (w[s, h] * w_scale) * relu(q[s, h] . k[t] * scale); q [S, nh, d],
 * k [T, d] (fp8: times k_scale[t]), w [S, nh] (w_scale: the decode step applies the head weights' nh^-1/2 here,
 * rounded as the model does). Heads go 8 at a time: each 8 columns of the key are loaded once for the 8 heads'
 * sums, which are then reduced together (a transpose-add to one vector of 8 dots) instead of one horizontal sum per
 * head; the heads past the last 8 one at a time. Global (T, S). */
INLINE float8 dots8(float8 a0, float8 a1, float8 a2, float8 a3, float8 a4, float8 a5, float8 a6, float8 a7) {
    const float8 b0 = (float8)(a0.lo + a0.hi, a1.lo + a1.hi), b1 = (float8)(a2.lo + a2.hi, a3.lo + a3.hi);
    const float8 b2 = (float8)(a4.lo + a4.hi, a5.lo + a5.hi), b3 = (float8)(a6.lo + a6.hi, a7.lo + a7.hi);
    const float8 c0 = (float8)(b0.even + b0.odd, b1.even + b1.odd), c1 = (float8)(b2.even + b2.odd, b3.even + b3.odd);
    return (float8)(c0.even + c0.odd, c1.even + c1.odd);  /* (sum a0, sum a1, ..., sum a7) */
}

/* The index score of key t against row qs's heads (qs [nh, d], ws [nh]): index_scores' and index_scores_listed's
 * arithmetic, one function so that the two give the same float for a key. */
INLINE float index_score(const __global float* qs, const __global kv_t* k, const __global float* k_scale,
                         const __global float* ws, uint t, uint nh, uint d, float scale, float w_scale) {
    const __global kv_t* kt = k + (ulong)t * d;
    const float key_scale = scale * ROW_SCALE(k_scale, t);
    const uint d8 = d / 8;  /* 8-wide: one AVX2 register per load on CPUs */
    float total = 0.0f;
    uint h = 0;
    for (; h + 8 <= nh; h += 8) {
        const __global float* qh = qs + (ulong)h * d;
        float8 a0 = (float8)(0.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (uint j = 0; j < d8; j++) {
            const float8 kv = LOAD_KV8(j, kt);
            a0 += LOAD_F8(j, qh) * kv;
            a1 += LOAD_F8(j, qh + d) * kv;
            a2 += LOAD_F8(j, qh + 2 * d) * kv;
            a3 += LOAD_F8(j, qh + 3 * d) * kv;
            a4 += LOAD_F8(j, qh + 4 * d) * kv;
            a5 += LOAD_F8(j, qh + 5 * d) * kv;
            a6 += LOAD_F8(j, qh + 6 * d) * kv;
            a7 += LOAD_F8(j, qh + 7 * d) * kv;
        }
        float8 dots = dots8(a0, a1, a2, a3, a4, a5, a6, a7);
        for (uint j = d8 * 8; j < d; j++) {
            const float kj = KV_AT(kt, j);
            dots += (float8)(qh[j], qh[d + j], qh[2 * d + j], qh[3 * d + j], qh[4 * d + j], qh[5 * d + j],
                             qh[6 * d + j], qh[7 * d + j]) * kj;
        }
        total += hsum8((LOAD_F8(0, ws + h) * w_scale) * fmax(dots * key_scale, (float8)(0.0f)));
    }
    for (; h < nh; h++) {
        const __global float* qh = qs + (ulong)h * d;
        float8 acc = (float8)(0.0f);
        for (uint j = 0; j < d8; j++) acc += LOAD_F8(j, qh) * LOAD_KV8(j, kt);
        float dot_ = hsum8(acc);
        for (uint j = d8 * 8; j < d; j++) dot_ += qh[j] * KV_AT(kt, j);
        total += (ws[h] * w_scale) * (fmax_(dot_ * key_scale, 0.0f));
    }
    return total;
}

__kernel void index_scores(__global const float* q, __global const kv_t* k, __global const float* k_scale,
                           __global const float* w, __global float* out, uint nh, uint d, uint n_keys, float scale,
                           float w_scale) {
    const uint t = get_global_id(0), s = get_global_id(1);
    if (t >= n_keys) return;
    out[(ulong)s * n_keys + t] = index_score(q + (ulong)s * nh * d, k, k_scale, w + (ulong)s * nh, t, nh, d, scale,
                                             w_scale);
}

/* index_scores of the keys listed for row s (index_candidates' lists: listed[s, i] for i < count[s]) into
 * out[s, i], bit for bit the scores index_scores gives them: the work-items stride over the list (the count is
 * known only here; items past it idle). Global (any multiple of the work-group, S). */
__kernel void index_scores_listed(__global const float* q, __global const kv_t* k, __global const float* k_scale,
                                  __global const float* w, __global const uint* listed, __global const uint* count,
                                  __global float* out, uint nh, uint d, uint n_keys, float scale, float w_scale) {
    const uint s = get_global_id(1), n = count[s], stride = get_global_size(0);
    const __global uint* keys = listed + (ulong)s * n_keys;
    for (uint i = get_global_id(0); i < n; i += stride) {
        if (i + stride < n) {  /* this item's next key (the listed rows are scattered: no hardware prefetch) */
            const ulong next = keys[i + stride];
            for (uint j = 0; j < d; j += KV_LINE) PREFETCH(k + next * d + j);
        }
        out[(ulong)s * n_keys + i] = index_score(q + (ulong)s * nh * d, k, k_scale, w + (ulong)s * nh, keys[i], nh,
                                                 d, scale, w_scale);
    }
}

/* The shadows (kv_cache.encode_index_shadow) of the indexer keys at rows row .. row + n_rows - 1 of index_k, as the
 * kernels read them (times an f16 or fp8 row's scale): int8 codes into shadow's blocks [d, SHADOW_BLOCK] and one
 * scale per key. One work-item per key. Global (n_rows). */
__kernel void index_shadow_rows(__global const kv_t* index_k, __global const float* index_k_scale,
                                __global char* shadow, __global float* shadow_scale, uint row, uint d) {
    const uint t = row + get_global_id(0);
    const __global kv_t* kt = index_k + (ulong)t * d;
    const float row_scale = ROW_SCALE(index_k_scale, t);
    float amax = 0.0f;
    for (uint j = 0; j < d; j++) amax = fmax(amax, fabs(KV_AT(kt, j) * row_scale));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    __global char* codes = shadow + (ulong)(t / SHADOW_BLOCK) * d * SHADOW_BLOCK + t % SHADOW_BLOCK;
    for (uint j = 0; j < d; j++)
        codes[j * SHADOW_BLOCK] = (char)clamp(rint(KV_AT(kt, j) * row_scale * inverse), -127.0f, 127.0f);
    shadow_scale[t] = amax > 0.0f ? amax / 127.0f : 0.0f;
}
