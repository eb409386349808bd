/* Row reductions and the norms: one work-group of RED_LANES items per row. */

/* NAME(v, red): the sum of every work-item's v over the work-group, pairwise over the items, in TYPE (sample.cl
 * stamps out a float64 one). */
#define GROUP_SUM(NAME, TYPE)                                   \
    INLINE TYPE NAME(TYPE v, __local TYPE* red) {               \
        const uint l = get_local_id(0);                         \
        red[l] = v;                                             \
        barrier(CLK_LOCAL_MEM_FENCE);                           \
        for (uint w = RED_LANES / 2; w > 0; w >>= 1) {          \
            if (l < w) red[l] += red[l + w];                    \
            barrier(CLK_LOCAL_MEM_FENCE);                       \
        }                                                       \
        const TYPE r = red[0];                                  \
        barrier(CLK_LOCAL_MEM_FENCE);                           \
        return r;                                               \
    }
GROUP_SUM(group_sum, float)

INLINE float group_max(float v, __local float* red) {
    const uint l = get_local_id(0);
    red[l] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint w = RED_LANES / 2; w > 0; w >>= 1) {
        if (l < w) red[l] = fmax_(red[l], red[l + w]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}

/* y = w * (x * (1 / sqrt(mean(x^2) + eps))) per row of n. Global (rows * RED_LANES). */
__kernel void rms_norm(__global const float* x, __global const float* w, __global float* y, uint n, float eps) {
    __local float red[RED_LANES];
    const uint l = get_local_id(0);
    const ulong base = (ulong)get_group_id(0) * n;
    float s = 0.0f;
    for (uint i = l; i < n; i += RED_LANES) s += x[base + i] * x[base + i];
    const float inv = 1.0f / sqrt(group_sum(s, red) / (float)n + eps);
    for (uint i = l; i < n; i += RED_LANES) y[base + i] = w[i] * (x[base + i] * inv);
}

/* y = (x - mean) / sqrt(var + eps) * w + b per row of n (biased variance). Global (rows * RED_LANES). */
__kernel void layer_norm(__global const float* x, __global const float* w, __global const float* b,
                         __global float* y, uint n, float eps) {
    __local float red[RED_LANES];
    const uint l = get_local_id(0);
    const ulong base = (ulong)get_group_id(0) * n;
    float s = 0.0f;
    for (uint i = l; i < n; i += RED_LANES) s += x[base + i];
    const float mean = group_sum(s, red) / (float)n;
    float v = 0.0f;
    for (uint i = l; i < n; i += RED_LANES) {
        const float c = x[base + i] - mean;
        v += c * c;
    }
    const float den = sqrt(group_sum(v, red) / (float)n + eps);
    for (uint i = l; i < n; i += RED_LANES) y[base + i] = (x[base + i] - mean) / den * w[i] + b[i];
}
