/* The device decode step (glmkit.backends.opencl.decode_graph): the small per-token operations that sit between the
 * weight products, so that a whole decoded token is one queue of kernels with a single wait at the end.
 * Every pointer comes with an offset in floats: a KV cache row, or a vector inside the step's buffer of
 * norm weights and biases. One query token, or a few consecutive ones in one launch (token rows: MTP's
 * verification). */

/* The end of an RMSNorm over n values run by one work-group: y = w * (x * (1 / sqrt(mean(x^2) + eps))), s being this
 * item's part of the sum of squares; with `quantize`, also y's int8 codes, scales and code sums (common.cl; n a
 * multiple of 64) for the int8-input products that read it. */
INLINE void rms_norm_out(const __global float* x, float s, uint n, float eps, const __global float* w,
                         __global float* y, uint quantize, __global char* q, __global float* qs, __global int* qsum,
                         __local float* red) {
    const uint l = get_local_id(0);
    const float inv = 1.0f / sqrt(group_sum(s, red) / (float)n + eps);
    for (uint i = l; i < n; i += RED_LANES) y[i] = w[i] * (x[i] * inv);
    /* a block is read by another item than the ones that wrote it; the barrier is not under `quantize`: PoCL
     * crashed on this barrier in a branch followed by more barriers (token_rows) */
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (uint b = l; quantize && b < n / 64; b += RED_LANES) quantize_block(y + 64 * b, q + 128 * b, qs + b, qsum + b);
}

/* x += sum over the rows s in [a_range[0], a_range[1]) of a_w[s] * a[s] (when `add`), then
 * y = w * (x * (1 / sqrt(mean(x^2) + eps))) over n values: a residual add followed by the next RMSNorm (add = 0: the
 * norm alone). The rows of `a`: the experts' per-slot down outputs with their routing weights (the sum that
 * expert_sum would write, in its order), or one row of weight 1 (a plain add, exact). With `quantize`, also y's int8
 * codes, scales and code sums (common.cl; n a multiple of 64) for the int8-input products that read it. Token row r
 * (several tokens in one launch) works on x, y and the codes from row r (n values apart) and adds a's rows
 * [a_range[r], a_range[r + 1]). One work-group of RED_LANES items per token row: global (RED_LANES, rows). */
__kernel void residual_rms_norm(__global float* x, uint x_off, __global const float* a,
                                __global const uint* a_range, __global const float* a_w, uint add,
                                __global const float* w, uint w_off, __global float* y, uint y_off, uint n,
                                float eps, uint quantize, __global char* q, __global float* qs,
                                __global int* qsum) {
    __local float red[RED_LANES];
    const uint l = get_local_id(0), r = get_global_id(1);
    __global float* xp = x + x_off + (ulong)r * n;
    const uint first = add ? a_range[r] : 0, end = add ? a_range[r + 1] : 0;
    float s = 0.0f;
    for (uint i = l; i < n; i += RED_LANES) {
        float v = xp[i];
        if (add) {
            float sum = 0.0f;
            for (uint r = first; r < end; r++) sum += a_w[r] * a[r * n + i];
            v += sum;
            xp[i] = v;
        }
        s += v * v;
    }
    rms_norm_out(xp, s, n, eps, w + w_off, y + y_off + (ulong)r * n, quantize, q + 2 * r * n, qs + r * (n / 64),
                 qsum + r * (n / 64), red);
}

/* The logits of the tokens a grammar does not allow next at -inf (bit t % 32 of bitmask[t / 32] clear: llguidance's
 * bitmask), before the device chooses the token: a constrained request's pipelined decoding. Global (n). */
__kernel void mask_logits(__global float* logits, __global const int* bitmask, uint n) {
    const uint t = get_global_id(0);
    if (t < n && !((bitmask[t >> 5] >> (t & 31)) & 1)) logits[t] = -INFINITY;
}

/* token[r] = the index of the largest of the n values of row r of x, the first one on ties (NumPy's argmax): the
 * greedy token, chosen on the device so that the next token's forward can be queued before the host sees this
 * one (and MTP's draft of the verified tokens, from the tokens chosen for them). One work-group per row: global
 * (RED_LANES, rows). */
__kernel void argmax_row(__global const float* x, uint n, __global uint* token) {
    __local float best[RED_LANES];
    __local uint at[RED_LANES];
    const uint l = get_local_id(0), none = 0xffffffffu, r = get_global_id(1);
    x += (ulong)r * n;
    float v = -INFINITY;
    uint idx = none;
    for (uint i = l; i < n; i += RED_LANES) {
        if (idx == none || x[i] > v) {
            v = x[i];
            idx = i;
        }
    }
    best[l] = v;
    at[l] = idx;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint w = RED_LANES / 2; w > 0; w >>= 1) {
        if (l < w) {
            const float ov = best[l + w];
            const uint oi = at[l + w];
            if (oi != none && (at[l] == none || ov > best[l] || (ov == best[l] && oi < at[l]))) {
                best[l] = ov;
                at[l] = oi;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (l == 0) token[r] = at[0];
}

/* y += a over n values (a shared expert that runs in a launch pair of its own). Global (n). */
__kernel void add_into(__global float* y, __global const float* a, uint n) {
    const uint i = get_global_id(0);
    if (i < n) y[i] += a[i];
}

/* The token's indexer key row: key = LayerNorm(x) (weights and bias at vec + w_off, vec + b_off; biased variance),
 * then index_k[row] = key with RoPE on its first `rope` columns (cs: see rope_rows). tmp: n floats of scratch. Run
 * by one work-group. */
INLINE void index_key_row(__global const float* x, __global const float* vec, uint w_off, uint b_off,
                          __global float* tmp, __global float* index_k, uint row, uint n, uint rope,
                          __global const float* cs, float eps, __local float* red) {
    const uint l = get_local_id(0), n_half = rope / 2;
    float s = 0.0f;
    for (uint i = l; i < n; i += RED_LANES) s += x[i];
    const float mean = group_sum(s, red) / (float)n;
    float v = 0.0f;
    for (uint i = l; i < n; i += RED_LANES) {
        const float c = x[i] - mean;
        v += c * c;
    }
    const float den = sqrt(group_sum(v, red) / (float)n + eps);
    for (uint i = l; i < n; i += RED_LANES) tmp[i] = (x[i] - mean) / den * vec[w_off + i] + vec[b_off + i];
    barrier(CLK_GLOBAL_MEM_FENCE);  /* a rotated pair may have been normed by another item */
    __global float* out = index_k + (ulong)row * n;
    for (uint i = l; i < n; i += RED_LANES) {
        float y;
        if (i < n_half) {
            y = tmp[2 * i] * cs[i] - tmp[2 * i + 1] * cs[n_half + i];
        } else if (i < rope) {
            const uint j = i - n_half;
            y = tmp[2 * j + 1] * cs[j] + tmp[2 * j] * cs[n_half + j];
        } else {
            y = tmp[i];
        }
        out[i] = y;
    }
}

#define NO_STAGE 0xffffffffu

/* The normalized rows of the token's latent projections, in one launch:
 * - from kv_a's output comp = [latent (kvl) | rope part (rope)]: kv_lat[row] = RMSNorm of the latent (weights at
 *   vec + w_off), k_rot[row] = the rope part with RoPE applied (cs: see rope_rows);
 * - the query latent for q_b: q_lat = RMSNorm of q_a's output (qn values, weights at vec + qw_off), with its int8
 *   codes when `quantize` (rms_norm_out);
 * - with `index` (a layer with an indexer of its own): the indexer key row from key_raw (index_key_row; weights and
 *   bias at vec + kw_off, vec + kb_off, tmp: ihd floats of scratch) into index_k[row];
 * - unless stage_off is NO_STAGE: a copy of the cache rows at stage + stage_off ([kv_lat | k_rot | index_k], token r's
 *   r such rows on), where a discrete device collects every layer's rows of the forward for one read back.
 * Several consecutive tokens in one launch: token r reads comp, q_a, key_raw, cs and writes q_lat, its codes, tmp
 * from their row r and writes cache row `row + r`. One work-group per token: global (RED_LANES, tokens). */
__kernel void token_rows(__global const float* comp, __global const float* vec, uint w_off, __global float* kv_lat,
                         __global float* k_rot, uint row, uint kvl, uint rope, __global const float* cs, float eps,
                         __global const float* q_a, uint qw_off, __global float* q_lat, uint qn, uint quantize,
                         __global char* q, __global float* qs, __global int* qsum, uint index,
                         __global const float* key_raw, uint kw_off, uint kb_off, __global float* tmp,
                         __global float* index_k, uint ihd, __global float* stage, uint stage_off) {
    __local float red[RED_LANES];
    const uint l = get_local_id(0), n_half = rope / 2, r = get_global_id(1);
    comp += r * (kvl + rope);
    q_a += r * qn;
    q_lat += r * qn;
    q += 2 * r * qn;
    qs += r * (qn / 64);
    qsum += r * (qn / 64);
    key_raw += r * ihd;
    tmp += r * ihd;
    cs += r * rope;
    row += r;
    float s = 0.0f;
    for (uint i = l; i < kvl; i += RED_LANES) s += comp[i] * comp[i];
    rms_norm_out(comp, s, kvl, eps, vec + w_off, kv_lat + (ulong)row * kvl, 0, q, qs, qsum, red);
    for (uint i = l; i < n_half; i += RED_LANES) rope_pair(comp + kvl, k_rot + (ulong)row * rope, cs, n_half, i);
    float sq = 0.0f;
    for (uint i = l; i < qn; i += RED_LANES) sq += q_a[i] * q_a[i];
    rms_norm_out(q_a, sq, qn, eps, vec + qw_off, q_lat, quantize, q, qs, qsum, red);
    if (index) index_key_row(key_raw, vec, kw_off, kb_off, tmp, index_k, row, ihd, rope, cs, eps, red);
    barrier(CLK_GLOBAL_MEM_FENCE);  /* unconditional: PoCL 3.0 crashes on a barrier under a condition */
    if (stage_off == NO_STAGE) return;
    __global float* st = stage + stage_off + r * (kvl + rope + ihd);
    for (uint i = l; i < kvl; i += RED_LANES) st[i] = kv_lat[(ulong)row * kvl + i];
    for (uint i = l; i < rope; i += RED_LANES) st[kvl + i] = k_rot[(ulong)row * rope + i];
    for (uint i = l; index && i < ihd; i += RED_LANES) st[kvl + rope + i] = index_k[(ulong)row * ihd + i];
}

/* Row h of y (width values at y + y_off + h * y_row) from row h of x (at x + x_off + h * x_row): RoPE on the
 * interleaved pairs of the first 2 * n_half columns, de-interleaved (concat(e * cos - o * sin, o * cos + e * sin)),
 * the other columns copied. cs = [cos (n_half), sin (n_half)] of the token's position, per token: rows h read cs
 * row h / per_cs (the rows of several tokens in one launch, per_cs each). Global (width, rows). */
__kernel void rope_rows(__global const float* x, uint x_off, uint x_row, __global float* y, uint y_off, uint y_row,
                        __global const float* cs, uint width, uint n_half, uint per_cs) {
    const uint j = get_global_id(0), h = get_global_id(1);
    if (j >= width) return;
    cs += h / per_cs * 2 * n_half;
    const __global float* xr = x + x_off + (ulong)h * x_row;
    float v;
    if (j < n_half) {
        v = xr[2 * j] * cs[j] - xr[2 * j + 1] * cs[n_half + j];
    } else if (j < 2 * n_half) {
        const uint i = j - n_half;
        v = xr[2 * i + 1] * cs[i] + xr[2 * i] * cs[n_half + i];
    } else {
        v = xr[j];
    }
    y[y_off + (ulong)h * y_row + j] = v;
}

#define MAX_EXPERTS 1024
#define MAX_BUFFERS 8
#define MAX_TOPK 64

/* noaux_tc selection of one token: the top_k experts' ids, ascending, into `ids`, and their weights into `w`.
 * Selection uses sigmoid(logits) + bias among the topk_group groups with the largest top-2 sums; the weights
 * are the unbiased sigmoid scores (normalized when `norm`) times `scaling`. Returns how many were selected. */
static uint route_choose(__global const float* logits, __global const float* vec, uint bias_off, uint n_experts,
                         uint n_group, uint topk_group, uint top_k, uint norm, float scaling, __global uint* ids,
                         float* w) {
    float score[MAX_EXPERTS], choice[MAX_EXPERTS];
    uchar state[MAX_EXPERTS];  /* 0: excluded, 1: candidate, 2: selected */
    const uint per = n_experts / n_group;
    for (uint e = 0; e < n_experts; e++) {
        score[e] = 1.0f / (1.0f + exp(-logits[e]));
        choice[e] = score[e] + vec[bias_off + e];
        state[e] = 0;
    }
    float group_score[MAX_EXPERTS];
    for (uint g = 0; g < n_group; g++) {
        float first = -INFINITY, second = -INFINITY;
        for (uint e = g * per; e < (g + 1) * per; e++) {
            if (choice[e] > first) {
                second = first;
                first = choice[e];
            } else if (choice[e] > second) {
                second = choice[e];
            }
        }
        group_score[g] = per > 1 ? second + first : first;
    }
    for (uint pick = 0; pick < topk_group; pick++) {
        uint best = n_group;
        for (uint g = 0; g < n_group; g++)
            if (group_score[g] != -INFINITY && (best == n_group || group_score[g] > group_score[best])) best = g;
        if (best == n_group) break;
        group_score[best] = -INFINITY;
        for (uint e = best * per; e < (best + 1) * per; e++) state[e] = 1;
    }
    for (uint pick = 0; pick < top_k; pick++) {
        uint best = n_experts;
        for (uint e = 0; e < n_experts; e++)
            if (state[e] == 1 && (best == n_experts || choice[e] > choice[best])) best = e;
        if (best == n_experts) break;
        state[best] = 2;
    }
    uint k = 0;
    float total = 0.0f;
    for (uint e = 0; e < n_experts && k < top_k; e++) {
        if (state[e] != 2) continue;
        ids[k] = e;
        w[k++] = score[e];
        total += score[e];
    }
    for (uint i = 0; i < k; i++) w[i] = (norm ? w[i] / (total + 1e-20f) : w[i]) * scaling;
    return k;
}

/* The fused expert launches' slots of token `tok` (of a launch over several) for k routed experts (then the shared
 * one, weight 1, when `shared`), after the slots `count` earlier tokens took per buffer. Member i (of k + shared)
 * reads its 6 byte offsets (gate, gate scales, up, up scales, down, down scales) at table[row[i] * 6] and lies in
 * weight buffer buffer_of[row[i]] (one launch pair per buffer). Buffer b's slots start at slot b * stride (offs: 6
 * values per slot; slot_w; slot_tok) and token t's slot range is [tok_start[b * stride + t], tok_start[... + t + 1]):
 * its members in order. */
static void route_fill(uint tok, uint k, uint shared, const uint* row, const float* w, __global const ulong* table,
                       __global const uint* buffer_of, uint n_buffers, __global ulong* offs, __global float* slot_w,
                       __global uint* slot_tok, uint stride, __global uint* tok_start, uint* count) {
    for (uint b = 0; b < n_buffers; b++) tok_start[b * stride + tok] = count[b];
    for (uint i = 0; i < k + (shared ? 1 : 0); i++) {
        const uint b = buffer_of[row[i]], slot = b * stride + count[b]++;
        slot_w[slot] = i == k ? 1.0f : w[i];
        slot_tok[slot] = tok;
        for (uint j = 0; j < 6; j++) offs[slot * 6 + j] = table[row[i] * 6 + j];
    }
}

/* After route_fill of n_tok tokens: each buffer's slot ranges end, its other slots get token 0xffffffff. */
static void route_close(uint n_tok, uint n_buffers, __global uint* slot_tok, uint stride, __global uint* tok_start,
                        const uint* count) {
    for (uint b = 0; b < n_buffers; b++) {
        tok_start[b * stride + n_tok] = count[b];
        for (uint j = count[b]; j < stride; j++) slot_tok[b * stride + j] = 0xffffffffu;
    }
}

/* noaux_tc routing of n_tok tokens (one work-item; token t's logits at logits + t * n_experts), writing the fused
 * expert launches' slots directly: table and buffer_of per expert (the shared expert's last, at n_experts). ids:
 * token t's selected experts, ascending, from ids + t * top_k. */
__kernel void route_noaux_tc(__global const float* logits, __global const float* vec, uint bias_off,
                             __global const ulong* table, __global const uint* buffer_of, uint n_buffers,
                             uint n_experts, uint n_group, uint topk_group, uint top_k, uint norm, float scaling,
                             uint shared, __global ulong* offs, __global float* slot_w, __global uint* slot_tok,
                             uint stride, __global uint* tok_start, __global uint* ids, uint n_tok) {
    if (get_global_id(0) != 0) return;
    uint count[MAX_BUFFERS];
    for (uint b = 0; b < n_buffers; b++) count[b] = 0;
    for (uint t = 0; t < n_tok; t++) {
        float w[MAX_TOPK];
        __global uint* chosen = ids + t * top_k;
        const uint k = route_choose(logits + (ulong)t * n_experts, vec, bias_off, n_experts, n_group, topk_group,
                                    top_k, norm, scaling, chosen, w);
        uint row[MAX_TOPK + 1];
        for (uint i = 0; i < k; i++) row[i] = chosen[i];
        row[k] = n_experts;
        route_fill(t, k, shared, row, w, table, buffer_of, n_buffers, offs, slot_w, slot_tok, stride, tok_start,
                   count);
    }
    route_close(n_tok, n_buffers, slot_tok, stride, tok_start, count);
}

/* noaux_tc routing of n_tok tokens (one work-item; token t's logits at logits + t * n_experts, its ids, ascending, to
 * ids + t * top_k) over an expert cache's arena, in chunks of chunk_bytes (one weight buffer each): token t's routed
 * expert i takes slot t * members + i (its shared expert, which the host placed once, the slot after them), with its
 * weight and the 6 byte offsets `place % chunk_bytes + rel[j]` within its chunk, where place (places[places_off + id])
 * is where the expert starts in the arena, < 0 while it is not read. A read expert's slot runs in its chunk's first
 * launch set (first[c * stride + slot] = t in chunk c, unused in the others); an unread one's in none yet: the host
 * writes its offsets and its chunk's after[] once it is read. after[] starts unused. */
__kernel void route_arena(__global const float* logits, __global const float* vec, uint bias_off, uint n_experts,
                          uint n_group, uint topk_group, uint top_k, uint norm, float scaling,
                          __global const long* places, uint places_off, __global const ulong* rel, ulong chunk_bytes,
                          uint n_chunks, uint members, uint stride, __global ulong* offs, __global float* slot_w,
                          __global uint* first, __global uint* after, __global uint* ids, uint n_tok) {
    if (get_global_id(0) != 0) return;
    for (uint t = 0; t < n_tok; t++) {
        float w[MAX_TOPK];
        __global uint* chosen = ids + t * top_k;
        const uint k = route_choose(logits + (ulong)t * n_experts, vec, bias_off, n_experts, n_group, topk_group,
                                    top_k, norm, scaling, chosen, w);
        for (uint i = k; i < top_k; i++) chosen[i] = 0;  /* none left to choose: expert 0 at weight 0 */
        for (uint i = 0; i < top_k; i++) {
            const uint slot = t * members + i;
            const long place = places[places_off + chosen[i]];
            slot_w[slot] = i < k ? w[i] : 0.0f;
            for (uint c = 0; c < n_chunks; c++) {
                first[c * stride + slot] = place >= 0 && (ulong)place / chunk_bytes == c ? t : 0xffffffffu;
                after[c * stride + slot] = 0xffffffffu;
            }
            if (place >= 0)
                for (uint j = 0; j < 6; j++) offs[slot * 6 + j] = (ulong)place % chunk_bytes + rel[j];
        }
    }
}
