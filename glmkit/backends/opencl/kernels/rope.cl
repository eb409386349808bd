/* RoPE on interleaved pairs, de-interleaved output (DESIGN section 3): for the `2 * n_half` dims starting at
 * `off` of each row, y = concat(e * cos - o * sin, o * cos + e * sin) with e = x[0::2], o = x[1::2].
 * off = 0: the indexer's layout (first dims); off = row - 2 * n_half: the main attention's (last dims).
 * Rows are [S, heads] with `stride` floats each; cos/sin are [S, n_half]. Only the rope dims of y are
 * written. Global (n_half, S * heads). */
__kernel void rope(__global const float* x, __global float* y, __global const float* cos_t,
                   __global const float* sin_t, uint heads, uint stride, uint off, uint n_half) {
    const uint i = get_global_id(0), row = get_global_id(1);
    if (i >= n_half) return;
    const uint s = row / heads;
    const ulong base = (ulong)row * stride + off;
    const float e = x[base + 2 * i], o = x[base + 2 * i + 1];
    const float c = cos_t[s * n_half + i], sn = sin_t[s * n_half + i];
    y[base + i] = e * c - o * sn;
    y[base + n_half + i] = o * c + e * sn;
}
