/* glmkit OpenCL kernels: shared helpers (plain OpenCL C 1.2).
 *
 * Weights are addressed as (buffer, byte offset): a buffer is a whole mapped data file (CPU and
 * unified-memory devices use it in place) or an upload arena (discrete GPUs). A weight row of a
 * quantized matrix is `row_bytes` packed bytes; its scales (float) are one per row (group == 0) or one
 * per `group` columns (`n_groups` per row). Packing (docs/FORMAT.md): int8 two's complement; int4 code+8,
 * even column in the low nibble; int2 code+2, column 4j+k at bits 2k of byte j; int3 code+4 in blocks of 64
 * columns, 24 bytes each (block column 16k+j: low bits 2k..2k+1 of byte j; column 8k+j: high bit k of byte 16+j).
 * bits == 32: float rows. bits == NL4: int4's bytes, but a nibble u stands for the level NL4_LEVELS[u], not u - 8.
 *
 * Compile-time knobs: LANES (work-items cooperating on one matvec row: 1 on CPUs, a warp on GPUs),
 * ROWS (matvec rows per work-item, sharing each loaded chunk of x: 4 on CPUs, 1 on GPUs),
 * RED_LANES (work-group size of the row-reduction kernels: norms, attention, top-k).
 */

/* PoCL does not inline small helpers, not even builtins such as vload16 or mad (each would be a call with a
 * vzeroupper in the innermost loop): helpers are forced inline, and on CPU devices (CPU_LOADS) vector loads
 * go through packed structs (plain unaligned loads, OpenCL C 6.11.1) instead of the vloadn builtins. */
#define INLINE static inline __attribute__((always_inline))
#ifdef CPU_LOADS
typedef struct __attribute__((packed)) { uchar16 v; } uchar16_u;
typedef struct __attribute__((packed)) { uchar8 v; } uchar8_u;
typedef struct __attribute__((packed)) { ushort8 v; } ushort8_u;
typedef struct __attribute__((packed)) { float8 v; } float8_u;
typedef struct __attribute__((packed)) { float4 v; } float4_u;
#define LOAD_U16(i, p) (((const __global uchar16_u*)(p))[i].v)
#define LOAD_U8(i, p) (((const __global uchar8_u*)(p))[i].v)
#define LOAD_US8(i, p) (((const __global ushort8_u*)(p))[i].v)
#define LOAD_F8(i, p) (((const __global float8_u*)(p))[i].v)
#define LOAD_F4(i, p) (((const __global float4_u*)(p))[i].v)
#define STORE_F8(i, p, x) (((__global float8_u*)(p))[i].v = (x))
#else
#define LOAD_U16(i, p) vload16((i), (p))
#define LOAD_U8(i, p) vload8((i), (p))
#define LOAD_US8(i, p) vload8((i), (p))
#define LOAD_F8(i, p) vload8((i), (p))
#define LOAD_F4(i, p) vload4((i), (p))
#define STORE_F8(i, p, x) vstore8((x), (i), (p))
#endif

INLINE uint umin_(uint a, uint b) {
    return a < b ? a : b;
}

INLINE float fmax_(float a, float b) {  /* no NaN here; -inf is ordered */
    return a > b ? a : b;
}

#ifndef LANES
#define LANES 1
#endif
#ifndef RED_LANES
#define RED_LANES 16
#endif
#ifndef ROWS
#define ROWS (LANES > 1 ? 1 : 4)
#endif
#ifndef SHADOW_BLOCK
#define SHADOW_BLOCK 8  /* keys per block of the indexer keys' shadows (kv_cache.SHADOW_BLOCK) */
#endif
#define VALUE_COLS (LANES > 1 ? 1 : 32)  /* latent columns per work-item of mla_decode_values */

/* AVX2 CPUs: 32-byte vectors for the byte products (below) and for unpacking int3 blocks. */
#if defined(__AVX2__) && defined(CPU_LOADS)
#define X8_PAIRS 1
typedef char char32 __attribute__((ext_vector_type(32)));
typedef char c32v __attribute__((vector_size(32)));
typedef short s16v __attribute__((vector_size(32)));
typedef struct __attribute__((packed)) { c32v v; } c32v_u;

/* The stored values 0..7 of an int3 block (24 bytes at w) as bytes in column order: columns 0..31 in *v0, 32..63
 * in *v1. Low bit pairs: the 16 bytes and the same shifted by 2 are columns 0..31 (masked with 3), that pair
 * shifted by 4 columns 32..63. High bits: the 8 bytes repeated 4 times, bit c / 8 of byte c % 8 tested for column
 * c (bits 4..7 for columns 32..63), each set one giving 4. */
INLINE void int3_block_bytes(const __global uchar* w, c32v* v0, c32v* v1) {
    const c32v bit = {1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 4, 4, 4, 4, 8, 8, 8, 8, 8, 8, 8, 8};
    const c32v three = (c32v)((char32)(3)), four = (c32v)((char32)(4));
    const uchar16 low = LOAD_U16(0, w);
    const uchar8 high = LOAD_U8(0, w + 16);
    const c32v pairs = (c32v)__builtin_shufflevector(low, low >> (uchar16)2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                     13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28,
                                                     29, 30, 31);
    const c32v highs = (c32v)__builtin_shufflevector(high, high, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1,
                                                     2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    *v0 = (pairs & three) | (((highs & bit) == bit) & four);
    *v1 = ((c32v)((s16v)pairs >> 4) & three) | ((((c32v)((s16v)highs >> 4) & bit) == bit) & four);
}
#endif

/* nl4 weights (docs/FORMAT.md) are stamped out with bits == NL4: stored as int4 (STORED_BITS), each nibble u
 * looked up in the 16 int8 levels (packing.NL4_LEVELS), so products with int8 activations stay integer sums. */
#define NL4 (-4)
#define STORED_BITS(bits) ((bits) == NL4 ? 4 : (bits))
#define NL4_LEVELS -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113
__constant char nl4_levels[16] = {NL4_LEVELS};

/* The levels of 16 nibble values u (0..15): one byte shuffle. AVX2 CPUs call pshufb by name (PoCL expands
 * OpenCL's shuffle() element by element: 10x slower float-input products). */
#ifdef X8_PAIRS
typedef char c16v __attribute__((vector_size(16)));
INLINE char16 nl4_values16(uchar16 u) {
    const c16v table = {NL4_LEVELS};
    return as_char16(__builtin_ia32_pshufb128(table, (c16v)u));
}
#else
INLINE char16 nl4_values16(uchar16 u) {
    return shuffle((char16)(NL4_LEVELS), u);
}
#endif

/* Codes in one storage chunk: 16 floats, 16 int8, 32 int4 or 64 int2 codes (16 bytes), or one int3 block of 64
 * codes (24 bytes). */
INLINE uint chunk_codes(const int bits) {
    return bits == 32 ? 16u : (bits == 8 ? 16u : (STORED_BITS(bits) == 4 ? 32u : 64u));
}

/* Stored int3 values (code + 4, 0..7) of columns 8m .. 8m + 7 of the int3 block at b (m < 8). */
INLINE uchar8 int3_values8(const __global uchar* b, uint m) {
    const uchar8 low = LOAD_U8(m & 1u, b), high = LOAD_U8(0, b + 16);
    return ((low >> (uchar8)(2u * (m >> 1))) & (uchar8)3) | (((high >> (uchar8)m) & (uchar8)1) << (uchar8)2);
}

/* The x values of storage chunk c arranged like the codes that `codes_dot` unpacks (x starts at the row's
 * column 0): f32/int8: 2 vectors; int4: even and odd columns of each 16-code half; int2: the 4 bit fields of
 * each 32-code half; int3: 8 vectors in column order. Returns the chunk's bias term: int4/int2/int3 codes are
 * stored with +8/+2/+4, so
 * `sum (stored - 8) * x = sum stored * x - 8 * sum x`, and that second part is shared by every row.
 * Vectors are at most 8 floats wide (an AVX2 register) so that no target splits them. */
INLINE float8 load_x(const int bits, const __global float* x, uint c, float8* xv) {
    if (bits == 32 || bits == 8) {
        xv[0] = LOAD_F8(2 * c, x);
        xv[1] = LOAD_F8(2 * c + 1, x);
        return (float8)(0.0f);
    }
    if (STORED_BITS(bits) == 4) {
        const __global float* xp = x + c * 32u;
        const float8 a0 = LOAD_F8(0, xp), a1 = LOAD_F8(1, xp), a2 = LOAD_F8(2, xp), a3 = LOAD_F8(3, xp);
        xv[0] = (float8)(a0.even, a1.even);
        xv[1] = (float8)(a0.odd, a1.odd);
        xv[2] = (float8)(a2.even, a3.even);
        xv[3] = (float8)(a2.odd, a3.odd);
        return bits == NL4 ? (float8)(0.0f) : 8.0f * ((a0 + a1) + (a2 + a3));  /* nl4 levels carry their sign */
    }
    if (bits == 3) {
        const __global float* xp = x + c * 64u;
        float8 sum = (float8)(0.0f);
        for (uint m = 0; m < 8; m++) {
            xv[m] = LOAD_F8(m, xp);
            sum += xv[m];
        }
        return 4.0f * sum;
    }
    const __global float* xp = x + c * 64u;
    float8 sum = (float8)(0.0f);
    for (uint h = 0; h < 2; h++) {
        const float8 a0 = LOAD_F8(4 * h, xp), a1 = LOAD_F8(4 * h + 1, xp);
        const float8 a2 = LOAD_F8(4 * h + 2, xp), a3 = LOAD_F8(4 * h + 3, xp);
        xv[4 * h] = (float8)(a0.s04, a1.s04, a2.s04, a3.s04);
        xv[4 * h + 1] = (float8)(a0.s15, a1.s15, a2.s15, a3.s15);
        xv[4 * h + 2] = (float8)(a0.s26, a1.s26, a2.s26, a3.s26);
        xv[4 * h + 3] = (float8)(a0.s37, a1.s37, a2.s37, a3.s37);
        sum += (a0 + a1) + (a2 + a3);
    }
    return 2.0f * sum;
}

/* Products of the stored codes of chunk c of one row with the arranged x, as 8 partial sums (subtract the
 * bias from `load_x` to get the true products): one 16-byte (f32: 64-byte) load, codes unpacked in registers. */
INLINE float8 codes_dot(const int bits, const __global uchar* row, uint c, const float8* xv) {
    if (bits == 32) {
        const __global float* w = (const __global float*)row;
        return LOAD_F8(2 * c, w) * xv[0] + LOAD_F8(2 * c + 1, w) * xv[1];
    }
    if (bits == 3) {
        float8 acc = (float8)(0.0f);
#ifdef X8_PAIRS  /* the block's 64 values unpacked at once, as the int8-input product does */
        c32v v[2];
        int3_block_bytes(row + 24u * c, &v[0], &v[1]);
        for (uint m = 0; m < 8; m++) {
            const ulong4 q = as_ulong4(v[m >> 2]);
            acc += convert_float8(as_uchar8(q[m & 3])) * xv[m];
        }
#else
        for (uint m = 0; m < 8; m++) acc += convert_float8(int3_values8(row + 24u * c, m)) * xv[m];
#endif
        return acc;
    }
    const uchar16 b = LOAD_U16(c, row);
    if (bits == 8) {
        const char16 q = as_char16(b);
        return convert_float8(q.lo) * xv[0] + convert_float8(q.hi) * xv[1];
    }
    if (bits == 4) {
        return convert_float8(b.lo & (uchar8)15) * xv[0] + convert_float8(b.lo >> (uchar8)4) * xv[1]
             + convert_float8(b.hi & (uchar8)15) * xv[2] + convert_float8(b.hi >> (uchar8)4) * xv[3];
    }
    if (bits == NL4) {
        const char16 lo = nl4_values16(b & (uchar16)15), hi = nl4_values16(b >> (uchar16)4);
        return convert_float8(lo.lo) * xv[0] + convert_float8(hi.lo) * xv[1]
             + convert_float8(lo.hi) * xv[2] + convert_float8(hi.hi) * xv[3];
    }
    float8 acc = (float8)(0.0f);
    for (uint h = 0; h < 2; h++) {
        const uchar8 q = h ? b.hi : b.lo;
        acc += convert_float8(q & (uchar8)3) * xv[4 * h];
        acc += convert_float8((q >> (uchar8)2) & (uchar8)3) * xv[4 * h + 1];
        acc += convert_float8((q >> (uchar8)4) & (uchar8)3) * xv[4 * h + 2];
        acc += convert_float8(q >> (uchar8)6) * xv[4 * h + 3];
    }
    return acc;
}

/* The integer code (or float value) of column i of a row. */
INLINE float code_at(const int bits, const __global uchar* row, uint i) {
    if (bits == 32) return ((const __global float*)row)[i];
    if (bits == 8) return (float)as_char(row[i]);
    if (bits == 4) return (float)((row[i >> 1] >> ((i & 1u) * 4u)) & 15u) - 8.0f;
    if (bits == NL4) return (float)nl4_levels[(row[i >> 1] >> ((i & 1u) * 4u)) & 15u];
    if (bits == 3) {
        const __global uchar* b = row + 24u * (i >> 6);
        const uint t = i & 63u;
        return (float)(((b[t & 15u] >> (2u * (t >> 4))) & 3u) | (((b[16u + (t & 7u)] >> (t >> 3)) & 1u) << 2)) - 4.0f;
    }
    return (float)((row[i >> 2] >> ((i & 3u) * 2u)) & 3u) - 2.0f;
}

/* The dequantized value of column i of a row whose scales start at sc. */
INLINE float weight_at(const int bits, const __global uchar* row, const __global float* sc, uint i, uint group) {
    float w = code_at(bits, row, i);
    if (bits == 32) return w;
    return w * (group ? sc[i / group] : sc[0]);
}

/* RoPE of the interleaved pair j of pe, de-interleaved: out[j] = e cos - o sin, out[n_half + j] = o cos + e sin
 * (cs = [cos (n_half), sin (n_half)] of the token's position). */
INLINE void rope_pair(const __global float* pe, __global float* out, const __global float* cs, uint n_half, uint j) {
    const float e = pe[2 * j], o = pe[2 * j + 1], c = cs[j], sn = cs[n_half + j];
    out[j] = e * c - o * sn;
    out[n_half + j] = o * c + e * sn;
}

INLINE float hsum8(float8 v) {
    const float4 b = v.lo + v.hi;
    const float2 c = b.lo + b.hi;
    return c.x + c.y;
}

/* Reading ahead (CPU devices): each step over a row's columns also prefetches cache line `line` of the
 * `ahead_bytes` at `ahead` (and `ahead2` when sets == 2): the rows the work-item reads next, so their memory
 * reads start early. The hardware prefetcher does not follow ROWS interleaved row streams of a few hundred bytes
 * each, and prefetch instructions beat touching loads (a load that misses holds up retirement until its line
 * arrives, a prefetch retires at once; docs/BENCHMARKS.md, Kernels). */
#ifdef CPU_LOADS
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#define PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#else
#define PREFETCH(p) do { } while (0)
#define PREFETCH_L2(p) do { } while (0)
#endif
#define READ_AHEAD(line) do { \
        const uint at_ = (line) * 64u; \
        if (at_ < ahead_bytes && ahead_far) { \
            PREFETCH_L2(ahead + at_); \
            if (sets == 2) PREFETCH_L2(ahead2 + at_); \
        } else if (at_ < ahead_bytes) { \
            PREFETCH(ahead + at_); \
            if (sets == 2) PREFETCH(ahead2 + at_); \
        } \
    } while (0)
/* The next item's rows go to L2 only (not L1) when they are many: 16 KB or more would evict from L1 the lines the
 * item still reads, while small items are faster with L1 prefetches (docs/BENCHMARKS.md, Kernels); PoCL's code
 * generation also follows the shape of this branch. */
#define AHEAD_FAR(sets, row_bytes) ((sets) * ROWS * (row_bytes) >= 16384u)

/* The row and scale pointers of rows_dot's `sets * ROWS` rows (rows past nrows repeat the last row: valid
 * memory, results dropped, no branch in the inner loop), and their zeroed accumulators. */
INLINE void row_sets(const int sets, const __global uchar* row, const __global uchar* row2, uint row_bytes,
                     const __global float* sc, const __global float* sc2, uint n_groups, uint nrows,
                     const __global uchar** rk, const __global float** sk, float8* acc) {
    for (uint k = 0; k < sets * ROWS; k++) {
        const uint kk = umin_(k % ROWS, nrows - 1);
        rk[k] = (k < ROWS ? row : row2) + kk * row_bytes;
        sk[k] = (k < ROWS ? sc : sc2) + kk * n_groups;
        acc[k] = (float8)(0.0f);
    }
}

/* This lane's part of `out[k] = sum_i W[row k, i] * x[i]` for the `nrows` (<= ROWS) consecutive rows at
 * `row` (stride row_bytes; scales at sc, stride n_groups) over n columns; with sets == 2 also `out[ROWS + k]`
 * for the rows at `row2` (scales sc2; the fused expert's up rows next to its gate rows), which share each
 * chunk of x. Lanes stride over the chunks; each chunk's x is arranged once and reused by every row.
 * `ahead`, `ahead2`: see READ_AHEAD. `sets` is a constant at every call (the loops unroll to it). */
INLINE void rows_dot(const int bits, const int sets, const __global uchar* row, const __global uchar* row2,
                     uint row_bytes, const __global float* sc, const __global float* sc2, uint n_groups, uint nrows,
                     uint n, uint group, const __global float* x, uint lane, float* out,
                     const __global uchar* ahead, const __global uchar* ahead2, uint ahead_bytes) {
    const uint cw = chunk_codes(bits);
    const bool ahead_far = AHEAD_FAR(sets, row_bytes);
    const __global uchar* rk[2 * ROWS];
    const __global float* sk[2 * ROWS];
    float8 acc[2 * ROWS];
    row_sets(sets, row, row2, row_bytes, sc, sc2, n_groups, nrows, rk, sk, acc);
    uint vec_end = 0;
    if (bits == 32 || group == 0) {
        const uint chunks = n / cw;
        vec_end = chunks * cw;
        for (uint c = lane; c < chunks; c += LANES) {
            float8 xv[8];
            const float8 bias = load_x(bits, x, c, xv);
            READ_AHEAD(c);
            for (uint k = 0; k < sets * ROWS; k++) acc[k] += codes_dot(bits, rk[k], c, xv) - bias;
        }
    } else if (group % cw == 0) {
        const uint chunks = n / cw, per = group / cw;
        vec_end = chunks * cw;
        for (uint c = lane; c < chunks; c += LANES) {
            float8 xv[8];
            const float8 bias = load_x(bits, x, c, xv);
            const uint gi = c / per;  /* one division per chunk, shared by the rows */
            READ_AHEAD(c);
            for (uint k = 0; k < sets * ROWS; k++) acc[k] += (codes_dot(bits, rk[k], c, xv) - bias) * sk[k][gi];
        }
    }
    for (uint k = 0; k < sets * ROWS; k++) {
        if (k % ROWS >= nrows) continue;
        float s = hsum8(acc[k]);
        for (uint i = vec_end + lane; i < n; i += LANES) {
            float w = code_at(bits, rk[k], i);
            if (bits != 32 && group) w *= sk[k][i / group];
            s += w * x[i];
        }
        if (bits != 32 && group == 0) s *= sk[k][0];
        out[k] = s;
    }
}

/* ---- int8 activations (the device decode step's int4 and int8 products) --------------------------------
 * x is quantized per block of 64 columns: s = max|x| * (1 / 127) and q = rint(x * (127 / max|x|)), in float32
 * (tests/test_kernels_cl.py's quantize_activations is the reference). An int4 row's product with a block is summed
 * as integers, sum (c - 8) q = sum c q - 8 sum q, then scaled by the row's group scale times s; an int8 row's
 * (codes c) as sum c q. A block's codes take 128 bytes: the 64 in the order the int4 product reads them, then
 * the 64 in column order (the int8 product's). The int4 order:
 * - X8_PAIRS (AVX2 CPUs): even columns, then odd ones, matching the low and high nibbles of the block's 32
 *   bytes for vpmaddubsw. LLVM forms vpmaddubsw from no generic OpenCL C tried, so it is called by name
 *   (docs/BENCHMARKS.md, Kernels).
 * - otherwise: columns 4t, 4t+1, 4t+2, 4t+3 as four runs of 16, matching the nibbles of 16-bit lanes of the
 *   codes (little-endian devices), multiplied in 16 bits.
 * load_x8 reads either half of a block's codes; block_dot (int4 rows) and block_dot8 (int8 rows) use them. */
#ifdef X8_PAIRS
typedef struct { c32v even, odd; } x8_block;

INLINE x8_block load_x8(const __global char* q) {
    const x8_block b = {((const __global c32v_u*)q)[0].v, ((const __global c32v_u*)q)[1].v};
    return b;
}

/* 8 int32 partial sums of sum c q over one block (its 32 bytes of codes at w): two vpmaddubsw (at most
 * 2 * 2 * 15 * 127 per 16-bit lane: no saturation), then vpmaddwd by 1. The high nibbles: a 16-bit shift and a
 * mask (x86 has no byte shift). */
INLINE int8 block_dot(const __global uchar* w, const x8_block* x) {
    const c32v b = ((const __global c32v_u*)w)[0].v, m = (c32v)((char32)(15));
    const c32v lo = b & m, hi = (c32v)((s16v)b >> 4) & m;
    const s16v p = __builtin_ia32_pmaddubsw256(lo, x->even) + __builtin_ia32_pmaddubsw256(hi, x->odd);
    return as_int8(__builtin_ia32_pmaddwd256(p, (s16v)((short16)(1))));
}

/* The same for an int3 block (24 bytes at w, x in column order: `even` columns 0..31, `odd` 32..63): its values
 * as bytes (int3_block_bytes), then vpmaddubsw as for int4 (at most 2 * 2 * 7 * 127 per 16-bit lane). */
INLINE int8 block_dot3(const __global uchar* w, const x8_block* x) {
    c32v v0, v1;
    int3_block_bytes(w, &v0, &v1);
    const s16v p = __builtin_ia32_pmaddubsw256(v0, x->even) + __builtin_ia32_pmaddubsw256(v1, x->odd);
    return as_int8(__builtin_ia32_pmaddwd256(p, (s16v)((short16)(1))));
}

/* The same for an nl4 block (32 bytes at w, x in int4's order): the nibbles' levels by vpshufb (the table in both
 * 128-bit lanes), then vpmaddubsw of |level| (vpsignb of the levels by themselves: none is 0 or -128) with q signed
 * like the level (at most 2 * 127 * 127 per 16-bit lane), each half widened by vpmaddwd before the two are added. */
INLINE int8 block_dot_nl4(const __global uchar* w, const x8_block* x) {
    const c32v table = {NL4_LEVELS, NL4_LEVELS}, m = (c32v)((char32)(15));
    const c32v b = ((const __global c32v_u*)w)[0].v;
    const c32v lo = __builtin_ia32_pshufb256(table, b & m);
    const c32v hi = __builtin_ia32_pshufb256(table, (c32v)((s16v)b >> 4) & m);
    const s16v one = (s16v)((short16)(1));
    const s16v p0 = __builtin_ia32_pmaddubsw256(__builtin_ia32_psignb256(lo, lo),
                                                __builtin_ia32_psignb256(x->even, lo));
    const s16v p1 = __builtin_ia32_pmaddubsw256(__builtin_ia32_psignb256(hi, hi),
                                                __builtin_ia32_psignb256(x->odd, hi));
    return as_int8(__builtin_ia32_pmaddwd256(p0, one)) + as_int8(__builtin_ia32_pmaddwd256(p1, one));
}

/* The same for an int8 row (64 bytes at w, x in column order): vpmaddubsw of |c| with q signed like c (at most
 * 2 * 128 * 127 per 16-bit lane), each half widened by vpmaddwd before the two are added. */
INLINE int8 block_dot8(const __global uchar* w, const x8_block* x) {
    const c32v w0 = ((const __global c32v_u*)w)[0].v, w1 = ((const __global c32v_u*)w)[1].v;
    const c32v a0 = w0 < (c32v)((char32)(0)) ? -w0 : w0, a1 = w1 < (c32v)((char32)(0)) ? -w1 : w1;
    const s16v one = (s16v)((short16)(1));
    const s16v p0 = __builtin_ia32_pmaddubsw256(a0, __builtin_ia32_psignb256(x->even, w0));
    const s16v p1 = __builtin_ia32_pmaddubsw256(a1, __builtin_ia32_psignb256(x->odd, w1));
    return as_int8(__builtin_ia32_pmaddwd256(p0, one)) + as_int8(__builtin_ia32_pmaddwd256(p1, one));
}
#else
typedef struct { short16 c0, c1, c2, c3; } x8_block;

INLINE x8_block load_x8(const __global char* q) {
    const x8_block b = {convert_short16(vload16(0, q)), convert_short16(vload16(1, q)),
                        convert_short16(vload16(2, q)), convert_short16(vload16(3, q))};
    return b;
}

INLINE int8 block_dot(const __global uchar* w, const x8_block* x) {
    const ushort16 v = vload16(0, (const __global ushort*)w), m = (ushort16)(15);
    const short16 p = as_short16(v & m) * x->c0 + as_short16((v >> (ushort16)4) & m) * x->c1
                    + as_short16((v >> (ushort16)8) & m) * x->c2 + as_short16(v >> (ushort16)12) * x->c3;
    return convert_int8(p.lo) + convert_int8(p.hi);
}

/* nl4: the nibbles' levels times the codes, each product (at most 127 * 127) widened before the sum. */
INLINE int8 block_dot_nl4(const __global uchar* w, const x8_block* x) {
    const ushort16 v = vload16(0, (const __global ushort*)w), m = (ushort16)(15);
    const int16 p = convert_int16(convert_short16(nl4_values16(convert_uchar16(v & m))) * x->c0)
                  + convert_int16(convert_short16(nl4_values16(convert_uchar16((v >> (ushort16)4) & m))) * x->c1)
                  + convert_int16(convert_short16(nl4_values16(convert_uchar16((v >> (ushort16)8) & m))) * x->c2)
                  + convert_int16(convert_short16(nl4_values16(convert_uchar16(v >> (ushort16)12))) * x->c3);
    return p.lo + p.hi;
}

/* int3 (x in column order: c0..c3 = columns 16m .. 16m + 15): stored values 0..7 times the codes, in 16 bits. */
INLINE int8 block_dot3(const __global uchar* w, const x8_block* x) {
    const uchar16 low = vload16(0, w), m3 = (uchar16)3;
    const uchar8 high = vload8(0, w + 16), one = (uchar8)1;
    short16 p = (short16)(0);
    for (uint m = 0; m < 4; m++) {
        const uchar16 hi = (uchar16)((high >> (uchar8)(2u * m)) & one, (high >> (uchar8)(2u * m + 1u)) & one);
        const short16 v = convert_short16(((low >> (uchar16)(2u * m)) & m3) | (hi << (uchar16)2));
        p += v * (m == 0 ? x->c0 : m == 1 ? x->c1 : m == 2 ? x->c2 : x->c3);
    }
    return convert_int8(p.lo) + convert_int8(p.hi);
}

INLINE int8 block_dot8(const __global uchar* w, const x8_block* x) {
    const __global char* c = (const __global char*)w;
    const int16 p = convert_int16(convert_short16(vload16(0, c)) * x->c0)
                  + convert_int16(convert_short16(vload16(1, c)) * x->c1)
                  + convert_int16(convert_short16(vload16(2, c)) * x->c2)
                  + convert_int16(convert_short16(vload16(3, c)) * x->c3);  /* a product: at most 128 * 127 */
    return p.lo + p.hi;
}
#endif

/* One block of 64 floats at xp -> its codes at qp (128 bytes: both orders above), scale *s, code sum *qsum. */
INLINE void quantize_block(const __global float* xp, __global char* qp, __global float* s, __global int* qsum) {
    float8 v[8];
    float8 m8 = (float8)(0.0f);
    for (uint i = 0; i < 8; i++) {
        v[i] = LOAD_F8(i, xp);
        m8 = fmax(m8, fabs(v[i]));
    }
    const float4 m4 = fmax(m8.lo, m8.hi);
    const float m = fmax_(fmax_(m4.x, m4.y), fmax_(m4.z, m4.w));
    const float inv = m > 0.0f ? 127.0f / m : 0.0f;
    int8 sum = (int8)(0);
    for (uint i = 0; i < 4; i++) {  /* columns 16i .. 16i + 15 */
        const int8 lo = convert_int8(rint(v[2 * i] * inv)), hi = convert_int8(rint(v[2 * i + 1] * inv));
        sum += lo + hi;  /* rint: halves to even, as NumPy; |x| * inv <= 127 */
#ifdef X8_PAIRS
        vstore8(convert_char8((int8)(lo.even, hi.even)), i, qp);
        vstore8(convert_char8((int8)(lo.odd, hi.odd)), 4 + i, qp);
#else
        vstore4(convert_char4((int4)(lo.s04, hi.s04)), i, qp);
        vstore4(convert_char4((int4)(lo.s15, hi.s15)), 4 + i, qp);
        vstore4(convert_char4((int4)(lo.s26, hi.s26)), 8 + i, qp);
        vstore4(convert_char4((int4)(lo.s37, hi.s37)), 12 + i, qp);
#endif
        vstore8(convert_char8(lo), 8 + 2 * i, qp);
        vstore8(convert_char8(hi), 9 + 2 * i, qp);
    }
    const int4 s4 = sum.lo + sum.hi;
    *s = m * (1.0f / 127.0f);  /* a product: correctly rounded on every device (GPU divisions need not be) */
    *qsum = s4.x + s4.y + s4.z + s4.w;
}

/* rows_dot for int3, int4, nl4 or int8 rows (bits; group a multiple of 64) and int8-quantized x: codes xq (128
 * bytes per block), scales xs and code sums xsum per block. n: a multiple of 64. Read ahead: a block is 24 (int3),
 * 32 (int4, nl4) or 64 (int8) bytes of each of ROWS rows, so 1, 2 or 4 lines per block. */
INLINE void rows_dot_x8(const int bits, const int sets, const __global uchar* row, const __global uchar* row2,
                        uint row_bytes, const __global float* sc, const __global float* sc2, uint n_groups,
                        uint nrows, uint n, uint group, const __global char* xq, const __global float* xs, const __global int* xsum,
                        uint lane, float* out, const __global uchar* ahead, const __global uchar* ahead2,
                        uint ahead_bytes) {
    const __global uchar* rk[2 * ROWS];
    const __global float* sk[2 * ROWS];
    float8 acc[2 * ROWS];
    row_sets(sets, row, row2, row_bytes, sc, sc2, n_groups, nrows, rk, sk, acc);
    const uint blocks = n / 64u, per = group / 64u;
    const uint lines = STORED_BITS(bits) / 2u, row_block = STORED_BITS(bits) * 8u;  /* int3: 1 line, 24 bytes */
    const bool ahead_far = AHEAD_FAR(sets, row_bytes);
    for (uint c = lane; c < blocks; c += LANES) {
        const x8_block xb = load_x8(xq + 128u * c + (STORED_BITS(bits) == 4 ? 0u : 64u));
        /* int4: 8 lanes of xsum, 8 * xsum in their total; int3: 4 lanes, 4 * xsum; nl4 and int8: none */
        const int8 bias = bits == 4 ? (int8)(xsum[c]) : (bits == 3 ? (int8)((int4)(xsum[c]), (int4)(0)) : (int8)(0));
        const float s = xs[c];
        const uint gi = c / per;
        for (uint t = 0; t < lines; t++) READ_AHEAD(lines * c + t);  /* the next item's rows */
        if (ahead_bytes && c * 16u < ROWS * n_groups) {  /* and their scales: ROWS * n_groups floats per set */
            PREFETCH(sc + ROWS * n_groups + c * 16u);
            if (sets == 2) PREFETCH(sc2 + ROWS * n_groups + c * 16u);
        }
#pragma unroll  /* the accumulators stay in registers (rolled, they live on the stack) */
        for (uint k = 0; k < sets * ROWS; k++) {
            const __global uchar* wk = rk[k] + row_block * c;
            const int8 dot = bits == 4 ? block_dot(wk, &xb) : bits == NL4 ? block_dot_nl4(wk, &xb)
                           : bits == 3 ? block_dot3(wk, &xb) : block_dot8(wk, &xb);
            acc[k] += convert_float8(dot - bias) * (sk[k][gi] * s);
        }
    }
    for (uint k = 0; k < sets * ROWS; k++) {
        if (k % ROWS >= nrows) continue;
        out[k] = hsum8(acc[k]);
    }
}

/* silu(g) = g * sigmoid(g); exp(-g) overflowing to inf gives 0, as in NumPy. */
INLINE float silu(float g) {
    return g * (1.0f / (1.0f + exp(-g)));
}

INLINE float4 silu4(float4 g) {  /* one vector exp: four scalar calls cost ~12% of the int8-input gate+up kernel */
    return g * (1.0f / (1.0f + exp(-g)));
}
