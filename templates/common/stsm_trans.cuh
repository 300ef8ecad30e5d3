{# ---- common/stsm_trans.cuh: stmatrix .x4 .trans (smem_address from common/mma.cuh.j2). Written
   after a Jinja comment, which renders to nothing: the kernels that include this file render the
   same source as the copy it replaced (their tuned entries stay current). ---- #}// Four 8 x 8 matrices of 16-bit elements from the warp's fragments (matrix m from register m),
// each stored transposed: lane 8m + i gives the address of row i of matrix m.
__device__ __forceinline__ void stmatrix_x4_trans(const void* row, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], { %1, %2, %3, %4 };\n"
                 ::"r"(smem_address(row)), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
