// The CPU side of pairgen's kernel emulator (tests/emulator): what a rendered kernel source needs
// from CUDA, for g++. A block runs on one OS thread, its CUDA threads as fibers switched at every
// point where CUDA threads meet (barriers, warp shuffles, the tensor-core instructions), so that
// warp- and warpgroup-wide instructions see every lane's operands. translate.py turns the source's
// inline PTX into calls of the functions below and its shared arrays into per-block storage.
//
// What is checked beyond the results: a barrier or warp instruction that not every thread reaches
// (a deadlock, reported with what each thread waits for), wgmma descriptors or cp.async that differ
// across a warpgroup, and shared memory that a wgmma still reads being overwritten before its
// wait: by a cp.async (at once) or by any store (found when the wait compares the operands).
// Shared memory starts filled with 0xFF bytes (NaN in every float type), so a read of what nobody
// wrote shows. cp.async copies land when their thread waits for them, or (EARLY_LANDING) at their
// issue: the two ends of when a GPU may land them; shared memory written while a copy into it is in
// flight is found when the copy lands. Bulk copies (cp.async.bulk, TMA's untiled form) land at the
// same two ends: into shared memory when the mbarrier phase that counts their bytes completes, out
// of it when their thread waits for their bulk group; a store over either's shared bytes in
// between is found then. (Tensor-map copies, cp.async.bulk.tensor, are not emulated.)
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <unordered_map>
#include <vector>
#include <sys/mman.h>

#define __CUDA_ARCH__ 900
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) alignas(n)

struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct uint3 { unsigned x, y, z; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }

namespace pgx {

struct KernelError {
    std::string what;
};

[[noreturn]] inline void fail(const std::string& what) { throw KernelError{what}; }

// ---- fibers ------------------------------------------------------------------------------------
// pgx_switch(save, to): saves the callee-saved registers and the FP control words on this stack,
// stores the stack pointer at *save, and resumes the context whose stack pointer is `to`.
extern "C" void pgx_switch(void** save, void* to);
asm(R"(
.text
.globl pgx_switch
.hidden pgx_switch
.type pgx_switch,@function
pgx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size pgx_switch, .-pgx_switch
)");

constexpr size_t STACK_BYTES = 512 * 1024;  // mapped lazily: only the pages a thread touches are made

struct CpAsync {
    unsigned dst;
    const unsigned char* src;
    int bytes, fill;
    unsigned char before[16];  // the destination's bytes at the issue (land checks nobody wrote them since)
};

// A bulk copy (cp.async.bulk) in flight: into shared memory (completing bytes on an mbarrier) or
// out of it (in a bulk group of its thread). `before` holds the destination's bytes at the issue
// (an inbound copy) or the source's (an outbound one): where they change before it lands, another
// store raced it.
struct BulkCopy {
    unsigned char* dst;
    const unsigned char* src;
    int bytes;
    std::vector<unsigned char> before;
    bool inbound;
};

struct Fiber {
    void* sp = nullptr;
    unsigned char* stack = nullptr;
    unsigned tid = 0;
    bool done = false;
    const char* waiting = nullptr;  // what this thread waits for, while it does:
    const unsigned* wait_generation = nullptr;  // until this counter leaves wait_value
    unsigned wait_value = 0;
    std::vector<CpAsync> uncommitted;
    std::vector<std::vector<CpAsync>> groups;  // committed cp.async groups, oldest first
    std::vector<BulkCopy> bulk_uncommitted;    // bulk copies out of shared memory, by bulk group
    std::vector<std::vector<BulkCopy>> bulk_groups;
};

// A meeting of `members` threads: each writes its operands to in[its index] and arrives; the last
// to arrive runs the instruction for all of them, writing out[], and releases the others.
struct Meeting {
    int arrived = 0;
    unsigned generation = 0;
    uint64_t in[128][12];
    uint64_t out[128][4];
};

struct Barrier {
    int arrived = 0, expected = 0;
    unsigned generation = 0;
    int any = 0, any_result = 0;
};

// A wgmma's shared-memory operand bytes, as read at its issue: compared again at its wait.
struct SmemRead {
    unsigned address;
    uint16_t value;
};

struct WgmmaOp {
    std::vector<SmemRead> reads;
};

struct Warpgroup {
    Meeting meeting;
    std::vector<WgmmaOp> uncommitted;
    std::vector<std::vector<WgmmaOp>> groups;
};

// An mbarrier's state (the 8 bytes it occupies in shared memory hold a marker, checked at every use,
// so that a store over a live barrier shows).
struct MBarrier {
    int expected = 0, pending = 0;
    long long tx = 0;  // transaction bytes expected and not yet completed (below 0: completed first)
    unsigned phase = 0, generation = 0;
    std::vector<BulkCopy> copies;  // inbound bulk copies of the current phase, not yet landed
};

struct Block {
    uint3 index{0, 0, 0}, dim{1, 1, 1}, grid{1, 1, 1};
    unsigned char* smem = nullptr;
    size_t smem_bytes = 0;
    std::vector<Fiber> fibers;
    std::vector<Meeting> warps;
    std::vector<Warpgroup> groups;
    Barrier barriers[16];
    std::vector<uint16_t> in_flight;  // per 16-byte granule of shared memory: wgmma reads not yet waited for
    bool land_early = false;  // cp.async copies land at their issue (else when their thread waits)
    std::unordered_map<unsigned, MBarrier> mbarriers;  // by shared-memory address
    void* scheduler_sp = nullptr;
    std::function<void()> body;
    std::string error;
};

inline thread_local Block* current_block = nullptr;
inline thread_local Fiber* current_fiber = nullptr;

// Waits until *generation moves on from `value` (another thread completes the meeting).
inline void wait_for(const char* what, const unsigned* generation, unsigned value) {
    Fiber* f = current_fiber;
    f->waiting = what;
    f->wait_generation = generation, f->wait_value = value;
    pgx_switch(&f->sp, current_block->scheduler_sp);
    f->waiting = nullptr;
    f->wait_generation = nullptr;
}

inline bool runnable(const Fiber& f) {
    return !f.done && (f.wait_generation == nullptr || *f.wait_generation != f.wait_value);
}

// ---- shared memory addresses -------------------------------------------------------------------
// A shared-window address is the offset from the block's dynamic shared memory (wgmma descriptors
// hold 18 bits of it); static __shared__ arrays (thread_local here) sit elsewhere, within 2 GB.
inline unsigned smem_offset(const void* p) {  // (also cvta.to.shared's emulation)
    return (unsigned)((intptr_t)p - (intptr_t)current_block->smem);
}
inline unsigned char* smem_pointer(unsigned address) { return current_block->smem + (int)address; }
inline void* dynamic_smem() { return current_block->smem; }

inline Fiber& me() { return *current_fiber; }
inline unsigned linear_tid() { return current_fiber->tid; }

// ---- meetings ----------------------------------------------------------------------------------
template <class Finish>
inline void meet(Meeting& m, int members, Finish&& finish, const char* what) {
    const unsigned generation = m.generation;
    if (++m.arrived == members) {
        m.arrived = 0;
        finish();
        ++m.generation;
        return;
    }
    wait_for(what, &m.generation, generation);
}

inline Meeting& warp_meeting() { return current_block->warps[linear_tid() >> 5]; }
inline int lane() { return (int)(linear_tid() & 31); }

inline void bar_sync(int id, int count, int any = 0, int* any_result = nullptr) {
    Block* b = current_block;
    if (id < 0 || id > 15) fail("bar.sync: barrier id " + std::to_string(id));
    Barrier& bar = b->barriers[id];
    if (bar.arrived == 0) bar.expected = count;
    else if (bar.expected != count)
        fail("bar.sync " + std::to_string(id) + ": thread counts " + std::to_string(bar.expected) + " and " +
             std::to_string(count) + " at once");
    const unsigned generation = bar.generation;
    bar.any |= any;
    if (++bar.arrived == count) {
        bar.arrived = 0;
        bar.any_result = bar.any;
        bar.any = 0;
        ++bar.generation;
    } else {
        wait_for(id == 0 ? "__syncthreads" : "bar.sync (named)", &bar.generation, generation);
    }
    if (any_result) *any_result = bar.any_result;
}

// ---- fp conversions (the GPU's rounding: to nearest even; NaN stays NaN) -------------------------
inline unsigned f2u(float v) { unsigned u; std::memcpy(&u, &v, 4); return u; }
inline float u2f(unsigned u) { float v; std::memcpy(&v, &u, 4); return v; }
inline uint16_t to_bf16(float v) {
    const unsigned u = f2u(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float from_bf16(uint16_t h) { return u2f((unsigned)h << 16); }
inline uint16_t to_f16(float v) {
    if (std::isnan(v)) return 0x7fff;
    _Float16 h = (_Float16)v;
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}
inline float from_f16(uint16_t bits) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return (float)h;
}
inline unsigned to_tf32_rna(float v) {
    const unsigned u = f2u(v);
    if ((u & 0x7f800000u) == 0x7f800000u) return u;
    return (u + 0x1000u) & 0xffffe000u;
}
inline float relu_keeping_nan(float v) { return std::isnan(v) ? v : std::fmax(v, 0.0f); }
// What a tensor core reads of an fp32 operand as TF32: its top 19 bits.
inline float tf32_operand(unsigned u) { return u2f(u & 0xffffe000u); }

// kind: 0 bf16, 1 f16
template <int KIND>
inline float half_value(uint16_t bits) { return KIND == 0 ? from_bf16(bits) : from_f16(bits); }

// ---- cp.async ----------------------------------------------------------------------------------
inline void land(const CpAsync& c) {
    unsigned char* dst = smem_pointer(c.dst);
    if (std::memcmp(dst, c.before, (size_t)c.bytes))
        fail("shared memory written while a cp.async into it was in flight (byte " + std::to_string(c.dst) + ")");
    if (c.fill > c.bytes || c.fill < 0) fail("cp.async: source size larger than the copy");
    if (c.fill) std::memcpy(dst, c.src, (size_t)c.fill);
    if (c.fill < c.bytes) std::memset(dst + c.fill, 0, (size_t)(c.bytes - c.fill));
}

// A copy lands when its thread waits for it (or, in the early orders, at once): between the two a
// GPU may land it at any moment, so a kernel whose result depends on which is racing.
inline void cp_async(unsigned dst, const void* src, int bytes, int fill) {
    Block* b = current_block;
    if (bytes > 16 || dst % (unsigned)bytes) fail("cp.async: shared address not aligned to the copy");
    if ((size_t)dst + (size_t)bytes > b->smem_bytes) fail("cp.async: past the block's shared memory");
    for (unsigned g = dst / 16; g <= (dst + bytes - 1) / 16; ++g)
        if (b->in_flight[g])
            fail("cp.async into shared memory that a wgmma not yet waited for reads (byte " + std::to_string(dst) + ")");
    CpAsync c{dst, (const unsigned char*)src, bytes, fill, {}};
    std::memcpy(c.before, smem_pointer(dst), (size_t)bytes);
    if (b->land_early) land(c);
    else me().uncommitted.push_back(c);
}
// A thread's copies issued since its last commit become its newest group; a wait lands the oldest
// groups until at most `pending` remain (cp.async's groups and bulk copies' alike).
template <class Copy>
inline void commit_group(std::vector<Copy>& uncommitted, std::vector<std::vector<Copy>>& groups) {
    groups.push_back(std::move(uncommitted));
    uncommitted.clear();
}
template <class Copy, class Land>
inline void wait_groups(std::vector<std::vector<Copy>>& groups, int pending, Land land_copy) {
    while ((int)groups.size() > pending) {
        for (const Copy& c : groups.front()) land_copy(c);
        groups.erase(groups.begin());
    }
}
inline void cp_async_commit() { commit_group(me().uncommitted, me().groups); }
inline void cp_async_wait(int pending) { wait_groups(me().groups, pending, land); }
inline void cp_async_flush() {
    cp_async_commit();
    cp_async_wait(0);
}

// ---- mbarriers (arrive / wait by phase parity) -------------------------------------------------
constexpr uint64_t MBARRIER_MARKER = 0x6d62617272696572ull;  // "mbarrier"

inline MBarrier& mbarrier_at(unsigned address, const char* what) {
    Block* b = current_block;
    auto it = b->mbarriers.find(address);
    if (it == b->mbarriers.end()) fail(std::string(what) + ": no mbarrier initialised at byte " + std::to_string(address));
    if (std::memcmp(smem_pointer(address), &MBARRIER_MARKER, 8))
        fail(std::string(what) + ": the mbarrier's shared memory was overwritten (byte " + std::to_string(address) + ")");
    return it->second;
}
inline void mbarrier_init(unsigned address, int count) {
    if (address % 8 || (size_t)address + 8 > current_block->smem_bytes) fail("mbarrier.init: address " + std::to_string(address));
    if (count < 1) fail("mbarrier.init: count " + std::to_string(count));
    MBarrier& m = current_block->mbarriers[address];
    m.expected = m.pending = count;
    m.phase = 0;
    std::memcpy(smem_pointer(address), &MBARRIER_MARKER, 8);
}
inline void land_bulk(const BulkCopy& c) {
    if (std::memcmp(c.inbound ? c.dst : c.src, c.before.data(), (size_t)c.bytes))
        fail(c.inbound ? "shared memory written while a bulk copy into it was in flight"
                       : "shared memory written while a bulk copy out of it was in flight");
    std::memcpy(c.dst, c.src, (size_t)c.bytes);
}
// A phase completes when every expected arrival has come and every expected transaction byte has
// completed; its inbound copies land then (the latest a GPU may land them), before any waiter runs.
inline void mbarrier_complete_if_done(MBarrier& m) {
    if (m.pending != 0 || m.tx != 0) return;
    for (const BulkCopy& c : m.copies) land_bulk(c);
    m.copies.clear();
    m.pending = m.expected;
    m.phase ^= 1u;
    ++m.generation;
}
inline void mbarrier_arrive(unsigned address) {
    MBarrier& m = mbarrier_at(address, "mbarrier.arrive");
    if (m.pending == 0) fail("mbarrier.arrive: more arrivals than the barrier's count in one phase");
    --m.pending;
    mbarrier_complete_if_done(m);
}
// mbarrier.arrive.expect_tx: the phase also waits for `bytes` more transaction bytes, then an arrival.
inline void mbarrier_arrive_expect_tx(unsigned address, unsigned bytes) {
    mbarrier_at(address, "mbarrier.arrive.expect_tx").tx += bytes;
    mbarrier_arrive(address);
}
inline void check_bulk(unsigned smem_address, int bytes, const char* what) {
    Block* b = current_block;
    if (bytes <= 0 || bytes % 16 || smem_address % 16)
        fail(std::string(what) + ": size and shared address must be multiples of 16 (" + std::to_string(bytes) + " bytes at " +
             std::to_string(smem_address) + ")");
    if ((size_t)smem_address + (size_t)bytes > b->smem_bytes) fail(std::string(what) + ": past the block's shared memory");
}
// cp.async.bulk global -> shared, completing its bytes on the mbarrier at `barrier`: it lands when
// that barrier's phase completes (or, in the early orders, at once).
inline void cp_async_bulk_to_shared(unsigned dst, const void* src, unsigned bytes, unsigned barrier) {
    Block* b = current_block;
    check_bulk(dst, (int)bytes, "cp.async.bulk");
    if ((uintptr_t)src % 16) fail("cp.async.bulk: global address not 16-byte aligned");
    for (unsigned g = dst / 16; g <= (dst + bytes - 1) / 16; ++g)
        if (b->in_flight[g])
            fail("cp.async.bulk into shared memory that a wgmma not yet waited for reads (byte " + std::to_string(dst) + ")");
    MBarrier& m = mbarrier_at(barrier, "cp.async.bulk");
    unsigned char* to = smem_pointer(dst);
    BulkCopy c{to, (const unsigned char*)src, (int)bytes, std::vector<unsigned char>(to, to + bytes), true};
    if (b->land_early) land_bulk(c);
    else m.copies.push_back(std::move(c));
    m.tx -= bytes;
    mbarrier_complete_if_done(m);
}
// cp.async.bulk shared -> global in the thread's bulk groups (commit_group, wait_group[.read]): the
// global bytes are written at the wait (or at the issue in the early orders); the shared source
// must not change in between.
inline void cp_async_bulk_to_global(void* dst, unsigned src, unsigned bytes) {
    check_bulk(src, (int)bytes, "cp.async.bulk (to global)");
    if ((uintptr_t)dst % 16) fail("cp.async.bulk (to global): global address not 16-byte aligned");
    const unsigned char* from = smem_pointer(src);
    BulkCopy c{(unsigned char*)dst, from, (int)bytes, std::vector<unsigned char>(from, from + bytes), false};
    if (current_block->land_early) land_bulk(c);
    else me().bulk_uncommitted.push_back(std::move(c));
}
inline void cp_async_bulk_commit() { commit_group(me().bulk_uncommitted, me().bulk_groups); }
inline void cp_async_bulk_wait(int pending) { wait_groups(me().bulk_groups, pending, land_bulk); }
// Whether the phase of parity `parity` has completed (the barrier is in the other phase now); if
// not, the thread yields until the barrier moves on, and the caller's loop asks again.
inline unsigned mbarrier_try_wait_parity(unsigned address, unsigned parity) {
    MBarrier& m = mbarrier_at(address, "mbarrier.try_wait");
    if (m.phase != (parity & 1u)) return 1u;
    wait_for("mbarrier.try_wait", &m.generation, m.generation);
    return 0u;
}
// cp.async.mbarrier.arrive.noinc: an arrival once every cp.async this thread issued has landed.
// They land here (at once in the early-landing orders): the latest a consumer can see them is
// when the barrier's phase completes.
inline void cp_async_mbarrier_arrive_noinc(unsigned address) {
    Fiber& f = me();
    cp_async_commit();
    for (const auto& group : f.groups)
        for (const CpAsync& c : group) land(c);
    f.groups.clear();
    mbarrier_arrive(address);
}

// ---- warp instructions -------------------------------------------------------------------------
inline int members_of(unsigned mask) { return __builtin_popcount(mask); }

template <class T>
inline uint64_t bits_of(T v) {
    static_assert(sizeof(T) <= 8, "a shuffled value of at most 8 bytes");
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
inline T of_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

// mode 0 xor, 1 index, 2 down, 3 up
template <class T>
inline T shuffle(unsigned mask, T v, int arg, int width, int mode) {
    Meeting& m = warp_meeting();
    const int l = lane();
    m.in[l][0] = bits_of(v);
    m.in[l][1] = (uint64_t)(int64_t)arg;
    meet(m, members_of(mask), [&] {
        for (int i = 0; i < 32; ++i) {
            if (!(mask >> i & 1u)) continue;
            const int a = (int)(int64_t)m.in[i][1], base = i & ~(width - 1);
            int src = i;
            if (mode == 0) src = i ^ a;
            else if (mode == 1) src = base + (a & (width - 1));
            else if (mode == 2) src = i + a;
            else src = i - a;
            if (src < base || src >= base + width) src = i;
            if (!(mask >> src & 1u)) fail("__shfl_*_sync from a lane outside the mask");
            m.out[i][0] = m.in[src][0];
        }
    }, "a warp shuffle");
    return of_bits<T>(m.out[l][0]);
}

inline unsigned ballot(unsigned mask, int predicate) {
    Meeting& m = warp_meeting();
    const int l = lane();
    m.in[l][0] = predicate != 0;
    meet(m, members_of(mask), [&] {
        unsigned bits = 0;
        for (int i = 0; i < 32; ++i)
            if ((mask >> i & 1u) && m.in[i][0]) bits |= 1u << i;
        for (int i = 0; i < 32; ++i) m.out[i][0] = bits;
    }, "__ballot_sync");
    return (unsigned)m.out[l][0];
}

inline void syncwarp(unsigned mask) {
    meet(warp_meeting(), members_of(mask), [] {}, "__syncwarp");
}

inline uint16_t smem_u16(unsigned address) {
    uint16_t v;
    std::memcpy(&v, smem_pointer(address), 2);
    return v;
}
inline void smem_store_u16(unsigned address, uint16_t v) { std::memcpy(smem_pointer(address), &v, 2); }

// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i (8 x 8 b16); lane l receives
// of matrix i row l/4, elements 2(l%4), +1 (trans: column l/4, rows 2(l%4), +1).
inline void ldmatrix_x4(bool trans, unsigned address, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    Meeting& m = warp_meeting();
    const int l = lane();
    if (address % 16) fail("ldmatrix: row address not 16-byte aligned");
    m.in[l][0] = address;
    meet(m, 32, [&] {
        for (int i = 0; i < 32; ++i) {
            for (int mat = 0; mat < 4; ++mat) {
                unsigned word = 0;
                for (int e = 0; e < 2; ++e) {
                    const int row = trans ? 2 * (i % 4) + e : i / 4, col = trans ? i / 4 : 2 * (i % 4) + e;
                    word |= (unsigned)smem_u16((unsigned)m.in[8 * mat + row][0] + 2 * col) << (16 * e);
                }
                m.out[i][mat] = word;
            }
        }
    }, "ldmatrix");
    r0 = (unsigned)m.out[l][0], r1 = (unsigned)m.out[l][1], r2 = (unsigned)m.out[l][2], r3 = (unsigned)m.out[l][3];
}

inline void stmatrix_x4(bool trans, unsigned address, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    Meeting& m = warp_meeting();
    const int l = lane();
    if (address % 16) fail("stmatrix: row address not 16-byte aligned");
    m.in[l][0] = address;
    m.in[l][1] = r0, m.in[l][2] = r1, m.in[l][3] = r2, m.in[l][4] = r3;
    meet(m, 32, [&] {
        for (int i = 0; i < 32; ++i)
            for (int mat = 0; mat < 4; ++mat)
                for (int e = 0; e < 2; ++e) {
                    const int row = trans ? 2 * (i % 4) + e : i / 4, col = trans ? i / 4 : 2 * (i % 4) + e;
                    smem_store_u16((unsigned)m.in[8 * mat + row][0] + 2 * col,
                                   (uint16_t)((unsigned)m.in[i][1 + mat] >> (16 * e)));
                }
    }, "stmatrix");
}

// mma.sync m16n8k16 (KIND 0 bf16, 1 f16) or m16n8k8 (KIND 2 tf32), fp32 accumulators, one warp.
template <int KIND>
inline void mma_sync(float* c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    Meeting& m = warp_meeting();
    const int l = lane();
    uint64_t* in = m.in[l];
    in[0] = a0, in[1] = a1, in[2] = a2, in[3] = a3, in[4] = b0, in[5] = b1;
    for (int i = 0; i < 4; ++i) in[6 + i] = f2u(*c[i]);
    meet(m, 32, [&] {
        constexpr int K = KIND == 2 ? 8 : 16;
        float A[16][16], Bm[16][8];
        for (int i = 0; i < 32; ++i) {
            const int g = i / 4, t = i % 4;
            const unsigned a[4] = {(unsigned)m.in[i][0], (unsigned)m.in[i][1], (unsigned)m.in[i][2], (unsigned)m.in[i][3]};
            const unsigned b[2] = {(unsigned)m.in[i][4], (unsigned)m.in[i][5]};
            if (KIND == 2) {
                A[g][t] = tf32_operand(a[0]), A[g + 8][t] = tf32_operand(a[1]);
                A[g][t + 4] = tf32_operand(a[2]), A[g + 8][t + 4] = tf32_operand(a[3]);
                Bm[t][g] = tf32_operand(b[0]), Bm[t + 4][g] = tf32_operand(b[1]);
            } else {
                for (int e = 0; e < 2; ++e) {
                    const auto h = [&](unsigned w) { return half_value<KIND % 2>((uint16_t)(w >> (16 * e))); };
                    A[g][2 * t + e] = h(a[0]), A[g + 8][2 * t + e] = h(a[1]);
                    A[g][2 * t + 8 + e] = h(a[2]), A[g + 8][2 * t + 8 + e] = h(a[3]);
                    Bm[2 * t + e][g] = h(b[0]), Bm[2 * t + 8 + e][g] = h(b[1]);
                }
            }
        }
        for (int i = 0; i < 32; ++i) {
            const int g = i / 4, t = i % 4;
            for (int r = 0; r < 4; ++r) {
                const int row = g + 8 * (r / 2), col = 2 * t + (r % 2);
                double sum = u2f((unsigned)m.in[i][6 + r]);
                for (int k = 0; k < K; ++k) sum += (double)A[row][k] * (double)Bm[k][col];
                m.out[i][r] = f2u((float)sum);
            }
        }
    }, "mma.sync");
    for (int i = 0; i < 4; ++i) *c[i] = u2f((unsigned)m.out[l][i]);
}

// ---- wgmma -------------------------------------------------------------------------------------
// A K-major operand element (row, k) of a 64-bit shared-memory descriptor: the interleaved layout
// (mode 0: 8-row core matrices of 16 bytes a row; LBO the next 8 k, SBO the next 8 rows) or the
// 128-byte swizzle (mode 1: rows of 128 bytes, SBO the next 8 rows, 16-byte chunks XORed with
// address bits 7-9).
inline unsigned k_major_address(uint64_t desc, int row, int k) {
    const unsigned start = (unsigned)(desc & 0x3fff) << 4;
    const unsigned lbo = (unsigned)(desc >> 16 & 0x3fff) << 4, sbo = (unsigned)(desc >> 32 & 0x3fff) << 4;
    const unsigned base_offset = (unsigned)(desc >> 49 & 7), mode = (unsigned)(desc >> 62);
    if (base_offset) fail("wgmma descriptor: base offset not emulated");
    if (mode == 0) return start + (row / 8) * sbo + (row % 8) * 16 + (k / 8) * lbo + (k % 8) * 2;
    if (mode == 1) {
        const unsigned a = start + (row / 8) * sbo + (row % 8) * 128 + (k / 8) * 16 + (k % 8) * 2;
        return a ^ (((a >> 7) & 7u) << 4);
    }
    fail("wgmma descriptor: swizzle mode " + std::to_string(mode) + " not emulated");
}

// An N-major (MN-major) operand element (row n, k) of an interleaved-layout descriptor (imm-trans-b
// 1): core matrices of 8 k rows x 16 bytes (8 consecutive n), SBO the next 8 n, LBO the next 8 k
// (the PTX ISA's canonical layout ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)), T = 8 16-bit elements).
inline unsigned mn_major_address(uint64_t desc, int row, int k) {
    const unsigned start = (unsigned)(desc & 0x3fff) << 4;
    const unsigned lbo = (unsigned)(desc >> 16 & 0x3fff) << 4, sbo = (unsigned)(desc >> 32 & 0x3fff) << 4;
    if (desc >> 49 & 7) fail("wgmma descriptor: base offset not emulated");
    if (desc >> 62) fail("wgmma descriptor: N-major B emulated in the interleaved layout only");
    return start + (row / 8) * sbo + (row % 8) * 2 + (k / 8) * lbo + (k % 8) * 16;
}

template <int KIND>
inline void read_operand(uint64_t desc, int rows, float (*out)[16], WgmmaOp& op, bool mn_major = false) {
    for (int r = 0; r < rows; ++r)
        for (int k = 0; k < 16; ++k) {
            const unsigned a = mn_major ? mn_major_address(desc, r, k) : k_major_address(desc, r, k);
            if ((size_t)a + 2 > current_block->smem_bytes) fail("wgmma operand past the block's shared memory");
            const uint16_t v = smem_u16(a);
            op.reads.push_back({a, v});
            out[r][k] = half_value<KIND>(v);
        }
}

// d (scale_d: +)= A(64 x 16) . B(N x 16)^T for one warpgroup: A from a descriptor, or (a != null)
// from the threads' registers in mma.sync's A-fragment order; d in the m16n8 accumulator order.
// trans_b: B's descriptor N-major (mn_major_address).
template <int N, int KIND>
inline void wgmma(float* const* d, const unsigned* a, uint64_t desc_a, uint64_t desc_b, int scale_d, int trans_b) {
    Block* b = current_block;
    const unsigned t = linear_tid();
    Warpgroup& wg = b->groups[t >> 7];
    Meeting& m = wg.meeting;
    const int me = (int)(t & 127);
    m.in[me][0] = (uint64_t)(uintptr_t)d;
    m.in[me][1] = a ? a[0] : 0, m.in[me][2] = a ? a[1] : 0, m.in[me][3] = a ? a[2] : 0, m.in[me][4] = a ? a[3] : 0;
    m.in[me][5] = desc_a, m.in[me][6] = desc_b, m.in[me][7] = (uint64_t)scale_d, m.in[me][8] = a != nullptr;
    meet(m, 128, [&] {
        for (int i = 1; i < 128; ++i)
            for (int s = 5; s <= 8; ++s)
                if (m.in[i][s] != m.in[0][s] && !(s == 5 && m.in[0][8]))
                    fail("wgmma: descriptors, scale-d or the A source differ across the warpgroup");
        static thread_local float A[64][16], B[N][16];
        WgmmaOp op;
        if (m.in[0][8]) {
            for (int i = 0; i < 128; ++i) {
                const int w = i / 32, g = (i % 32) / 4, tt = i % 4;
                for (int e = 0; e < 2; ++e) {
                    const auto h = [&](int s) { return half_value<KIND>((uint16_t)((unsigned)m.in[i][s] >> (16 * e))); };
                    A[16 * w + g][2 * tt + e] = h(1), A[16 * w + g + 8][2 * tt + e] = h(2);
                    A[16 * w + g][2 * tt + 8 + e] = h(3), A[16 * w + g + 8][2 * tt + 8 + e] = h(4);
                }
            }
        } else {
            read_operand<KIND>(m.in[0][5], 64, A, op);
        }
        read_operand<KIND>(m.in[0][6], N, B, op, trans_b != 0);
        const bool accumulate = m.in[0][7] != 0;
        for (int i = 0; i < 128; ++i) {
            float* const* di = (float* const*)(uintptr_t)m.in[i][0];
            const int w = i / 32, g = (i % 32) / 4, tt = i % 4;
            for (int j = 0; j < N / 8; ++j)
                for (int r = 0; r < 4; ++r) {
                    const int row = 16 * w + g + 8 * (r / 2), col = 8 * j + 2 * tt + (r % 2);
                    double sum = accumulate ? (double)*di[4 * j + r] : 0.0;
                    for (int k = 0; k < 16; ++k) sum += (double)A[row][k] * (double)B[col][k];
                    *di[4 * j + r] = (float)sum;
                }
        }
        for (const SmemRead& r : op.reads) ++b->in_flight[r.address / 16];
        wg.uncommitted.push_back(std::move(op));
    }, "wgmma.mma_async");
}

inline void wgmma_commit() {
    Warpgroup& wg = current_block->groups[linear_tid() >> 7];
    meet(wg.meeting, 128, [&] {
        wg.groups.push_back(std::move(wg.uncommitted));
        wg.uncommitted.clear();
    }, "wgmma.commit_group");
}

inline void wgmma_wait(int pending) {
    Block* b = current_block;
    Warpgroup& wg = b->groups[linear_tid() >> 7];
    meet(wg.meeting, 128, [&] {
        while ((int)wg.groups.size() > pending) {
            for (const WgmmaOp& op : wg.groups.front())
                for (const SmemRead& r : op.reads) {
                    if (smem_u16(r.address) != r.value)
                        fail("shared memory a wgmma reads was overwritten before its wait (byte " +
                             std::to_string(r.address) + ")");
                    --b->in_flight[r.address / 16];
                }
            wg.groups.erase(wg.groups.begin());
        }
    }, "wgmma.wait_group");
}

// ---- a launch ----------------------------------------------------------------------------------
[[noreturn]] inline void fiber_main() {
    Block* b = current_block;
    Fiber* f = current_fiber;
    try {
        b->body();
        cp_async_flush();
    } catch (const KernelError& e) {
        if (b->error.empty()) b->error = e.what + " (thread " + std::to_string(f->tid) + ")";
    }
    f->done = true;
    pgx_switch(&f->sp, b->scheduler_sp);
    std::abort();  // a finished fiber is never resumed
}

// Threads' stacks, kept for the next block once a block is done: mapping and unmapping a stack for
// every thread of every block (and faulting its first pages in again) cost the emulator more than a
// small kernel's work (a weight pack: 0.5 s a launch).
inline std::mutex stack_pool_lock;
inline std::vector<unsigned char*> stack_pool;

inline unsigned char* take_stack() {
    {
        std::lock_guard<std::mutex> hold(stack_pool_lock);
        if (!stack_pool.empty()) {
            unsigned char* stack = stack_pool.back();
            stack_pool.pop_back();
            return stack;
        }
    }
    void* stack = mmap(nullptr, STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return stack == MAP_FAILED ? nullptr : (unsigned char*)stack;
}

inline void give_back_stack(unsigned char* stack) {
    std::lock_guard<std::mutex> hold(stack_pool_lock);
    stack_pool.push_back(stack);
}

inline void start_fiber(Fiber& f) {
    f.stack = take_stack();
    if (f.stack == nullptr) fail("cannot map a thread's stack");
    uint64_t* top = (uint64_t*)(f.stack + STACK_BYTES);
    // pgx_switch's frame, as if it had been called from fiber_main's caller: the return address,
    // six callee-saved registers, then the FP control words.
    top[-2] = (uint64_t)(uintptr_t)&fiber_main;
    for (int i = 3; i <= 8; ++i) top[-i] = 0;
    unsigned mxcsr;
    unsigned short fpucw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpucw));
    std::memcpy(&top[-9], &mxcsr, 4);
    std::memcpy((char*)&top[-9] + 4, &fpucw, 2);
    f.sp = &top[-9];
}

// order: 0 threads in order each pass, 1 reversed, 2 alternating; 3, 4 by priority (below); plus
// EARLY_LANDING: cp.async copies land at their issue
constexpr int EARLY_LANDING = 8;
inline std::string run_block(const std::function<void()>& body, uint3 index, uint3 grid, unsigned threads,
                             size_t smem_bytes, int order) {
    Block b;
    b.land_early = order & EARLY_LANDING;
    order &= EARLY_LANDING - 1;
    b.index = index, b.grid = grid, b.dim = {threads, 1, 1};
    b.body = body;
    b.smem_bytes = smem_bytes;
    const size_t arena = (smem_bytes + 1023) / 1024 * 1024 + 1024;
    b.smem = (unsigned char*)std::aligned_alloc(1024, arena);
    std::memset(b.smem, 0xff, arena);
    b.in_flight.assign(arena / 16, 0);
    b.fibers.resize(threads);
    b.warps.resize((threads + 31) / 32);
    b.groups.resize((threads + 127) / 128);
    current_block = &b;
    std::string error;
    try {
        for (unsigned t = 0; t < threads; ++t) {
            b.fibers[t].tid = t;
            start_fiber(b.fibers[t]);
        }
        // Round robin (orders 0-2) resumes every thread that can go on once a pass; priority orders
        // (3: the lowest thread id that can go on, 4: the highest) let some threads run as far as
        // they can before the others start, which shows a missing barrier between warpgroups.
        const bool priority = order >= 3;
        for (int pass = 0;; ++pass) {
            bool alive = false, ran = false;
            const bool reverse = order == 1 || order == 4 || (order == 2 && pass % 2);
            for (unsigned i = 0; i < threads && b.error.empty(); ++i) {
                Fiber& f = b.fibers[reverse ? threads - 1 - i : i];
                if (f.done) continue;
                alive = true;
                if (!runnable(f)) continue;
                current_fiber = &f;
                pgx_switch(&b.scheduler_sp, f.sp);
                ran = true;
                if (priority) break;
            }
            if (!b.error.empty() || !alive) break;
            if (!ran && !std::any_of(b.fibers.begin(), b.fibers.end(), runnable)) {
                std::string what = "deadlock: every thread waits and none can go on:";
                for (const Fiber& f : b.fibers)
                    if (!f.done && (f.tid % 32 == 0 || f.tid < 4)) what += " t" + std::to_string(f.tid) + " at " + f.waiting + ";";
                b.error = what;
                break;
            }
        }
    } catch (const KernelError& e) {
        b.error = e.what;
    }
    error = b.error;
    for (Fiber& f : b.fibers)
        if (f.stack) give_back_stack(f.stack);
    std::free(b.smem);
    current_block = nullptr;
    current_fiber = nullptr;
    return error.empty() ? error : "block " + std::to_string(index.x) + ": " + error;
}

template <class T>
inline T argument(long long v) {
    if constexpr (std::is_pointer_v<T>) return reinterpret_cast<T>((intptr_t)v);
    else return (T)v;
}

template <class... A, size_t... I>
inline void call_kernel(void (*kernel)(A...), const long long* args, std::index_sequence<I...>) {
    kernel(argument<A>(args[I])...);
}

// Runs every block, several at once on OS threads (all of them at once where the grid is at most
// `together`: a grid-wide barrier needs its blocks resident together, as a cooperative launch).
template <class... A>
inline int launch(void (*kernel)(A...), unsigned grid, unsigned threads, unsigned smem, const long long* args,
                  int order, int together, char* error, int error_bytes) {
    std::function<void()> body = [=] { call_kernel(kernel, args, std::index_sequence_for<A...>{}); };
    std::atomic<unsigned> next{0};
    std::string first_error;
    std::atomic<bool> failed{false};
    std::vector<std::thread> workers;
    std::mutex lock;
    const unsigned count = grid <= (unsigned)together ? grid : (unsigned)std::max(1u, std::thread::hardware_concurrency());
    for (unsigned w = 0; w < count; ++w)
        workers.emplace_back([&] {
            for (unsigned i; !failed && (i = next++) < grid;) {
                std::string e = run_block(body, {i, 0, 0}, {grid, 1, 1}, threads, smem, order);
                if (!e.empty()) {
                    std::lock_guard<std::mutex> hold(lock);
                    if (first_error.empty()) first_error = e;
                    failed = true;
                }
            }
        });
    for (auto& w : workers) w.join();
    if (first_error.empty()) return 0;
    std::snprintf(error, (size_t)error_bytes, "%s", first_error.c_str());
    return 1;
}

}  // namespace pgx

// ---- the CUDA names a kernel uses --------------------------------------------------------------
#define threadIdx (::uint3{pgx::current_fiber->tid, 0u, 0u})
#define blockIdx (pgx::current_block->index)
#define blockDim (pgx::current_block->dim)
#define gridDim (pgx::current_block->grid)

inline void __syncthreads() { pgx::bar_sync(0, (int)pgx::current_block->dim.x); }
inline int __syncthreads_or(int p) {
    int r = 0;
    pgx::bar_sync(0, (int)pgx::current_block->dim.x, p != 0, &r);
    return r;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { pgx::syncwarp(mask); }
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) { return pgx::shuffle(mask, v, m, width, 0); }
template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) { return pgx::shuffle(mask, v, src, width, 1); }
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) { return pgx::shuffle(mask, v, (int)d, width, 2); }
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) { return pgx::shuffle(mask, v, (int)d, width, 3); }
inline unsigned __ballot_sync(unsigned mask, int p) { return pgx::ballot(mask, p); }
inline int __any_sync(unsigned mask, int p) { return pgx::ballot(mask, p) != 0; }
inline int __all_sync(unsigned mask, int p) { return pgx::ballot(mask, p) == mask; }
inline size_t __cvta_generic_to_shared(const void* p) { return pgx::smem_offset(p); }
[[noreturn]] inline void __trap() { pgx::fail("__trap()"); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }

inline float __uint_as_float(unsigned u) { return pgx::u2f(u); }
inline unsigned __float_as_uint(float v) { return pgx::f2u(v); }
inline float __int_as_float(int i) { return pgx::u2f((unsigned)i); }
inline int __float_as_int(float v) { return (int)pgx::f2u(v); }
inline float __expf(float v) { return std::exp(v); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __clz(int v) { return v ? __builtin_clz((unsigned)v) : 32; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline float atomicAdd(float* p, float v) {
    unsigned* u = (unsigned*)p;
    unsigned old = __atomic_load_n(u, __ATOMIC_SEQ_CST);
    while (!__atomic_compare_exchange_n(u, &old, pgx::f2u(pgx::u2f(old) + v), false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return pgx::u2f(old);
}
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline int atomicCAS(int* p, int expected, int desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
