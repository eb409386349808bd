/* DSA indexer: the top-k selection over the indexer's scores (the scores: kv.cl's `index_scores`). */

/* Order-preserving map of a float to uint (larger float -> larger key); NaN never occurs here. -0 maps to +0's
 * key: the two compare equal (a tie, lowest index first, as NumPy's selection), and an index score is -0 where
 * every head's ReLU is off and a negative head weight multiplies it. */
INLINE uint float_key(float f) {
    const uint b = as_uint(f == 0.0f ? 0.0f : f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* Marks the keys [t0, t1) of a row: sel[t] = 1 for the allowed keys above `prefix` (a key of float_key) and for
 * the first `ties` allowed keys equal to it, 0 for the others; the marked keys are listed in ch from ch[n] on.
 * prefix 0 (below every float's key) marks every allowed key. */
INLINE void mark_keys(const __global float* sc, const __global uchar* al, __global uchar* sel, __global uint* ch,
                      uint t0, uint t1, uint prefix, uint ties, uint n) {
    for (uint t = t0; t < t1; t++) {
        const uint key = float_key(sc[t]);
        uchar take = 0;
        if (al[t] && key > prefix) take = 1;
        else if (al[t] && key == prefix && ties > 0) { take = 1; ties--; }
        sel[t] = take;
        if (take) ch[n++] = t;
    }
}

/* selected[s, t] = 1 for the k largest scores among the allowed keys of row s (all of them when fewer
 * than k are allowed); ties at the threshold go to the lowest indices. chosen[s, :] lists the selected keys in
 * ascending order (min(k, allowed) of them: the decode step's attention reads only those keys). A radix select
 * over the key's 4 bytes, most significant first (a 256-bin histogram of the keys still in the running per pass; the
 * first also counts the allowed keys), finds the k-th largest key, then one pass marks. One work-item per row.
 * Global (S). */
/* The k-th largest float_key among the allowed scores sc[0, n) (al 0: all allowed), its top `bits` bits (8, 16, 24
 * or 32; the rest 0) in *prefix, and in *need how many keys with those top bits complete the k (the larger ones being
 * k - need). A radix select over the key's bytes, most significant first (a 256-bin histogram of the keys still in
 * the running per pass). Returns 0, leaving *prefix 0, where at most k keys are allowed. */
INLINE int kth_key(const __global float* sc, const __global uchar* al, uint n, uint k, int bits, uint* prefix,
                   uint* need) {
    uint known = 0, hist[256];
    *prefix = 0;
    *need = k;  /* the need-th largest key among those whose `known` bits are prefix's */
    for (int shift = 24; shift >= 32 - bits; shift -= 8) {
        for (uint b = 0; b < 256; b++) hist[b] = 0;
        for (uint t = 0; t < n; t++) {
            const uint key = float_key(sc[t]);
            if ((al == 0 || al[t]) && (key & known) == *prefix) hist[(key >> shift) & 255u]++;
        }
        if (shift == 24) {  /* the first pass counts every allowed key: are there more than k? */
            uint n_allowed = 0;
            for (uint b = 0; b < 256; b++) n_allowed += hist[b];
            if (n_allowed <= k) return 0;
        }
        uint digit = 255, above = 0;
        while (above + hist[digit] < *need) above += hist[digit--];
        *need -= above;
        *prefix |= digit << shift;
        known |= 255u << shift;
    }
    return 1;
}

__kernel void topk_select(__global const float* scores, __global const uchar* allowed, __global uchar* selected,
                          __global uint* chosen, uint n_keys, uint k, uint n_rows) {
    const uint s = get_global_id(0);
    if (s >= n_rows) return;
    const __global float* sc = scores + (ulong)s * n_keys;
    const __global uchar* al = allowed + (ulong)s * n_keys;
    uint prefix, need;
    if (!kth_key(sc, al, n_keys, k, 32, &prefix, &need))
        need = 0;  /* prefix 0: every allowed key */
    /* the keys above the k-th are those above it at some pass (k - need of them): the first `need` equal to it
     * complete the k */
    mark_keys(sc, al, selected + (ulong)s * n_keys, chosen + (ulong)s * k, 0, n_keys, prefix, need, 0);
}

/* topk_select with one work-group (RED_LANES items) per row, for GPUs, where the single work-item's serial passes
 * cost ~0.3 ms at 300 keys (H200): the same radix select, each pass's count summed over the group (counts are
 * exact in float below 2^24 keys); then item l marks the keys [l * chunk, (l + 1) * chunk), the threshold's ties
 * going to the lowest indices through the tie counts of the items before it, and lists its keys in chosen after
 * those of the items before it. Global (RED_LANES, S), work-groups (RED_LANES, 1). */
__kernel void topk_select_group(__global const float* scores, __global const uchar* allowed,
                                __global uchar* selected, __global uint* chosen, uint n_keys, uint k, uint n_rows) {
    __local float red[RED_LANES];
    __local uint tie_counts[RED_LANES];
    __local uint take_counts[RED_LANES];
    const uint l = get_local_id(0), s = get_global_id(1);
    const __global float* sc = scores + (ulong)s * n_keys;
    const __global uchar* al = allowed + (ulong)s * n_keys;
    __global uchar* sel = selected + (ulong)s * n_keys;
    __global uint* ch = chosen + (ulong)s * k;
    const uint chunk = (n_keys + RED_LANES - 1) / RED_LANES;
    const uint t0 = min(l * chunk, n_keys), t1 = min(t0 + chunk, n_keys);
    uint mine = 0;
    for (uint t = t0; t < t1; t++) mine += al[t] ? 1u : 0u;
    take_counts[l] = mine;
    if ((uint)group_sum((float)mine, red) <= k) {  /* its barriers also publish take_counts */
        uint n = 0;
        for (uint j = 0; j < l; j++) n += take_counts[j];
        mark_keys(sc, al, sel, ch, t0, t1, 0, 0, n);
        return;
    }
    uint prefix = 0;
    for (int bit = 31; bit >= 0; bit--) {
        const uint cand = prefix | (1u << bit);
        uint count = 0;
        for (uint t = l; t < n_keys; t += RED_LANES) count += (al[t] && float_key(sc[t]) >= cand) ? 1u : 0u;
        if ((uint)group_sum((float)count, red) >= k) prefix = cand;
    }
    uint above = 0, ties_here = 0;
    for (uint t = t0; t < t1; t++) {
        const uint key = float_key(sc[t]);
        above += (al[t] && key > prefix) ? 1u : 0u;
        ties_here += (al[t] && key == prefix) ? 1u : 0u;
    }
    tie_counts[l] = ties_here;
    uint ties = k - (uint)group_sum((float)above, red);  /* group_sum's barriers also publish tie_counts */
    for (uint j = 0; j < l; j++) ties = ties > tie_counts[j] ? ties - tie_counts[j] : 0u;
    take_counts[l] = above + min(ties, ties_here);  /* (its allowed counts were read only on the return above) */
    barrier(CLK_LOCAL_MEM_FENCE);
    uint n = 0;
    for (uint j = 0; j < l; j++) n += take_counts[j];
    mark_keys(sc, al, sel, ch, t0, t1, prefix, ties, n);
}

/* ---- the decode step's exact two-stage selection (DESIGN section "DSA indexer": the shadow bound) ---- */

#if SHADOW_BLOCK != 8
#error "index_shadow_scores takes a block of keys as one float8"
#endif
#define MAX_INDEX_HEADS 64  /* index_shadow_scores' heads (decode_graph.MAX_INDEX_HEADS) */

/* Block b's stage-1 bounds into upper (every key's) and, over the keys row s may choose (al), their largest lower bound
 * into block_lower and largest upper bound into block_upper (-inf for both where none may). */
INLINE void shadow_block_out(float8 hi, float8 lo, uint b, uint n_keys, const __global uchar* al, __global float* out,
                             __global float* block_lower, __global float* block_upper) {
    float8 mine_hi, mine_lo;  /* the allowed keys' bounds, -inf for the others */
    if (b * 8 + 8 <= n_keys) {
        STORE_F8(b, out, hi);
        const int8 take = convert_int8(LOAD_U8(b, al)) != (int8)(0);
        mine_hi = select((float8)(-INFINITY), hi, take);
        mine_lo = select((float8)(-INFINITY), lo, take);
    } else {  /* the last block, partly past the keys */
        const float his[8] = {hi.s0, hi.s1, hi.s2, hi.s3, hi.s4, hi.s5, hi.s6, hi.s7};
        const float los[8] = {lo.s0, lo.s1, lo.s2, lo.s3, lo.s4, lo.s5, lo.s6, lo.s7};
        float mh[8], ml[8];
        for (uint i = 0; i < 8; i++) {
            const uint t = b * 8 + i;
            const int take = t < n_keys && al[t];
            if (t < n_keys) out[t] = his[i];
            mh[i] = take ? his[i] : -INFINITY;
            ml[i] = take ? los[i] : -INFINITY;
        }
        mine_hi = (float8)(mh[0], mh[1], mh[2], mh[3], mh[4], mh[5], mh[6], mh[7]);
        mine_lo = (float8)(ml[0], ml[1], ml[2], ml[3], ml[4], ml[5], ml[6], ml[7]);
    }
    const float4 h4 = fmax(mine_hi.lo, mine_hi.hi), l4 = fmax(mine_lo.lo, mine_lo.hi);
    const float2 h2 = fmax(h4.lo, h4.hi), l2 = fmax(l4.lo, l4.hi);
    block_upper[b] = fmax(h2.x, h2.y);
    block_lower[b] = fmax(l2.x, l2.y);
}

/* |x|_1 of x [d]. */
INLINE float abs_sum(const __global float* x, uint d) {
    float8 acc = (float8)(0.0f);
    uint j = 0;
    for (; j + 8 <= d; j += 8) acc += fabs(vload8(0, x + j));
    float sum = hsum8(acc);
    for (; j < d; j++) sum += fabs(x[j]);
    return sum;
}

/* One head's part of both bounds: with a = its stage-1 dot times the key's scale and e = its error bound, the exact
 * ReLU lies in [relu(a - e), relu(a + e)] (ReLU is monotone); weight w >= 0 takes the ends in order, w < 0 swapped. */
#define SHADOW_HEAD(w, a, e, hi, lo)                                                     \
    do {                                                                                 \
        const float8 up_ = fmax((a) + (e), 0.0f), down_ = fmax((a) - (e), 0.0f);         \
        hi += (w) * ((w) >= 0.0f ? up_ : down_);                                         \
        lo += (w) * ((w) >= 0.0f ? down_ : up_);                                         \
    } while (0)

/* Stage 1: bounds of each key's exact score from its shadow (codes c_t in blocks [d, 8], one scale s_t per key:
 * kv_cache.encode_index_shadow). Per head h, a = (s_t scale) q[s, h] . c_t and e = s_t bound |q[s, h]|_1 bound
 * |exact dot - a| (bound: shadow_bound's F times |scale|); upper[s, t] and the lower bound are sum_h W_h times the
 * ends of [relu(a - e), relu(a + e)] (W_h = w[s, h] w_scale). Per block the largest lower and upper bound of the keys
 * row s may choose (block_lower, block_upper; -inf where none may). The heads' |q_h|_1 are taken once per work-group
 * (nh <= MAX_INDEX_HEADS). A work-item takes one block, a lane per key: each code is converted once for 8 heads
 * (docs/BENCHMARKS.md: faster than two blocks of 4 heads). Rows of n_keys keys, of ceil(n_keys / 8) blocks.
 * Global (blocks, S). */
__kernel void index_shadow_scores(__global const float* q, __global const char* shadow,
                                  __global const float* shadow_scale, __global const float* w,
                                  __global const uchar* allowed, __global float* upper, __global float* block_lower,
                                  __global float* block_upper, uint nh, uint d, uint n_keys, float scale, float bound,
                                  float w_scale) {
    const uint b = get_global_id(0), s = get_global_id(1), n_blocks = (n_keys + 7) / 8;
    __local float norms[MAX_INDEX_HEADS];  /* |q_h|_1 of row s's heads, once per work-group */
    for (uint head = get_local_id(0); head < nh; head += get_local_size(0))
        norms[head] = abs_sum(q + ((ulong)s * nh + head) * d, d);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (b >= n_blocks) return;
    const __global uchar* kb = (const __global uchar*)shadow + (ulong)b * d * 8;
    const __global float* qs = q + (ulong)s * nh * d;
    const __global float* ws = w + (ulong)s * nh;
    const float8 scales = LOAD_F8(b, shadow_scale);
    const float8 key_scale = scales * scale, err_scale = scales * bound;
    float8 hi = (float8)(0.0f), lo = hi;
    uint h = 0;
    for (; h + 8 <= nh; h += 8) {
        const __global float* q0 = qs + (ulong)h * d;
        float8 a0 = (float8)(0.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (uint j = 0; j < d; j++) {
            const float8 kv = convert_float8(as_char8(LOAD_U8(j, kb)));
            a0 += q0[j] * kv;
            a1 += q0[d + j] * kv;
            a2 += q0[2 * d + j] * kv;
            a3 += q0[3 * d + j] * kv;
            a4 += q0[4 * d + j] * kv;
            a5 += q0[5 * d + j] * kv;
            a6 += q0[6 * d + j] * kv;
            a7 += q0[7 * d + j] * kv;
        }
        SHADOW_HEAD(ws[h] * w_scale, a0 * key_scale, norms[h] * err_scale, hi, lo);
        SHADOW_HEAD(ws[h + 1] * w_scale, a1 * key_scale, norms[h + 1] * err_scale, hi, lo);
        SHADOW_HEAD(ws[h + 2] * w_scale, a2 * key_scale, norms[h + 2] * err_scale, hi, lo);
        SHADOW_HEAD(ws[h + 3] * w_scale, a3 * key_scale, norms[h + 3] * err_scale, hi, lo);
        SHADOW_HEAD(ws[h + 4] * w_scale, a4 * key_scale, norms[h + 4] * err_scale, hi, lo);
        SHADOW_HEAD(ws[h + 5] * w_scale, a5 * key_scale, norms[h + 5] * err_scale, hi, lo);
        SHADOW_HEAD(ws[h + 6] * w_scale, a6 * key_scale, norms[h + 6] * err_scale, hi, lo);
        SHADOW_HEAD(ws[h + 7] * w_scale, a7 * key_scale, norms[h + 7] * err_scale, hi, lo);
    }
    for (; h < nh; h++) {
        const __global float* qh = qs + (ulong)h * d;
        float8 acc = (float8)(0.0f);
        for (uint j = 0; j < d; j++) acc += qh[j] * convert_float8(as_char8(LOAD_U8(j, kb)));
        SHADOW_HEAD(ws[h] * w_scale, acc * key_scale, norms[h] * err_scale, hi, lo);
    }
    shadow_block_out(hi, lo, b, n_keys, allowed + (ulong)s * n_keys, upper + (ulong)s * n_keys,
                     block_lower + (ulong)s * n_blocks, block_upper + (ulong)s * n_blocks);
}

/* The smallest float whose float_key has the top 16 bits of `key` (NaN's keys never occur: -inf below them). */
INLINE float key_floor16(uint key) {
    key &= 0xffff0000u;
    const float f = as_float((key & 0x80000000u) ? key & 0x7fffffffu : ~key);
    return isnan(f) ? -INFINITY : f;
}

/* Stage 2's keys for row s: every allowed key whose stage-1 upper bound reaches A, a lower bound of the k-th largest
 * exact score; listed[s, :count[s]] in ascending order. A: below the k-th largest block_lower (each the lower bound
 * of one key of its block), taken to its top 16 bits. Where fewer than k blocks hold allowed keys or more than
 * max_listed keys reach A: every allowed key (then the selection is today's over all keys). One work-item per row.
 * Global (S). */
__kernel void index_candidates(__global const float* upper, __global const float* block_lower,
                               __global const float* block_upper, __global const uchar* allowed, __global uint* listed,
                               __global uint* count, uint n_keys, uint k, uint max_listed, uint n_rows) {
    const uint s = get_global_id(0), n_blocks = (n_keys + 7) / 8;
    if (s >= n_rows) return;
    const __global uchar* al = allowed + (ulong)s * n_keys;
    const __global float* up = upper + (ulong)s * n_keys;
    const __global float* low = block_lower + (ulong)s * n_blocks;
    const __global float* high = block_upper + (ulong)s * n_blocks;
    __global uint* out = listed + (ulong)s * n_keys;
    uint live = 0;  /* blocks with an allowed key; the others' bounds -inf, below every live one's */
    for (uint b = 0; b < n_blocks; b++) live += low[b] != -INFINITY;
    uint n = 0, prefix, need;
    if (live >= k && kth_key(low, 0, n_blocks, k, 16, &prefix, &need)) {
        const float least = key_floor16(prefix);
        for (uint b = 0; b < n_blocks && n <= max_listed; b++) {
            if (high[b] < least) continue;  /* no key of the block reaches it */
            for (uint t = b * 8; t < min(b * 8 + 8, n_keys); t++) {
                if (al[t] && up[t] >= least) {
                    if (n < max_listed) out[n] = t;
                    n++;
                }
            }
        }
        if (n <= max_listed) {
            count[s] = n;
            return;
        }
    }
    n = 0;
    for (uint t = 0; t < n_keys; t++)
        if (al[t]) out[n++] = t;
    count[s] = n;
}

/* The k keys with the largest exact scores among row s's listed keys (index_scores_listed's scores[s, i] of key
 * listed[s, i], i < count[s], ascending keys), ties to the lowest key, into chosen[s, :] in ascending order (all of
 * them where at most k are listed): topk_select's choice over the row's allowed keys. One work-item per row.
 * Global (S). */
__kernel void topk_listed(__global const float* scores, __global const uint* listed, __global const uint* count,
                          __global uint* chosen, uint n_keys, uint k, uint n_rows) {
    const uint s = get_global_id(0);
    if (s >= n_rows) return;
    const __global float* sc = scores + (ulong)s * n_keys;
    const __global uint* keys = listed + (ulong)s * n_keys;
    __global uint* ch = chosen + (ulong)s * k;
    const uint n = count[s];
    uint prefix, ties;
    if (!kth_key(sc, 0, n, k, 32, &prefix, &ties)) ties = 0;
    uint m = 0;
    for (uint i = 0; i < n; i++) {
        const uint key = float_key(sc[i]);
        if (key > prefix || (key == prefix && ties > 0)) {
            ties -= key == prefix;
            ch[m++] = keys[i];
        }
    }
}
