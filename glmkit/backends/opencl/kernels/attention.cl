/* Masked softmax attention, one work-group (RED_LANES items) per (query row s, head h); the MLA decode
 * core runs it in latent space with one shared key head (absorbed kv_b: k_head = v_head = 0).
 * q [S, nh, dk]; key t of head h at k + t * k_row + h * k_head (dk floats), its value at
 * v + t * v_row + h * v_head (dv floats); allowed [S, T] bytes; scores: scratch [S * nh, T].
 * out[s, h] = softmax(q . k * scale over allowed keys) @ v. Global (nh * RED_LANES, S). */
__kernel void attention(__global const float* q, __global const float* k, __global const float* v,
                        __global const uchar* allowed, __global float* scores, __global float* out,
                        uint nh, uint n_keys, uint dk, uint dv, uint k_row, uint k_head, uint v_row, uint v_head,
                        float scale) {
    __local float red[RED_LANES];
    const uint l = get_local_id(0), h = get_group_id(0), s = get_group_id(1);
    const __global float* qv = q + ((ulong)s * nh + h) * dk;
    __global float* sc = scores + ((ulong)s * nh + h) * n_keys;
    const __global uchar* mask = allowed + (ulong)s * n_keys;
    const uint dk4 = dk / 4;
    float m = -INFINITY;
    for (uint t = l; t < n_keys; t += RED_LANES) {
        float d = -INFINITY;
        if (mask[t]) {
            const __global float* kv = k + (ulong)t * k_row + (ulong)h * k_head;
            float4 acc = (float4)(0.0f);
            for (uint j = 0; j < dk4; j++) acc += LOAD_F4(j, qv) * LOAD_F4(j, kv);
            float dot_ = (acc.x + acc.y) + (acc.z + acc.w);
            for (uint j = dk4 * 4; j < dk; j++) dot_ += qv[j] * kv[j];
            d = dot_ * scale;
        }
        sc[t] = d;
        m = fmax_(m, d);
    }
    m = group_max(m, red);
    float sum = 0.0f;
    for (uint t = l; t < n_keys; t += RED_LANES) {
        const float e = mask[t] ? exp(sc[t] - m) : 0.0f;
        sc[t] = e;
        sum += e;
    }
    sum = group_sum(sum, red);
    barrier(CLK_GLOBAL_MEM_FENCE);  /* every item's probabilities are visible to the whole group */
    const float inv = 1.0f / sum;
    for (uint d = l; d < dv; d += RED_LANES) {
        float acc = 0.0f;
        const __global float* vp = v + (ulong)h * v_head + d;
        for (uint t = 0; t < n_keys; t++) acc += (sc[t]) * (vp[(ulong)t * v_row]);
        out[((ulong)s * nh + h) * dv + d] = acc * inv;
    }
}
