// ---- common/pdl.cuh: programmatic dependent launch (sm_90+) ----
// A kernel launched with the programmatic-serialization attribute (launch.BoundLaunch with
// programmatic=True) may start once every block of the kernel before it in the stream has called
// pdl_launch_dependents() or exited; its pdl_wait() returns when that kernel has finished and its
// writes are visible. In a kernel launched normally both return at once. Every block of a
// dependent kernel must reach pdl_wait(): the kernel then cannot finish before the one it
// depends on.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
