{# ---- common/fast_tanh.cuh: the hardware's tanh (tanh.approx.f32: about 2^-11 relative error, one
   instruction), for sigmoids written as (1 + tanh(v / 2)) / 2 where the result is rounded to 16
   bits. Written after a Jinja comment, which renders to nothing: the kernels that include this
   file render the same source as the copy it replaced (their tuned entries stay current). ---- #}__device__ __forceinline__ float fast_tanh(float v) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(v));
    return t;
}
