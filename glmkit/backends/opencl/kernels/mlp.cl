/* SiLU gate: y = silu(g) * u elementwise. */
__kernel void silu_mul(__global const float* g, __global const float* u, __global float* y, uint n) {
    const uint i = get_global_id(0);
    if (i < n) y[i] = silu(g[i]) * u[i];
}
