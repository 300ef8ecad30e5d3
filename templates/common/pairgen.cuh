// ---- common/pairgen.cuh: helpers shared by every pairgen kernel ----
// Self-contained for NVRTC (no system headers): fixed-width types by hand.
typedef long long i64;  // element offsets; pair and tile indices are int (see upper_triangle_decode)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum over aligned groups of `width` lanes (width a power of two <= 32).
template <int width>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int offset = width / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Accurate expf; the division as __fdividef (<= 2 ulp; 0 once the denominator passes 2^126,
// where the true value is below 1e-38): IEEE division's slow-path call made ptxas spill a
// register around it.
__device__ __forceinline__ float sigmoid(float v) { return __fdividef(1.0f, 1.0f + expf(-v)); }

__device__ __forceinline__ float float4_get(const float4& v, int e) {
    // e is a compile-time constant after unrolling, so this folds to one register.
    return e == 0 ? v.x : (e == 1 ? v.y : (e == 2 ? v.z : v.w));
}

// Upper triangle (row <= col) of an n x n grid, enumerated row by row:
// row q starts at q*n - q*(q-1)/2. Inverts that with the quadratic formula, then corrects the
// rounding exactly in integers. The discriminant is formed in double (exact: no cancellation
// near the end of the triangle, and always >= 1); its square root as d * rsqrtf(d), which has
// no slow-path subroutine: the calls of IEEE sqrt forced a register spill around them.
// Indices are 32-bit: the module only launches when B*N*N < 2^31.
__device__ __forceinline__ void upper_triangle_decode(int r, int n, int& row, int& col) {
    const double b = 2.0 * (double)n + 1.0;
    const float disc = (float)(b * b - 8.0 * (double)r);
    int q = (int)((b - (double)(disc * rsqrtf(disc))) * 0.5);
    if (q < 0) q = 0;
    if (q > n - 1) q = n - 1;
    while (q > 0 && q * n - q * (q - 1) / 2 > r) --q;
    while (q + 1 < n && (q + 1) * n - (q + 1) * q / 2 <= r) ++q;
    row = q;
    col = q + (r - (q * n - q * (q - 1) / 2));
}

// Copies n floats (n % 4 == 0, both pointers 16-byte aligned) with the whole block. Loads are
// issued in batches before their stores: a plain load-store loop waited one L2 round trip per
// float4 (13 in a row per thread for the seed shape's weights) before a block did any work.
__device__ __forceinline__ void block_copy4(float* dst, const float* __restrict__ src, int n) {
    constexpr int BATCH = 8;
    const int step = blockDim.x * 4;
    for (int base = threadIdx.x * 4; base < n; base += step * BATCH) {
        float4 v[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int i = base + u * step;
            v[u] = i < n ? __ldg(reinterpret_cast<const float4*>(src + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int i = base + u * step;
            if (i < n) *reinterpret_cast<float4*>(dst + i) = v[u];
        }
    }
}
