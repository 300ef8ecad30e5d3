// ---- common/wgmma_rows.cuh: a warpgroup's 64-row results as the next product's A operand, as
// rows in global memory, weights staged transposed as B operands, and sums over the rows of its
// accumulators (a row LayerNorm's statistics and affine gradients) ----
// Needs elem_t, pack2 and elem_to_float (common/mma.cuh.j2), operand_offset (common/wgmma.cuh.j2)
// and the kernel's THREADS.

// Shared-memory regions 1024-byte aligned (the operand layouts' alignment).
__host__ __device__ constexpr int align1k(int bytes) { return (bytes + 1023) / 1024 * 1024; }

// B operand rows n of W^T (n < COLS, k < ROWS) from W [ROWS][COLS] (nn.Linear's [out][in]), element
// by element: once per block, so its uncoalesced reads do not matter.
template <int ROWS, int COLS>
__device__ __forceinline__ void stage_transposed(unsigned char* dst, const elem_t* __restrict__ w) {
    for (int i = threadIdx.x; i < ROWS * COLS; i += THREADS) {
        const int k = i / COLS, n = i - k * COLS;
        *reinterpret_cast<elem_t*>(dst + operand_offset<ROWS / 8, COLS, false>(n, k >> 3) + (k & 7) * 2) = w[i];
    }
}

// This thread's accumulators (rows ra, ra + 8; columns 8j + 2t, + 1) as 16-bit A fragments of the
// next product: columns 16kk .. 16kk + 15 are fragment kk (common/wgmma.cuh.j2, wgmma_rs).
template <int COLS>
__device__ __forceinline__ void to_fragments(unsigned (&f)[COLS / 16][4], const float (&v)[COLS / 2]) {
#pragma unroll
    for (int j = 0; j < COLS / 8; ++j)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) f[j / 2][2 * (j % 2) + h2] = pack2(v[4 * j + 2 * h2], v[4 * j + 2 * h2 + 1]);
}

// Element (row h2, column e) of fragment word j's pair, as float.
template <int COLS>
__device__ __forceinline__ float fragment_value(const unsigned (&f)[COLS / 16][4], int j, int h2, int e) {
    const unsigned word = f[j / 2][2 * (j % 2) + h2];
    return elem_to_float((elem_t)(e ? word >> 16 : word & 0xFFFFu));
}

// Rows `row` and `row` + 8 (past `pairs`: not written) of a [pairs][COLS] tensor from this thread's
// fragments.
template <int COLS>
__device__ __forceinline__ void store_rows(elem_t* __restrict__ out, const unsigned (&f)[COLS / 16][4], i64 row,
                                           i64 pairs, int t) {
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
        const i64 r = row + 8 * h2;
        if (r >= pairs) continue;
#pragma unroll
        for (int j = 0; j < COLS / 8; ++j)
            *reinterpret_cast<unsigned*>(out + r * COLS + 8 * j + 2 * t) = f[j / 2][2 * (j % 2) + h2];
    }
}

// Sum over the quad (the four threads that hold one accumulator row's columns).
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Adds one column's sums over this thread's two rows (d gamma, d beta of a LayerNorm's backward) to
// the warp's sums in shared memory ([2][COLS]: d gamma, then d beta): summed over the warp's 8 row
// groups by shuffles, then one lane a column adds them (no two lanes or warps share a slot).
template <int COLS>
__device__ __forceinline__ void add_column_sums(float* warp_sums, int col, float d_gamma, float d_beta, int lane) {
#pragma unroll
    for (int offset = 4; offset < 32; offset <<= 1) {
        d_gamma += __shfl_xor_sync(0xffffffffu, d_gamma, offset);
        d_beta += __shfl_xor_sync(0xffffffffu, d_beta, offset);
    }
    if ((lane >> 2) == 0) warp_sums[col] += d_gamma, warp_sums[COLS + col] += d_beta;
}

// The block's sums ([2][COLS] at block_sums[blockIdx.x]): every warp's, added in a fixed order (the
// caller adds the blocks: deterministic). After a __syncthreads.
template <int COLS>
__device__ __forceinline__ void store_block_sums(const float* all_warp_sums, int warps, float* __restrict__ block_sums) {
    for (int i = threadIdx.x; i < 2 * COLS; i += THREADS) {
        float total = 0.0f;
        for (int w = 0; w < warps; ++w) total += all_warp_sums[w * 2 * COLS + i];
        block_sums[(i64)blockIdx.x * 2 * COLS + i] = total;
    }
}
