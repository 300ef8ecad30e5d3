// ---- common/tile_map.cuh: where thread (tm, tn) of a tile_gemm layout sits in the block ----
// A warp holds LANES_M consecutive rows (lanes fastest) times 32/LANES_M column groups.
// With LANES_M = 8 a warp's float4 reads of A (rows r*THREADS_M + tm, A_STRIDE % 32 == 4) hit
// 8 distinct bank quads (one wavefront), its B reads are 4 contiguous float4 (one wavefront), and
// a store of one column for the warp's rows writes 8 consecutive floats: a full 32-byte sector
// when the output is laid out along rows (the triangle update's (B*H, N, N) scratch).
// Needs THREADS_M % LANES_M == 0 and THREADS_N % (32 / LANES_M) == 0 (checked in Python).
template <int THREADS_M, int THREADS_N, int LANES_M>
__device__ __forceinline__ void tile_thread(int tid, int& tm, int& tn) {
    constexpr int LANES_N = 32 / LANES_M;
    constexpr int WARPS_M = THREADS_M / LANES_M;
    static_assert(32 % LANES_M == 0 && THREADS_M % LANES_M == 0 && THREADS_N % LANES_N == 0, "lane layout");
    const int lane = tid & 31, warp = tid >> 5;
    tm = (warp % WARPS_M) * LANES_M + lane % LANES_M;
    tn = (warp / WARPS_M) * LANES_N + lane / LANES_M;
}
