// ---- common/wgmma_rows.cuh: a warpgroup's 64-row results as the next product's A operand, as
// rows in global memory, weights staged transposed as B operands, and sums over the rows of its
// accumulators (a row LayerNorm's statistics and affine gradients) ----
{% include "common/lane_pairs.cuh" %}
// Needs elem_t, pack2 and elem_to_float (common/mma.cuh.j2), operand_offset (common/wgmma.cuh.j2),
// cp_async16 (common/cp_async.cuh) and the kernel's THREADS and TILE_ROWS (64: a warpgroup's rows).

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
// fragments, 8 bytes (four adjacent columns: swap_to_adjacent) a lane, so that a row's four lanes
// write whole 32-byte sectors. Every lane of the warp must call it (the swaps).
template <int COLS>
__device__ __forceinline__ void store_rows(elem_t* __restrict__ out, const unsigned (&f)[COLS / 16][4], i64 row,
                                           i64 pairs, int t) {
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
        const i64 r = row + 8 * h2;
#pragma unroll
        for (int k = 0; k < COLS / 16; ++k) {
            uint2 four;
            swap_to_adjacent(f[k][h2], f[k][2 + h2], t, four.x, four.y);  // columns 16 k + 2 t, and 8 past them
            if (r < pairs) *reinterpret_cast<uint2*>(out + r * COLS + 16 * k + adjacent_column(t)) = four;
        }
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

// Channel-major tiles of a channels-first (B, channels, plane) tensor (the triangle sums and their
// gradients, the projections' gradients): COUNT channels from channel c0 of the pairs
// [first, first + TILE_ROWS), a row of STRIDE values a channel, moved by one warpgroup (tid its
// thread). `pieces` (plane a multiple of 8, the tensor 16-byte aligned): 8 pairs of a channel a
// 16-byte access (a piece never straddles two batches); else value by value.
__device__ __forceinline__ i64 channel_offset(i64 m, int c, int channels, i64 plane) {
    const i64 b = m / plane;
    return (b * channels + c) * plane + (m - b * plane);
}

// Where pair r of channel c lies in such a tile: at r of the channel's row of STRIDE values; rows of
// exactly TILE_ROWS (64) values are swizzled instead of padded: the 8-pair piece p of channel c at
// piece p ^ (c % 8), so that one piece of 8 consecutive channels (what a transposing ldmatrix reads)
// falls in 8 distinct bank groups.
template <int STRIDE>
__device__ __forceinline__ int channel_slot(int c, int r) {
    if (STRIDE == TILE_ROWS) return c * TILE_ROWS + ((((r >> 3) ^ c) & 7) << 3) + (r & 7);
    return c * STRIDE + r;
}

// The tile from global memory, pieces through cp.async (the caller commits), single values
// synchronously; pairs past `pairs` stage 0.
template <int COUNT, int STRIDE>
__device__ __forceinline__ void fetch_channels(elem_t* tile, const elem_t* __restrict__ src, int c0, int channels,
                                               i64 first, i64 pairs, i64 plane, int pieces, int tid) {
    if (pieces) {
        for (int i = tid; i < COUNT * (TILE_ROWS / 8); i += 128) {
            const int c = i / (TILE_ROWS / 8), piece = i - c * (TILE_ROWS / 8);
            const i64 m = first + 8 * piece;
            cp_async16(tile + channel_slot<STRIDE>(c, 8 * piece),
                       src + (m < pairs ? channel_offset(m, c0 + c, channels, plane) : 0),
                       m < pairs);
        }
        return;
    }
    for (int i = tid; i < COUNT * TILE_ROWS; i += 128) {
        const int c = i / TILE_ROWS, r = i - c * TILE_ROWS;
        const i64 m = first + r;
        tile[channel_slot<STRIDE>(c, r)] = m < pairs ? src[channel_offset(m, c0 + c, channels, plane)] : (elem_t)0;
    }
}

// The tile back to global memory (all of the tensor's channels: c0 0), pairs past `pairs` not written.
template <int COUNT, int STRIDE>
__device__ __forceinline__ void store_channels(const elem_t* tile, elem_t* __restrict__ dst, i64 first, i64 pairs,
                                               i64 plane, int pieces, int tid) {
    if (pieces) {
        for (int i = tid; i < COUNT * (TILE_ROWS / 8); i += 128) {
            const int c = i / (TILE_ROWS / 8), piece = i - c * (TILE_ROWS / 8);
            const i64 m = first + 8 * piece;
            if (m < pairs)
                *reinterpret_cast<uint4*>(dst + channel_offset(m, c, COUNT, plane)) =
                    *reinterpret_cast<const uint4*>(tile + channel_slot<STRIDE>(c, 8 * piece));
        }
        return;
    }
    for (int i = tid; i < COUNT * TILE_ROWS; i += 128) {
        const int c = i / TILE_ROWS, r = i - c * TILE_ROWS;
        if (first + r < pairs) dst[channel_offset(first + r, c, COUNT, plane)] = tile[channel_slot<STRIDE>(c, r)];
    }
}
