// ---- common/grid_barrier.cuh: a grid-wide barrier for cooperative launches ----
// Sense-reversing, on two ints the caller owns: bar[0] counts arrivals, bar[1] is the sense.
// Zero them once when the buffer is made; each barrier leaves the count at 0 again, so
// launches need no memset between them. The grid must be co-resident (cuLaunchCooperativeKernel):
// a block that is not yet running can never arrive, and the others would spin for ever.
// Every thread of every block must call it (it holds __syncthreads()).
__device__ __forceinline__ void grid_barrier(int* bar) {
    __syncthreads();  // the whole block's writes are issued before thread 0 arrives
    if (threadIdx.x == 0) {
        volatile int* sense = bar + 1;
        // Read before arriving: the sense can flip only after every block, this one included, arrived.
        const int mine = *sense;
        __threadfence();  // this block's writes are visible device-wide before it counts as arrived
        if (atomicAdd(bar, 1) == (int)gridDim.x - 1) {
            atomicExch(bar, 0);  // reset for the next barrier or launch, before releasing anyone
            __threadfence();
            atomicExch(bar + 1, 1 - mine);
        } else {
            while (*sense == mine) {
            }
        }
        __threadfence();  // acquire: nothing below is read before the release was seen
    }
    __syncthreads();
}
