// ---- common/cp_async.cuh: asynchronous global -> shared copies (sm_80+) ----
// A thread issues all its copies, commits them as one group, and later waits for the groups it
// needs: every byte a block stages is in flight at once, so the block pays one memory round
// trip. Register loads cannot promise that: ptxas sank 12 of a lane's 32 LayerNorm loads behind
// the shuffles of earlier rows (contact seed variant, SASS), four round trips instead of one.
// .cg caches in L2 only: staged rows are read once from shared memory, never again from L1.

// Copies 16 bytes, or writes 16 zero bytes when !fill (src is then not read but must be a valid
// global address). Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool fill) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(fill ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `pending` of this thread's committed groups are still in flight. Other
// threads' copies become visible only after a __syncthreads() that follows the wait.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
}

// Stages n floats (n % 4 == 0, both pointers 16-byte aligned) with the whole block.
__device__ __forceinline__ void block_cp_async4(float* dst, const float* src, int n) {
    for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4) cp_async16(dst + i, src + i, true);
}
