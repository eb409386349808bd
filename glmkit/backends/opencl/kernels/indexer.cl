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
__kernel void topk_select(__global const float* scores, __global const uchar* allowed, __global uchar* selected,
                          __global uint* chosen, uint n_keys, uint k, uint n_rows) {
    const uint s = get_global_id(0);
    if (s >= n_rows) return;
    const __global float* sc = scores + (ulong)s * n_keys;
    const __global uchar* al = allowed + (ulong)s * n_keys;
    __global uchar* sel = selected + (ulong)s * n_keys;
    __global uint* ch = chosen + (ulong)s * k;
    uint prefix = 0, known = 0, need = k;  /* the need-th largest key among those whose `known` bits are prefix's */
    uint hist[256];
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (uint b = 0; b < 256; b++) hist[b] = 0;
        for (uint t = 0; t < n_keys; t++) {
            const uint key = float_key(sc[t]);
            if (al[t] && (key & known) == prefix) hist[(key >> shift) & 255u]++;
        }
        if (shift == 24) {  /* the first pass counts every allowed key: are there more than k? */
            uint n_allowed = 0;
            for (uint b = 0; b < 256; b++) n_allowed += hist[b];
            if (n_allowed <= k) {
                mark_keys(sc, al, sel, ch, 0, n_keys, 0, 0, 0);
                return;
            }
        }
        uint digit = 255, above = 0;
        while (above + hist[digit] < need) above += hist[digit--];
        need -= above;
        prefix |= digit << shift;
        known |= 255u << shift;
    }
    /* the keys above the k-th are those above it at some pass (k - need of them): the first `need` equal to it
     * complete the k */
    mark_keys(sc, al, sel, ch, 0, n_keys, prefix, need, 0);
}

/* topk_select with one work-group (RED_LANES items) per row, for GPUs, where the single work-item's serial passes
 * cost ~0.3 ms at 300 keys (H200): the same radix select, each pass's count summed over the group (counts are
 * exact in float below 2^24 keys); then item l marks the keys [l * chunk, (l + 1) * chunk), the threshold's ties
 * going to the lowest indices through the tie counts of the items before it, and lists its keys in chosen after
 * those of the items before it. Global (S * RED_LANES). */
__kernel void topk_select_group(__global const float* scores, __global const uchar* allowed,
                                __global uchar* selected, __global uint* chosen, uint n_keys, uint k, uint n_rows) {
    __local float red[RED_LANES];
    __local uint tie_counts[RED_LANES];
    __local uint take_counts[RED_LANES];
    const uint l = get_local_id(0), s = get_group_id(0);
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
