// ---- common/arrival_order.cuh: roles by arrival, producers before consumers, in one launch ----
// One plain launch whose first `producers` blocks to start produce data that the rest consume.
// Each block takes a ticket from a counter as it starts; tickets below `producers` are producer
// roles, the others consumer roles. A consumer waits only for tickets taken before its own,
// by blocks already running, so it never waits on a block that cannot be scheduled: unlike a
// grid-wide barrier, the grid need not be resident at once (no cooperative launch), and the
// consumers may start their own loads (weights) while the producers run.
// `order` is two ints the caller owns, zeroed once when made: order[0] the ticket counter, reset
// by the block that takes the last ticket; order[1] counts finished producers, then consumers
// that saw them all, and the last such consumer resets it. Each launch leaves both at 0 again,
// so launches (stream-ordered, never overlapping on the same ints) need no memset between them.

// Thread 0 only: this block's ticket (0 .. blocks-1, in the order blocks arrive).
__device__ __forceinline__ int take_ticket(int* order, int blocks) {
    const int ticket = atomicAdd(order, 1);
    if (ticket == blocks - 1) atomicExch(order, 0);  // every block of this launch holds its ticket
    return ticket;
}

// Every thread of a producer block, after its last write: the writes are visible device-wide
// before the block counts as done.
__device__ __forceinline__ void producer_done(int* order) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(order + 1, 1);
    }
}

// Every thread of a consumer block: returns once all `producers` are done and their writes are
// visible to this block's ordinary loads (consumer_load; not __ldg, whose non-coherent path
// assumes data no block of the launch writes).
__device__ __forceinline__ void await_producers(int* order, int producers, int consumers) {
    if (threadIdx.x == 0) {
        volatile int* done = order + 1;
        while (*done < producers) {
        }
        __threadfence();  // acquire: nothing below is read before the producers' release was seen
        if (atomicAdd(order + 1, 1) == producers + consumers - 1) atomicExch(order + 1, 0);
    }
    __syncthreads();
}

// A load of data the producers wrote, after await_producers: an ordinary (weak) load, ordered
// after their writes by thread 0's fence and the block barrier, and cached in L1 for the loads
// that follow (an L2-only __ldcg made each pair block's repeated U, V reads L2 round trips).
__device__ __forceinline__ float4 consumer_load(const float4* p) { return *p; }
