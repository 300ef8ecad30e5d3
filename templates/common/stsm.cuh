{# ---- common/stsm.cuh: stmatrix .x4, not transposed (smem_address from common/mma.cuh.j2). ---- #}// Four 8 x 8 matrices of 16-bit elements from the warp's fragments (matrix m from register m),
// stored as they are: lane 8m + i gives the address of row i of matrix m.
__device__ __forceinline__ void stmatrix_x4(const void* row, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], { %1, %2, %3, %4 };\n"
                 ::"r"(smem_address(row)), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
