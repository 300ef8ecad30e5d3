// ---- common/block_roles.cuh: producer blocks, then consumer blocks, in one launch ----
// Blocks 0 .. producers-1 of the grid write data that the others, the consumers, read. In one
// cooperative launch (every block resident at once, so a consumer never waits on a block that
// cannot run) a consumer starts its own loads and waits here for the producers only, not for
// every block as at a grid-wide barrier. Where the grid cannot be resident at once the caller
// launches the kernel twice instead, producers then consumers, and nobody waits.
// `done` is one int the caller owns, zeroed once when made: it counts finished producers, then
// consumers that saw them all, and the last such consumer resets it, so each launch leaves it at
// 0 again and launches (stream-ordered, never overlapping on the same int) need no memset.

// Every thread of a producer block, after its last write: the writes are visible device-wide
// before the block counts as done.
__device__ __forceinline__ void producer_done(int* done) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(done, 1);
    }
}

// Every thread of a consumer block, once: returns when all `producers` are done and their writes
// are visible to this block's ordinary loads (consumer_load; not __ldg, whose non-coherent path
// assumes data that no block of the launch writes).
__device__ __forceinline__ void await_producers(int* done, int producers, int consumers) {
    if (threadIdx.x == 0) {
        volatile int* count = done;
        while (*count < producers) {
        }
        __threadfence();  // acquire: nothing below is read before the producers' release was seen
        if (atomicAdd(done, 1) == producers + consumers - 1) atomicExch(done, 0);
    }
    __syncthreads();
}

// A load of data the producers wrote, after await_producers (or in a later launch): an ordinary
// load, ordered after their writes by thread 0's fence and the block barrier, and cached in L1
// for the loads that follow (an L2-only __ldcg made each pair block's repeated reads L2 round trips).
__device__ __forceinline__ float4 consumer_load(const float4* p) { return *p; }
