// ---- common/layernorm.cuh: one warp normalises one row of WIDTH floats ----
// Lane l holds elements l, l+32, l+64, ... (PER_LANE of them); out-of-range slots hold 0.
// Call normalize() from every lane of the warp, never under a branch the compiler cannot prove
// warp-uniform: shuffles under `if (valid)` compiled to the WARPSYNC/ENDCOLLECTIVE emulation
// loop (80 of them in one kernel's SASS). Rows that do not exist load as zeros instead.
// Two-pass statistics (mean, then mean squared deviation) from registers: the one-pass
// E[x^2]-E[x]^2 form loses digits on heavy-tailed rows. Biased variance, as nn.LayerNorm.
template <int WIDTH>
struct WarpRow {
    static constexpr int PER_LANE = (WIDTH + 31) / 32;
    float v[PER_LANE];

    __device__ __forceinline__ void load(const float* __restrict__ row, int lane, bool exists) {
#pragma unroll
        for (int t = 0; t < PER_LANE; ++t) {
            const int c = lane + 32 * t;
            v[t] = (exists && c < WIDTH) ? __ldg(row + c) : 0.0f;
        }
    }

    // Replaces v by (v - mean) * rstd; out-of-range slots stay 0.
    __device__ __forceinline__ void normalize(int lane, float eps) {
        float s = 0.0f;
#pragma unroll
        for (int t = 0; t < PER_LANE; ++t) s += v[t];
        const float mean = warp_sum(s) * (1.0f / WIDTH);
        float ss = 0.0f;
#pragma unroll
        for (int t = 0; t < PER_LANE; ++t) {
            const int c = lane + 32 * t;
            v[t] = (c < WIDTH) ? v[t] - mean : 0.0f;
            ss += v[t] * v[t];
        }
        // rsqrtf (<= 2 ulp) rather than 1/sqrtf: no slow-path call, no spill around it.
        const float rstd = rsqrtf(warp_sum(ss) * (1.0f / WIDTH) + eps);
#pragma unroll
        for (int t = 0; t < PER_LANE; ++t) v[t] *= rstd;
    }
};
