// ReLU that keeps NaN, as torch.relu does: fmaxf(NaN, 0) is 0, which would turn a NaN pair
// feature into a finite contact probability. max.NaN is one instruction (sm_80+), as fmaxf's.
__device__ __forceinline__ float relu(float v) {
#if __CUDA_ARCH__ >= 800
    float r;
    asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(r) : "f"(v));
    return r;
#else
    return v < 0.0f ? 0.0f : v;  // false for NaN: NaN passes
#endif
}
