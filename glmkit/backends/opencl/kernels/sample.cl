/* Sampling the next token on the device (temperature, top-k, top-p, one host-drawn uniform), so that pipelined
 * decoding queues the next forward before the host has seen this token. The arithmetic follows the host's
 * `Sampler` (glmkit/generate/sampling.py) in float64: p = exp(z - max z) / sum with z = logits / T over the top-k
 * (or every token), the nucleus as the shortest prefix of the descending order (ties: lower index first) whose
 * running sum reaches top_p, then the first token in index order whose normalized running sum exceeds u. Sums
 * may associate differently from NumPy's (float64 rounding, ~1e-16 relative): wherever a decision lies within
 * SAMPLE_TOLERANCE of such a sum (u at a cdf boundary, top_p at a running sum), and where the device cannot decide
 * (a tie at the top-k boundary, sums that are not finite), it sets the row's flag, copies the logits into `held`
 * and leaves the choice to the host, which then draws the same token as a host-only run. Each kernel draws token
 * row `row` of `rows` (glm-serve's batch: logits and held `row * n` on, the token at token[row], the flag at
 * token[rows + row]; one sequence: row 0 of 1). Built only where the device has float64 (cl_khr_fp64). */
#ifdef cl_khr_fp64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable

#define SAMPLE_CANDIDATES 1024  /* the most candidates one draw sorts: top_k + 1 (decode_graph.SAMPLE_CANDIDATES) */
#define SAMPLE_TOLERANCE 1e-9   /* how near a float64 sum a decision is left to the host */

GROUP_SUM(group_sum_f64, double)

/* Hands the draw to the host where out[1] is set (the logits into `held`), and writes token row `row` of `rows`:
 * its token at token[row], whether the host must choose at token[rows + row]. */
INLINE void sample_out(const __global float* logits, uint n, __local const uint* out, __global uint* token,
                       __global float* held, uint row, uint rows) {
    const uint l = get_local_id(0);
    if (out[1]) {
        for (uint t = l; t < n; t += RED_LANES) held[t] = logits[t];
    }
    if (l == 0) {
        token[row] = out[0];
        token[rows + row] = out[1];
    }
}

/* This item's part of the sum of exp(z - max z) (z = logits / T, n of them): over its contiguous chunk of `chunk`
 * tokens, each token's term kept in `weight` (`[n]` float64); *zmax = max z. Every item of the work-group calls it. */
INLINE double chunk_weights(const __global float* logits, uint n, double temperature, uint chunk,
                            __global double* weight, __local float* best, double* zmax) {
    float m = -INFINITY;
    for (uint t = get_local_id(0); t < n; t += RED_LANES) m = fmax_(m, logits[t]);
    *zmax = (double)group_max(m, best) / temperature;
    const uint t0 = min((uint)get_local_id(0) * chunk, n), t1 = min(t0 + chunk, n);
    double s = 0.0;
    for (uint t = t0; t < t1; t++) {
        const double w = exp((double)logits[t] / temperature - *zmax);
        weight[t] = w;
        s += w;
    }
    return s;
}

/* Item 0's draw in index order: out[0] = the first kept token t whose running weight (`weight[t]`) exceeds u times
 * the kept tokens' total, red[j] being item j's chunk's kept weight (chunks of `chunk` tokens); kept: every token
 * where `all`, else those whose float_key lies above `key` or at it up to token `last_tie`. out[1] = 1 where the
 * host must choose: the total not finite, a decision within SAMPLE_TOLERANCE of a sum, or a rescan of the chunk
 * that falls short of its sum (a rounding the host settles). */
INLINE void draw_in_order(const __global float* logits, __global const double* weight, uint n, uint chunk,
                          __local const double* red, double u, bool all, uint key, uint last_tie,
                          __local uint* out) {
    out[1] = 1;
    double mass = 0.0;
    for (uint j = 0; j < RED_LANES; j++) mass += red[j];
    const double aim = u * mass, tol = SAMPLE_TOLERANCE * mass;
    double acc = 0.0;
    uint j = 0;
    while (isfinite(mass) && j < RED_LANES && acc + red[j] <= aim) acc += red[j++];
    for (uint t = j * chunk; isfinite(mass) && j < RED_LANES && t < min(j * chunk + chunk, n); t++) {
        const uint k = all ? 0u : float_key(logits[t]);
        if (!all && !(k > key || (k == key && t <= last_tie))) continue;
        const double next = acc + weight[t];
        if (next > aim) {
            out[0] = t;
            out[1] = (next - aim < tol || aim - acc < tol) ? 1u : 0u;
            break;
        }
        acc = next;
    }
}

/* The whole vocabulary (no top-k, no top-p): the token = the first token t whose running sum of exp(z - max z)
 * exceeds u times their total, the flag = 1 where the host must choose (`held` then holds the logits). Each item
 * sums a contiguous chunk (each token's term kept in `weight`, `[n]` float64); item 0 finds the chunk the target
 * falls in and scans it. One work-group. */
__kernel void sample_whole(__global const float* logits, uint n, double temperature, double u,
                           __global double* weight, __global uint* token, __global float* held, uint row,
                           uint rows) {
    __local float best[RED_LANES];
    __local double red[RED_LANES];
    __local uint out[2];
    const uint l = get_local_id(0), chunk = (n + RED_LANES - 1) / RED_LANES;
    logits += (ulong)row * n;
    held += (ulong)row * n;
    double zmax;
    red[l] = chunk_weights(logits, n, temperature, chunk, weight, best, &zmax);
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);  /* item 0 rescans another item's chunk */
    if (l == 0) {
        out[0] = 0;  /* a valid id for the next lookup where the host decides */
        draw_in_order(logits, weight, n, chunk, red, u, true, 0u, 0u, out);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    sample_out(logits, n, out, token, held, row, rows);
}

/* The token drawn among the top_k (with top-p, its nucleus), the flag = 1 where the host must choose
 * (see above; `held` then holds the logits). cand: the top_k + 1 largest logits in ascending token order
 * (topk_select's `chosen`; the extra one tells a tie at the top-k boundary); n_sorted: the power of two >= top_k + 1
 * the bitonic sort runs over. u: the host's uniform in [0, 1). One work-group. */
__kernel void sample_token(__global const float* logits, uint n, __global const uint* cand, uint n_sorted,
                           uint top_k, double temperature, double top_p, double u, __global uint* token,
                           __global float* held, uint row, uint rows) {
    __local ulong keys[SAMPLE_CANDIDATES];  /* logit's float_key << 32 | (n_cand - 1 - position in cand) */
    __local double p[SAMPLE_CANDIDATES];    /* per position in cand: exp(z - max z), then the running cdf */
    __local uint out[2];
    const uint l = get_local_id(0), n_cand = top_k + 1;
    logits += (ulong)row * n;
    held += (ulong)row * n;
    cand += (ulong)row * n_cand;  /* topk_select's row `row` */
    for (uint c = l; c < n_sorted; c += RED_LANES)
        keys[c] = c < n_cand ? ((ulong)float_key(logits[cand[c]]) << 32) | (ulong)(n_cand - 1 - c) : 0ul;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint size = 2; size <= n_sorted; size <<= 1) {  /* bitonic sort, descending */
        for (uint stride = size / 2; stride > 0; stride >>= 1) {
            for (uint i = l; i < n_sorted / 2; i += RED_LANES) {
                const uint lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                const ulong a = keys[lo], b = keys[hi];
                if ((lo & size) == 0 ? a < b : a > b) {
                    keys[lo] = b;
                    keys[hi] = a;
                }
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
    }
    const double zmax = (double)logits[cand[n_cand - 1 - (uint)(keys[0] & 0xffffffffu)]] / temperature;
    for (uint c = l; c < n_cand; c += RED_LANES) p[c] = exp((double)logits[cand[c]] / temperature - zmax);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (l == 0) {
        out[0] = cand[n_cand - 1 - (uint)(keys[0] & 0xffffffffu)];  /* a valid id for the next lookup */
        out[1] = 1;
        double z = 0.0;
        for (uint r = 0; r < top_k; r++) z += p[n_cand - 1 - (uint)(keys[r] & 0xffffffffu)];
        uint cut = top_k - 1;  /* the last rank kept */
        /* a tie at the top-k boundary is the host's to break, unless at -inf (logits a constraint masked): those
         * tokens have no probability, kept or not */
        bool ok = isfinite(z) && z > 0.0 && ((keys[top_k - 1] >> 32) != (keys[top_k] >> 32) ||
                                             logits[cand[n_cand - 1 - (uint)(keys[top_k - 1] & 0xffffffffu)]] ==
                                                 -INFINITY);
        if (ok && top_p < 1.0) {
            double cum = 0.0;
            bool reached = false;
            for (uint r = 0; r < top_k && !reached; r++) {
                const double before = cum;
                cum += p[n_cand - 1 - (uint)(keys[r] & 0xffffffffu)] / z;
                if (cum >= top_p) {
                    reached = true;
                    cut = r;
                    ok = cum - top_p >= SAMPLE_TOLERANCE && top_p - before >= SAMPLE_TOLERANCE;
                }
            }
            if (!reached)  /* top_p is within rounding of the top-k's whole mass */
                ok = top_p - cum >= SAMPLE_TOLERANCE;
        }
        if (ok) {
            for (uint r = cut + 1; r < n_cand; r++) p[n_cand - 1 - (uint)(keys[r] & 0xffffffffu)] = 0.0;
            double mass = 1.0;  /* the kept mass, renormalized as the host does after top-p */
            if (top_p < 1.0) {
                mass = 0.0;
                for (uint c = 0; c < n_cand; c++) mass += p[c] / z;
            }
            double cdf = 0.0;
            for (uint c = 0; c < n_cand; c++) {
                cdf += p[c] / z / mass;
                p[c] = cdf;
            }
            const double last = cdf;
            double before = 0.0;
            for (uint c = 0; c < n_cand; c++) {
                const double at = p[c] / last;
                if (at > u) {
                    out[0] = cand[c];
                    out[1] = (at - u < SAMPLE_TOLERANCE || u - before < SAMPLE_TOLERANCE) ? 1u : 0u;
                    break;
                }
                before = at;
            }
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    sample_out(logits, n, out, token, held, row, rows);
}

/* Top-p without top-k, a nucleus of any size: the token drawn, the flag = 1 where the host must choose
 * (`held` then holds the logits). No sort: the nucleus is every token whose key (float_key of its logit) lies above
 * the cut's, and the first tokens tied at the cut's key (lowest index first). The cut is found by a radix select on
 * the key, NUCLEUS_DIGIT bits a pass from the highest: each pass sums exp(z - max z) (kept per token in `weight`,
 * `[n]` float64) by the next digit of the keys that share the bits found so far, and goes down the digits from the
 * largest until the weight above reaches top_p times the total. The draw then scans the kept tokens in index order
 * (draw_in_order). Each item owns a contiguous chunk of the tokens. One work-group. */
#define NUCLEUS_DIGIT 4
#define NUCLEUS_BINS (1 << NUCLEUS_DIGIT)
__kernel void sample_nucleus(__global const float* logits, uint n, double temperature, double top_p, double u,
                             __global double* weight, __global uint* token, __global float* held, uint row,
                             uint rows) {
    __local float best[RED_LANES];
    __local double red[RED_LANES];
    __local double bins[NUCLEUS_BINS * RED_LANES];  /* digit d's weight in item j's chunk at d * RED_LANES + j */
    __local uint ties[RED_LANES];                    /* tokens at the cut's key in item j's chunk */
    __local uint cut[2];                             /* the cut's key (the bits found so far), the last tie kept */
    __local double above_cut;                        /* the weight of the tokens whose keys lie above the cut's */
    __local uint out[2];
    const uint l = get_local_id(0), chunk = (n + RED_LANES - 1) / RED_LANES;
    const uint t0 = min(l * chunk, n), t1 = min(t0 + chunk, n);  /* this item's tokens */
    logits += (ulong)row * n;
    held += (ulong)row * n;
    double zmax;
    const double part = chunk_weights(logits, n, temperature, chunk, weight, best, &zmax);
    barrier(CLK_GLOBAL_MEM_FENCE);  /* item 0 rescans other items' chunks below */
    const double total = group_sum_f64(part, red), target = top_p * total;
    if (l == 0) {
        cut[0] = 0;
        above_cut = 0.0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int shift = 32 - NUCLEUS_DIGIT; shift >= 0; shift -= NUCLEUS_DIGIT) {
        const uint high = shift + NUCLEUS_DIGIT == 32 ? 0u : ~0u << (shift + NUCLEUS_DIGIT), key = cut[0];
        double h[NUCLEUS_BINS];
        for (uint d = 0; d < NUCLEUS_BINS; d++) h[d] = 0.0;
        for (uint t = t0; t < t1; t++) {
            const uint k = float_key(logits[t]);
            if ((k & high) == key) h[(k >> shift) & (NUCLEUS_BINS - 1)] += weight[t];
        }
        for (uint d = 0; d < NUCLEUS_BINS; d++) bins[d * RED_LANES + l] = h[d];
        barrier(CLK_LOCAL_MEM_FENCE);
        if (l == 0) {  /* the largest digit whose weight takes the running sum to the target (else the smallest) */
            double above = above_cut;
            uint d = NUCLEUS_BINS - 1;
            for (;; d--) {
                double bin = 0.0;
                for (uint j = 0; j < RED_LANES; j++) bin += bins[d * RED_LANES + j];
                if (above + bin >= target || d == 0) break;
                above += bin;
            }
            cut[0] = key | (d << shift);
            above_cut = above;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const uint key = cut[0];
    uint c = 0;
    for (uint t = t0; t < t1; t++) c += float_key(logits[t]) == key;
    ties[l] = c;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (l == 0) {
        out[0] = 0;  /* a valid id for the next lookup where the host decides */
        out[1] = 1;
        cut[1] = 0;
        uint tied = 0;
        for (uint j = 0; j < RED_LANES; j++) tied += ties[j];
        const float at = as_float((key & 0x80000000u) ? key & 0x7fffffffu : ~key);  /* float_key's inverse */
        const double w = exp((double)at / temperature - zmax), above = above_cut, tol = SAMPLE_TOLERANCE * total;
        /* the tied tokens the nucleus needs: the fewest whose weight takes the running sum to the target */
        const double need = ceil((target - above) / w);
        const uint kept = need < 1.0 ? 1u : (need > (double)tied ? tied : (uint)need);
        if (isfinite(total) && total > 0.0 && tied > 0 && w > 0.0 && above + kept * w - target >= tol &&
            target - (above + (kept - 1) * w) >= tol) {
            uint j = 0, seen = 0;
            while (seen + ties[j] < kept) seen += ties[j++];
            for (uint t = j * chunk; t < n; t++) {
                if (float_key(logits[t]) == key && ++seen == kept) {
                    cut[1] = t;
                    out[1] = 0;
                    break;
                }
            }
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const uint last_tie = cut[1];
    double s = 0.0;
    for (uint t = t0; t < t1; t++) {
        const uint k = float_key(logits[t]);
        if (k > key || (k == key && t <= last_tie)) s += weight[t];
    }
    red[l] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (l == 0 && !out[1])  /* the draw among the kept tokens, in index order */
        draw_in_order(logits, weight, n, chunk, red, u, false, key, last_tie, out);
    barrier(CLK_LOCAL_MEM_FENCE);
    sample_out(logits, n, out, token, held, row, rows);
}
#endif
