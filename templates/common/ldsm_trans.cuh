{# ---- common/ldsm_trans.cuh: ldmatrix .x4 .trans from a shared-memory address (smem_address):
   lane (row g, word t) of each 8 x 8 matrix gets its elements (2t, g) and (2t + 1, g). Written as
   a Jinja comment, which renders to nothing: the kernels that include this file render the same
   source as the copy it replaced (their tuned entries stay current). ---- #}__device__ __forceinline__ void ldsm_x4_trans(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
