// ---- common/tile_gemm.cuh: register-tiled product of a shared-memory tile and a weight ----
//   acc[r][c] += sum_k A[m(r)][k] * Bt[k][n(c)]
// A   : shared memory, row-major, row stride A_STRIDE floats. A_STRIDE % 32 == 4 makes the
//       float4 reads of the THREADS_M consecutive rows that one warp touches land in distinct
//       banks (rows are strided: m(r) = r*THREADS_M + tm).
// Bt  : the weight in k-major layout [K][NCOLS] (nn.Linear's W transposed, done once in Python),
//       in shared memory (B_IN_SMEM) or global memory read through the read-only cache.
// Thread (tm, tn) owns rows m(r) = r*THREADS_M + tm, r < TM, and columns
// n(g, e) = g*THREADS_N*4 + tn*4 + e, g < TN/4, e < 4: a warp's float4 reads of one weight row
// are contiguous, so each takes the minimum number of shared-memory wavefronts.
// Every loop that indexes a register array is unrolled, so nothing goes to local memory.
template <bool B_IN_SMEM>
__device__ __forceinline__ float4 load_weight4(const float* p) {
    if (B_IN_SMEM) return *reinterpret_cast<const float4*>(p);
    return __ldg(reinterpret_cast<const float4*>(p));
}

template <int K, int NCOLS, int TM, int TN, int THREADS_M, int THREADS_N, int A_STRIDE,
          int UNROLL, bool B_IN_SMEM>
__device__ __forceinline__ void tile_gemm(const float* A, const float* Bt, int tm, int tn,
                                          float (&acc)[TM][TN]) {
    static_assert(K % 4 == 0 && TN % 4 == 0, "K and TN must be multiples of 4");
#pragma unroll UNROLL
    for (int k = 0; k < K; k += 4) {
        float4 a[TM];
#pragma unroll
        for (int r = 0; r < TM; ++r)
            a[r] = *reinterpret_cast<const float4*>(A + (r * THREADS_M + tm) * A_STRIDE + k);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int g = 0; g < TN / 4; ++g) {
                const float4 b = load_weight4<B_IN_SMEM>(Bt + (k + kk) * NCOLS + g * THREADS_N * 4 + tn * 4);
#pragma unroll
                for (int r = 0; r < TM; ++r) {
                    const float av = float4_get(a[r], kk);
                    acc[r][g * 4 + 0] = fmaf(av, b.x, acc[r][g * 4 + 0]);
                    acc[r][g * 4 + 1] = fmaf(av, b.y, acc[r][g * 4 + 1]);
                    acc[r][g * 4 + 2] = fmaf(av, b.z, acc[r][g * 4 + 2]);
                    acc[r][g * 4 + 3] = fmaf(av, b.w, acc[r][g * 4 + 3]);
                }
            }
        }
    }
}

// Column index owned by slot c of thread tn (see above).
template <int THREADS_N>
__device__ __forceinline__ int tile_col(int tn, int c) {
    return (c / 4) * THREADS_N * 4 + tn * 4 + (c % 4);
}
