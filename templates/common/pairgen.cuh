// ---- common/pairgen.cuh: helpers shared by every pairgen kernel ----
// Self-contained for NVRTC (no system headers): fixed-width types by hand.
typedef long long i64;

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

__device__ __forceinline__ float sigmoidf_exact(float v) { return 1.0f / (1.0f + expf(-v)); }

__device__ __forceinline__ float float4_get(const float4& v, int e) {
    // e is a compile-time constant after unrolling, so this folds to one register.
    return e == 0 ? v.x : (e == 1 ? v.y : (e == 2 ? v.z : v.w));
}

// Upper triangle (row <= col) of an n x n grid, enumerated row by row:
// row q starts at q*n - q*(q-1)/2. Inverts that with a double sqrt, then corrects rounding.
__device__ __forceinline__ void upper_triangle_decode(i64 r, i64 n, i64& row, i64& col) {
    const double b = 2.0 * (double)n + 1.0;
    i64 q = (i64)((b - sqrt(b * b - 8.0 * (double)r)) * 0.5);
    if (q < 0) q = 0;
    if (q > n - 1) q = n - 1;
    while (q > 0 && q * n - q * (q - 1) / 2 > r) --q;
    while (q + 1 < n && (q + 1) * n - (q + 1) * q / 2 <= r) ++q;
    row = q;
    col = q + (r - (q * n - q * (q - 1) / 2));
}

// Copies n floats (n % 4 == 0, both pointers 16-byte aligned) with the whole block.
__device__ __forceinline__ void block_copy4(float* dst, const float* __restrict__ src, int n) {
    for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4)
        *reinterpret_cast<float4*>(dst + i) = __ldg(reinterpret_cast<const float4*>(src + i));
}
