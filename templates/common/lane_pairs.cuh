// ---- common/lane_pairs.cuh: an mma accumulator row regrouped as four adjacent columns a lane ----
// In mma.sync's m16n8 layout lane t (lane % 4) of a row's quad holds columns 2t and 2t + 1 of each
// 8-column tile: a tile's store gives a lane 4 bytes (16-bit) and a warp half sectors. Lane pairs
// (t, t ^ 1) swap one value of two adjacent tiles (the even lane keeps the left tile's, the odd the
// right's), after which a lane holds four adjacent columns of the 16, from adjacent_column(t).

__device__ __forceinline__ int adjacent_column(int t) { return 4 * (t >> 1) + 8 * (t & 1); }

// left, right: this lane's value (a packed pair of columns, or one column of each pair) of the left
// and the right 8-column tile; first, second: the lane's two values in column order. Every lane of
// the warp calls it (a shuffle).
template <class T>
__device__ __forceinline__ void swap_to_adjacent(T left, T right, int t, T& first, T& second) {
    const bool odd = t & 1;
    const T got = __shfl_xor_sync(0xffffffffu, odd ? left : right, 1);
    first = odd ? got : left;
    second = odd ? right : got;
}
