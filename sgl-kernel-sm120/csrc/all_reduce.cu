// Push all-reduce and fused all-reduce + residual add + RMSNorm for PCIe-connected GPUs.
//
// Protocol (see README.md, "How the kernel works"):
// - Ranks only ever WRITE to peers (push) and READ their own memory: remote reads (pull) stall
//   badly or hang over PCIe P2P.
// - One-shot (small messages) is Lamport-style: the data is its own "arrived" signal. Every
//   16-bit lane of a receive buffer starts as 0xFFFF (a NaN no sender ever stores: 0xFFFF
//   inputs are sent as 0x7FFF); a rank pushes its input into every peer's buffer and polls its
//   own buffer until no lane holds 0xFFFF. One round, no flags, no fences, no barrier between
//   blocks: each block polls exactly the vectors (or rows) it reduces.
// - Three one-shot buffers rotate. In its one-shot call k (counting one-shot calls only) a rank
//   reads buffer k%3 and clears (back to 0xFFFF) buffer (k-1)%3, which it read in call k-1. A
//   peer writes that buffer again only in call k+2, which it can only enter after finishing
//   call k+1, which needs this rank's data of call k+1, which this rank pushes after its call
//   k (the clear included) has finished. And no peer can overwrite buffer k%3 before this rank
//   has read it: that write belongs to call k+3, which needs this rank's data of call k+2. So
//   there is no end barrier, and a slow rank is never overwritten.
// - Lamport two-shot (mid-size messages, SK_VARIANT_TWOSHOT_LAMPORT): the two-shot's two
//   phases, each Lamport-style as above, in the one-shot buffers and their rotation (a call of
//   either kind counts as a one-shot call there). Every rank's chunk is non-empty, so each peer
//   needs data of this rank in every such call, which the rotation's argument rests on. See
//   run_twoshot_lamport.
// - Two-shot (large messages): reduce-scatter then all-gather, with flags carrying the call
//   number (release store to the peer, acquire poll locally). Its second round is the end
//   barrier of the first; push slots alternate between two parities. Call numbers are 64-bit:
//   a server makes ~10^4 calls a second, and a 32-bit number compared by signed distance
//   takes a flag last set 2^31 calls ago (days) for a new one.
// - Call state (call number, next one-shot buffer and how much of each buffer is dirty) lives
//   in the rank's own device memory, one copy per block index: block b reads copy b at start
//   and at the end writes every copy j = b mod grid. So CUDA graph replays need no host work,
//   and no block reads a word another block of the same launch writes.
// - Every wait is bounded by %globaltimer; on expiry the kernel records the error in device
//   memory and in a host-mapped mirror and returns (no trap: that would kill the context). A
//   workspace with a recorded error turns every later launch into a no-op.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>

#include "sk_api.h"

#define SK_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kVecElems = 8;  // 16-bit elements in one 16-byte vector
constexpr int kMaxHidden = 16384;
constexpr int kMaxVecPerThread = kMaxHidden / kVecElems / SK_THREADS;  // row held in registers
// Row-split blocks are half the size: a slice is at most 256 vectors where the row is cut in
// as many slices as it wants (ROW_SLICE_VECTORS), and two such blocks fit on an SM, so twice
// the clusters do (a cluster is placed whole on one GPC). A slice is at most 512 vectors
// (config.MAX_ROW_SLICE_VECTORS, checked in sk_launch): with 4 per thread the bf16 kernel
// needs more than the 128 registers two blocks an SM leave it, and spills on sm_90.
constexpr int kRowSplitThreads = SK_THREADS / 2;
constexpr int kMaxVecPerSlice = 2;
// The block size a kernel launches with (its __launch_bounds__), on the host and the device.
__host__ __device__ constexpr int block_threads(bool row_split) {
  return row_split ? kRowSplitThreads : SK_THREADS;
}
constexpr int kWarps = SK_THREADS / 32;
constexpr int kKindPush = 0;
constexpr int kKindGather = 1;

static_assert(SK_MAX_RANKS <= SK_THREADS, "signal: one storing thread per peer");

// Call state words (one copy per block index, see SK_STATE_* in sk_api.h). The one-shot buffer
// is stored as 0..2, not as a count of one-shot calls: such a count mod 3 repeats a buffer where
// it wraps at 2^32, which is not a multiple of 3.
constexpr int kStateEpoch = SK_STATE_EPOCH;
constexpr int kStateOneshotBuffer = SK_STATE_ONESHOT_BUFFER;
constexpr int kStateDirty = SK_STATE_DIRTY;
constexpr int kStateEpochHigh = SK_STATE_EPOCH_HIGH;

constexpr int kRowsPerPass = 3;  // the most rows the two-shot epilogue normalises at once

struct Shared {
  int abort;
  float red[kRowsPerPass][kWarps];
  // Row split: every block of the cluster's share of the row's sum of squares, by cluster
  // rank, stored by each block into every block's copy (distributed shared memory) with
  // st.async, which counts its bytes on the receiving block's row_parts_arrived mbarrier.
  float row_parts[SK_MAX_ROW_BLOCKS];
  alignas(8) unsigned long long row_parts_arrived;
};

constexpr uint32_t kEmptyWord = 0xFFFFFFFFu;  // two "not arrived" lanes

// What the kernels receive: the caller's parameters plus what sk_launch derives from them once
// on the host, so that no kernel computes it on the way to its first push. At verify sizes a
// call is a chain of dependent latencies, and these were links in it: the push indexed the
// parameter array by a computed peer rank (one dependent constant load per peer, 7 in a row at
// TP8), and the one-shot share was a 64-bit division before the first input load.
struct KernelParams : SkLaunchParams {
  // [s]: the one-shot region of rank (rank + s) % world_size ([0] is this rank's own), so an
  // unrolled loop over s reads each pointer at a fixed parameter offset.
  void* lamport_from[SK_MAX_RANKS];
  int64_t oneshot_per_block;  // one-shot: vectors a block pushes, ceil(numel / 8 / blocks)
  // Two-shot fused in whole-row pieces (the row-pieces kernel, see sk_launch): rows of each
  // rank's chunk, ceil(rows / world_size), and of each block's piece of it.
  int32_t chunk_rows, piece_rows;
  // Lamport two-shot: vectors of each rank's chunk, ceil(numel / 8 / world_size), and of each
  // block's piece of it, ceil(chunk / blocks).
  int64_t twoshot_chunk, twoshot_piece;
  float inv_hidden;  // fused: 1 / hidden, so the mean square is one multiply, not a division
};

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_volatile(const uint32_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}

__device__ __forceinline__ uint4 ld_volatile_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ bool word_has_empty_lane(uint32_t w) {
  return (w & 0xFFFFu) == 0xFFFFu || w >= 0xFFFF0000u;
}

__device__ __forceinline__ bool has_empty_lane(const uint4& u) {
  return word_has_empty_lane(u.x) || word_has_empty_lane(u.y) || word_has_empty_lane(u.z) ||
         word_has_empty_lane(u.w);
}

// A 0xFFFF lane (a NaN) would read as "not arrived": send it as 0x7FFF, also a NaN.
__device__ __forceinline__ uint32_t sendable_word(uint32_t w) {
  if ((w & 0xFFFFu) == 0xFFFFu) w &= 0xFFFF7FFFu;
  if (w >= 0xFFFF0000u) w &= 0x7FFFFFFFu;
  return w;
}

__device__ __forceinline__ uint4 sendable(uint4 u) {
  return make_uint4(sendable_word(u.x), sendable_word(u.y), sendable_word(u.z),
                    sendable_word(u.w));
}

// Debug timeline: clock64 of block 0, thread 0 at phase `index` (0 start ... 5 end); phases 0
// and 5 also record %globaltimer (slots 6 and 7) to convert cycles to nanoseconds.
// Read from the special registers at each stamp (asm volatile): otherwise the compiler keeps
// `threadIdx.x | blockIdx.x` live through the kernel, and with 64-bit call numbers that spilled
// in the strided two-shot fused kernel (sm_90 and sm_120).
__device__ __forceinline__ bool first_thread_of_grid() {
  uint32_t thread, block;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(thread));
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(block));
  return (thread | block) == 0;
}

__device__ __forceinline__ void stamp(const SkLaunchParams& p, int index) {
  if (p.timeline != nullptr && first_thread_of_grid()) {
    p.timeline[index] = clock64();
    if (index == 5) p.timeline[7] = globaltimer_ns();
  }
}

// Phase 0 is the block's start, read before the wait for the previous kernel (a launch that
// overlapped it shows as a long phase 0) and stored after it.
struct Start {
  long long clock = 0;
  uint64_t ns = 0;
};

__device__ __forceinline__ Start read_start(const SkLaunchParams& p) {
  Start start;
  if (p.timeline != nullptr) {
    start.clock = clock64();
    start.ns = globaltimer_ns();
  }
  return start;
}

__device__ __forceinline__ void stamp_start(const SkLaunchParams& p, const Start& start) {
  if (p.timeline != nullptr && first_thread_of_grid()) {
    p.timeline[0] = start.clock;
    p.timeline[6] = start.ns;
  }
}

// Programmatic dependent launch (PDL; sk_launch asks for it unless p.early_launch is 0). The
// next kernel in a stream may then be launched, and its blocks made resident, before this one
// has finished. Two rules keep that invisible:
// - Memory: every kernel calls wait_for_previous_kernel before its first global memory access
//   (its input may be the previous kernel's output, its call state the previous call's). It
//   returns once the kernel right before it in the stream has finished and its writes are
//   visible; at once where the launch did not overlap it. The "memory" clobber keeps loads below
//   it (test_sgl_kernel_fatbin checks the SASS of every kernel). It covers only that one
//   kernel: a call's state is the previous call's because every kernel of ours waits at entry,
//   so a chain of ours is ordered end to end. A kernel of another library between two of our
//   calls, launched early and finishing without waiting for its own predecessor, would break
//   the chain: PDL-launched kernels must wait before they exit (SGLang's and FlashInfer's do),
//   and SGLANG_SM120_PDL=0 is the way out where one does not.
// - residual_in may be the previous kernel's output, written on other SMs while this kernel is
//   already resident: it is read with __ldcg (L2), never through the non-coherent L1 (__ldg),
//   which the wait is not documented to invalidate. weight is read-only across calls.
// - Progress: a block calls let_next_kernel_launch only once it has seen data (or a flag) of
//   every peer block it will still wait on, so those blocks have started. The next kernel
//   launches when every block of this one has called it or exited, and then takes only SM
//   room this call does not need: where ranks share a GPU, no block a call waits on can be
//   kept off the GPU by a next kernel resident early (its blocks wait, unbounded, for this
//   one). The instruction counts for the whole block at the first thread that issues it, so a
//   thread with nothing to wait for must not issue it before its block's waits.
__device__ __forceinline__ void wait_for_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ void let_next_kernel_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// 64-bit call numbers never wrap (2^64 calls take ~6 million years at 10^5 a second).
__device__ __forceinline__ bool reached(uint64_t flag, uint64_t epoch) { return flag >= epoch; }

__device__ __forceinline__ size_t flag_index(int kind, int parity, int src, int block) {
  return ((static_cast<size_t>(kind) * 2 + parity) * SK_MAX_RANKS + src) * SK_MAX_BLOCKS + block;
}

template <typename T>
struct Vec8;

template <>
struct Vec8<__nv_bfloat16> {
  static __device__ __forceinline__ void add_to(float (&acc)[8], const uint4& u) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  static __device__ __forceinline__ uint4 pack(const float (&f)[8]) {
    uint4 u;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return u;
  }
};

template <>
struct Vec8<__half> {
  static __device__ __forceinline__ void add_to(float (&acc)[8], const uint4& u) {
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  static __device__ __forceinline__ uint4 pack(const float (&f)[8]) {
    uint4 u;
    __half2* h = reinterpret_cast<__half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    return u;
  }
};

__device__ __forceinline__ void zero(float (&acc)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
}

// Sum of every rank's vector, always in rank order so that all ranks get identical bits.
// Rank r's own vector comes from its input; the others from the slots peers pushed into.
template <typename T>
__device__ __forceinline__ void sum_ranks(float (&acc)[8], const uint4* slots, int64_t slot_vecs,
                                          int64_t slot_index, const uint4* input,
                                          int64_t input_index, int world, int rank) {
  uint4 u[SK_MAX_RANKS];
#pragma unroll
  for (int j = 0; j < SK_MAX_RANKS; ++j) {
    if (j < world) {
      u[j] = (j == rank) ? input[input_index] : __ldcg(slots + j * slot_vecs + slot_index);
    }
  }
  zero(acc);
#pragma unroll
  for (int j = 0; j < SK_MAX_RANKS; ++j) {
    if (j < world) Vec8<T>::add_to(acc, u[j]);
  }
}

// Sums of x[i] over the block, for each i. Also returns sh.abort as it stood after the first
// barrier, so every thread of the block takes the same decision (a flag set by a poller of
// these rows is seen by all; one set by a poller of the next rows by none). kReused: a second
// barrier, for a block that sums again (sh.red is reused by its next rows); the row split sums
// once and skips it.
template <int kN, bool kReused = true, int kThreads = SK_THREADS>
__device__ void block_sums(float (&x)[kN], Shared& sh, bool& aborted) {
  constexpr int warps = kThreads / 32;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x[i] += __shfl_xor_sync(0xffffffffu, x[i], offset);
    if (threadIdx.x % 32 == 0) sh.red[i][threadIdx.x / 32] = x[i];
  }
  __syncthreads();
  // Four interleaved partial sums, then their pairs: a dependent chain of 6 adds instead of 16
  // (the same order in every block and on every rank, so the same bits).
  static_assert(warps % 4 == 0 && warps <= kWarps, "four partial sums");
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < warps; ++w) part[w % 4] += sh.red[i][w];
    x[i] = (part[0] + part[1]) + (part[2] + part[3]);
  }
  aborted = *reinterpret_cast<volatile int*>(&sh.abort) != 0;
  if constexpr (kReused) __syncthreads();  // sh.red is reused by the next rows
}

template <bool kReused = true, int kThreads = SK_THREADS>
__device__ __forceinline__ float block_sum(float x, Shared& sh, bool& aborted) {
  float one[1] = {x};
  block_sums<1, kReused, kThreads>(one, sh, aborted);
  return one[0];
}

// Thread-block cluster barrier halves (PTX barrier.cluster): every thread of every block of
// the cluster arrives; wait returns once all non-exited threads have arrived.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The cluster's shape from special registers (cooperative_groups reads it from the driver's
// constant bank: a constant-cache miss on the row split's critical path).
__device__ __forceinline__ int cluster_blocks() {
  uint32_t n;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return static_cast<int>(n);
}
__device__ __forceinline__ int cluster_block_rank() {
  uint32_t r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return static_cast<int>(r);
}

// Row split, at kernel start (before the opening cluster_arrive_relaxed): this block's
// row_parts_arrived expects one 4-byte share from every other block of the cluster (st.async
// targets another CTA; a block keeps its own share in a register).
__device__ void expect_row_parts(Shared& sh) {
  if (threadIdx.x == 0) {
    const uint32_t bar = shared_address(&sh.row_parts_arrived);
    const uint32_t bytes = (cluster_blocks() - 1) * sizeof(float);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
}

// The row split's one exchange: this block's share of the row's sum of squares goes into
// every other cluster block's row_parts[part] by st.async, which completes its bytes on that
// block's row_parts_arrived (release at cluster scope); each block waits on its own barrier
// (relaxed at cluster scope, then one cluster-scope acquire fence restricted to shared memory,
// the pairing PTX gives for st.async), then adds the shares in cluster-rank order, its own from
// the register (the same bits in every block and on every rank). No cluster barrier and no
// release fence on the sending side (a release arrive is a GPU-scope MEMBAR, which waits for
// every store this thread issued, the pushes to peers included). Called exactly once by every
// block of a row-split launch (also one that gave up, with 0), after cluster_wait: that wait
// pairs with the kernel's opening arrive, so every block has started and set up its barrier
// before anyone stores into it. A block leaves only after all shares have landed in its shared
// memory, so no store reaches an exited block. The wait is bounded because every block gets
// here after bounded waits (cluster blocks run together), and a timed-out block still sends
// its share. In two halves, send_row_part then row_total, so that a block can do work that
// needs no total while the shares travel.
__device__ void send_row_part(Shared& sh, float part_sum) {
  const int parts = cluster_blocks(), part = cluster_block_rank();
  const uint32_t bar = shared_address(&sh.row_parts_arrived);
  if (static_cast<int>(threadIdx.x) < parts && static_cast<int>(threadIdx.x) != part) {
    const uint32_t to = threadIdx.x;
    uint32_t slot, remote_bar;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(slot)
                 : "r"(shared_address(&sh.row_parts[part])), "r"(to));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(bar), "r"(to));
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 ::"r"(slot), "r"(__float_as_uint(part_sum)), "r"(remote_bar)
                 : "memory");
  }
}

__device__ float row_total(Shared& sh, float part_sum) {
  const int parts = cluster_blocks(), part = cluster_block_rank();
  const uint32_t bar = shared_address(&sh.row_parts_arrived);
  uint32_t arrived = 0;
  do {
    asm volatile(
        "{ .reg .pred done; mbarrier.try_wait.parity.relaxed.cluster.shared::cta.b64 done, [%1], "
        "0; selp.u32 %0, 1, 0, done; }"
        : "=r"(arrived)
        : "r"(bar)
        : "memory");
  } while (!arrived);
  asm volatile("fence.acquire.sync_restrict::shared::cluster.cluster;" ::: "memory");
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < SK_MAX_ROW_BLOCKS; ++i) {
    if (i < parts) total += (i == part) ? part_sum : sh.row_parts[i];
  }
  return total;
}

// The whole exchange at once, for a block with nothing to do in between (one that gave up).
__device__ float cluster_row_total(Shared& sh, float part_sum) {
  send_row_part(sh, part_sum);
  return row_total(sh, part_sum);
}

__device__ void report_timeout(const SkLaunchParams& p, int src, int kind, uint64_t epoch) {
  uint32_t* ctl = p.control;
  if (atomicCAS(ctl + SK_CTRL_ERR_CODE, 0u, 1u) != 0u) return;  // first error wins
  const uint32_t low = static_cast<uint32_t>(epoch), high = static_cast<uint32_t>(epoch >> 32);
  volatile uint32_t* dev = ctl;
  dev[SK_CTRL_ERR_SRC] = static_cast<uint32_t>(src);
  dev[SK_CTRL_ERR_KIND] = static_cast<uint32_t>(kind);
  dev[SK_CTRL_ERR_EPOCH] = low;
  dev[SK_CTRL_ERR_EPOCH_HIGH] = high;
  volatile uint32_t* host = p.error_host;
  host[SK_CTRL_ERR_SRC] = static_cast<uint32_t>(src);
  host[SK_CTRL_ERR_KIND] = static_cast<uint32_t>(kind);
  host[SK_CTRL_ERR_EPOCH] = low;
  host[SK_CTRL_ERR_EPOCH_HIGH] = high;
  __threadfence_system();
  host[SK_CTRL_ERR_CODE] = 1u;
  __threadfence_system();
}

// Test hook: stalls the debug_delay_rank's block (all threads) for debug_delay_ns.
__device__ void debug_delay(const SkLaunchParams& p) {
  if (p.debug_delay_ns == 0 || p.debug_delay_rank != p.rank) return;
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t start = globaltimer_ns();
    while (globaltimer_ns() - start < p.debug_delay_ns) {
    }
  }
  __syncthreads();
}

// Tells ranks rank+1, rank+2, ... (and, with include_self, this rank's other blocks) that this
// block's data of call `epoch` has landed in their memory.
__device__ void signal(const SkLaunchParams& p, int kind, int parity, uint64_t epoch, int block,
                       bool include_self) {
  __syncthreads();  // every thread's stores precede the release below
  const int n = p.world_size - 1 + (include_self ? 1 : 0);
  const int t = threadIdx.x;
  if (t < n) {
    const int dst = (p.rank + 1 + t) % p.world_size;  // t == world_size - 1 is this rank
    st_release_sys(p.flags[dst] + flag_index(kind, parity, p.rank, block), epoch);
  }
}

// Waits until blocks [block_lo, block_lo + nblocks) of every other rank (and of this rank with
// include_self) signalled call `epoch`; flags are split across the block's threads (each flag
// has its own timeout bound, so a thread with two flags may wait up to twice it). Returns false
// when the block must give up (a wait timed out); the result is the same for all threads.
__device__ bool wait_for(const SkLaunchParams& p, Shared& sh, int kind, int parity, uint64_t epoch,
                         int block_lo, int nblocks, bool include_self) {
  for (int i = threadIdx.x; i < p.world_size * nblocks; i += SK_THREADS) {
    const int src = i / nblocks;
    const int block = block_lo + i % nblocks;
    if (src != p.rank || include_self) {
      const uint64_t* flag = p.flags[p.rank] + flag_index(kind, parity, src, block);
      if (!reached(ld_acquire_sys(flag), epoch)) {
        const uint64_t start = globaltimer_ns();
        while (!reached(ld_acquire_sys(flag), epoch)) {
          if (*reinterpret_cast<volatile int*>(&sh.abort)) break;
          if (globaltimer_ns() - start > p.timeout_ns) {
            sh.abort = 1;
            report_timeout(p, src, kind, epoch);
            break;
          }
        }
      }
    }
  }
  __syncthreads();
  if (sh.abort) return false;
  debug_delay(p);
  return true;
}

// residual_out = sum + residual_in; output = RMSNorm(residual_out) * weight, one row at a time,
// rows blockIdx.x, blockIdx.x + gridDim.x, ... `sum_of(v, acc)` yields the all-reduced fp32
// values of vector v (false: a peer timed out). The variance is taken on the fp32 value before
// rounding, as SGLang's RMSNorm does. Returns false when the block gave up. The one-shot fused
// epilogue: its fp32 sum of every rank's vector is kept in registers across the block sum (it
// cannot be recomputed cheaply; add_rmsnorm_reduced_rows below recomputes a 16-bit one).
// Each thread loads the residual and weight of all its vectors of the row before the first
// sum_of: one memory latency for the row instead of a chain of dependent ones per vector.
template <typename T, typename SumOf>
__device__ bool add_rmsnorm_rows(const KernelParams& p, Shared& sh, SumOf sum_of) {
  const int row_vecs = p.hidden / kVecElems;
  const uint4* residual_in = static_cast<const uint4*>(p.residual_in);
  uint4* residual_out = static_cast<uint4*>(p.residual_out);
  const uint4* weight = static_cast<const uint4*>(p.weight);
  uint4* output = static_cast<uint4*>(p.output);
  const int t = threadIdx.x;
  for (int row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t base = static_cast<int64_t>(row) * row_vecs;
    uint4 res[kMaxVecPerThread], w[kMaxVecPerThread];
#pragma unroll
    for (int k = 0; k < kMaxVecPerThread; ++k) {
      const int c = t + k * SK_THREADS;
      if (c < row_vecs) {
        res[k] = __ldcg(residual_in + base + c);
        w[k] = __ldg(weight + c);
      }
    }
    float val[kMaxVecPerThread][8];
    float sum_sq = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxVecPerThread; ++k) {
      const int c = t + k * SK_THREADS;
      if (c < row_vecs) {
        sum_of(base + c, val[k]);
        Vec8<T>::add_to(val[k], res[k]);
        residual_out[base + c] = Vec8<T>::pack(val[k]);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum_sq += val[k][i] * val[k][i];
      }
    }
    bool aborted;
    sum_sq = block_sum(sum_sq, sh, aborted);
    if (aborted) return false;
    // Past the barrier of its last row every thread of the block has its data: no more waits.
    if (row + static_cast<int>(gridDim.x) >= p.rows) let_next_kernel_launch();
    const float scale = rsqrtf(sum_sq * p.inv_hidden + p.eps);
#pragma unroll
    for (int k = 0; k < kMaxVecPerThread; ++k) {
      const int c = t + k * SK_THREADS;
      if (c < row_vecs) {
        float wf[8];
        zero(wf);
        Vec8<T>::add_to(wf, w[k]);
#pragma unroll
        for (int i = 0; i < 8; ++i) val[k][i] = val[k][i] * scale * wf[i];
        output[base + c] = Vec8<T>::pack(val[k]);
      }
    }
  }
  return true;
}

// The same epilogue with each row split across the row_blocks blocks of one thread-block
// cluster (grid = rows x row_blocks, cluster c owns row c): every block polls, sums and writes
// its slice of the row, and the slices' sums of squares meet in distributed shared memory
// (send_row_part; the cluster barrier's arrive is at kernel start, its wait before the poll).
// At verify sizes this spreads a row's reduction over as many SMs as the plain all-reduce
// uses, where add_rmsnorm_rows gives it to one block. A block that gave up still takes part
// in the exchange (a peer block must not wait for it, nor write into the shared memory of a
// block that has exited).
// kPushPartition: sum_of(v) waits for block b of every peer when v is in block b's one-shot
// share (the one-shot); the Lamport two-shot's gathered vectors come from any block.
template <typename T, bool kPushPartition, typename SumOf>
__device__ bool add_rmsnorm_row_split(const KernelParams& p, Shared& sh, SumOf sum_of) {
  const int parts = cluster_blocks(), part = cluster_block_rank();
  uint32_t row;  // cluster c owns row c: its index without a division
  asm("mov.u32 %0, %%clusterid.x;" : "=r"(row));
  const int row_vecs = p.hidden / kVecElems;
  const int per_part = static_cast<int>((static_cast<uint32_t>(row_vecs) + parts - 1) /
                                        static_cast<uint32_t>(parts));
  const int lo = part * per_part, hi = min(row_vecs, lo + per_part);
  const int64_t base = static_cast<int64_t>(row) * row_vecs;
  const uint4* residual_in = static_cast<const uint4*>(p.residual_in);
  uint4* residual_out = static_cast<uint4*>(p.residual_out);
  const uint4* weight = static_cast<const uint4*>(p.weight);
  uint4* output = static_cast<uint4*>(p.output);
  const int t = threadIdx.x;
  uint4 res[kMaxVecPerSlice], w[kMaxVecPerSlice];
#pragma unroll
  for (int k = 0; k < kMaxVecPerSlice; ++k) {
    const int c = lo + t + k * kRowSplitThreads;
    if (c < hi) {
      res[k] = __ldcg(residual_in + base + c);
      w[k] = __ldg(weight + c);
    }
  }
  // The exchange's cluster wait (see send_row_part), here where the loads above are in
  // flight and every block of the cluster arrived long ago, rather than after the block sum.
  cluster_wait();
  // Where the slices tile the row exactly, block b's slice is what every peer's block b pushed
  // (the one-shot share, oneshot_share): once a thread's first vector has arrived from every
  // peer, each peer block this block waits on has started, as in the plain all-reduce, and the
  // next kernel may launch. Otherwise the block's barrier below is the first such point.
  const bool polls_own_index = kPushPartition && per_part * parts == row_vecs;
  float val[kMaxVecPerSlice][8];
  float sum_sq = 0.f;
  bool ok = true;
#pragma unroll
  for (int k = 0; k < kMaxVecPerSlice; ++k) {
    const int c = lo + t + k * kRowSplitThreads;
    if (c < hi && ok) {
      ok = sum_of(base + c, val[k]);
      if (k == 0 && ok && polls_own_index) let_next_kernel_launch();
      Vec8<T>::add_to(val[k], res[k]);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum_sq += val[k][i] * val[k][i];
    }
  }
  bool aborted;
  sum_sq = block_sum<false, kRowSplitThreads>(sum_sq, sh, aborted);  // one row per block: no reuse
  // Where the slices do not tile the row, the first point past which this block waits for no
  // peer: every thread has its peers' data, and what is left waits only for this cluster's
  // blocks, which run together.
  if (!aborted && !polls_own_index) let_next_kernel_launch();
  send_row_part(sh, sum_sq);
  // While the shares travel: residual_out, and the weight applied, so that after the exchange
  // only the scale is left (output = (sum * weight) * scale).
#pragma unroll
  for (int k = 0; k < kMaxVecPerSlice; ++k) {
    const int c = lo + t + k * kRowSplitThreads;
    if (c < hi && !aborted) {
      residual_out[base + c] = Vec8<T>::pack(val[k]);
      float wf[8];
      zero(wf);
      Vec8<T>::add_to(wf, w[k]);
#pragma unroll
      for (int i = 0; i < 8; ++i) val[k][i] *= wf[i];
    }
  }
  const float total = row_total(sh, sum_sq);
  if (aborted) return false;
  const float scale = rsqrtf(total * p.inv_hidden + p.eps);
#pragma unroll
  for (int k = 0; k < kMaxVecPerSlice; ++k) {
    const int c = lo + t + k * kRowSplitThreads;
    if (c < hi) {
#pragma unroll
      for (int i = 0; i < 8; ++i) val[k][i] *= scale;
      output[base + c] = Vec8<T>::pack(val[k]);
    }
  }
  return true;
}

// The rows a block normalises in add_rmsnorm_reduced_rows, walked with a (group, index)
// cursor: row(group, index, ahead) is the row `ahead` places past it (-1 past the set's end),
// settle moves it onto a row of the set.
// Rows b, b + grid, b + 2 grid, ... of block b (one group): any partition of the message.
struct StridedRows {
  int rows;
  __device__ __forceinline__ void settle(int&, int&) const {}
  __device__ __forceinline__ int row(int, int index, int ahead) const {
    const int r = blockIdx.x + (index + ahead) * gridDim.x;
    return r < rows ? r : -1;
  }
};

// The two-shot fused call in whole-row pieces (the row-pieces kernel): block b's piece of every
// rank's chunk, which are exactly the rows block b of each rank reduced and gathered. Group g
// is rank g's chunk, its rows g * chunk_rows + b * piece_rows, ... The cursor steps groups
// instead of dividing (a runtime integer division is ~20 dependent instructions, and a pass of
// three rows finds each row three times: 1x H200, TP8 2048 tokens, 550 us with a division per
// row, 536 without, in two runs).
struct PieceRows {
  int groups, chunk_rows, first, per_group, rows;
  __device__ PieceRows(const KernelParams& p)
      : groups(p.world_size), chunk_rows(p.chunk_rows), first(blockIdx.x * p.piece_rows),
        per_group(max(0, min(p.piece_rows, p.chunk_rows - first))), rows(p.rows) {}
  __device__ __forceinline__ void settle(int& group, int& index) const {
    while (index >= per_group && group < groups) {
      index -= per_group;
      ++group;
    }
  }
  __device__ __forceinline__ int row(int group, int index, int ahead) const {
    index += ahead;
    settle(group, index);
    const int r = group * chunk_rows + first + index;
    return group < groups && r < rows ? r : -1;
  }
};

// residual_out = reduced + residual_in; output = RMSNorm(residual_out) * weight, where the
// all-reduced rows are already 16-bit vectors in `reduced` (the split fused call's second launch,
// the two-shot fused epilogue). Only the raw 16-byte vectors stay in registers across the block
// sum; the fp32 sum is computed again for the scaling pass (the same operations, so the same
// bits). `reduced` may alias `output` (each thread reads its vectors before it writes them).
// kRows rows of `set` (StridedRows, PieceRows) at a time, with one block sum for all of them:
// a block that owns many rows pays one memory latency and one barrier pair per kRows rows.
// Each thread holds kSlots vectors of each row (kMaxVecPerThread for any hidden size, 2 up to
// hidden 8192). kRows = 1 needs 64 registers, so two 512-thread blocks of the norm-only kernel
// fit on an SM; 2 x 4 and 3 x 2 fit the all-reduce kernel's 128 (4 x 2, or holding the weight
// too, spills).
template <typename T, int kRows, int kSlots = kMaxVecPerThread, typename Rows>
__device__ bool add_rmsnorm_reduced_rows(const KernelParams& p, Shared& sh, const uint4* reduced,
                                         const Rows& set) {
  static_assert(kRows >= 1 && kRows <= kRowsPerPass, "sh.red holds kRowsPerPass sums");
  static_assert(kSlots >= 1 && kSlots <= kMaxVecPerThread, "a row is at most kMaxVecPerThread");
  const int row_vecs = p.hidden / kVecElems;
  const uint4* residual_in = static_cast<const uint4*>(p.residual_in);
  uint4* residual_out = static_cast<uint4*>(p.residual_out);
  const uint4* weight = static_cast<const uint4*>(p.weight);
  uint4* output = static_cast<uint4*>(p.output);
  const int t = threadIdx.x;
  auto sum = [](float (&val)[8], const uint4& x, const uint4& res) {
    zero(val);
    Vec8<T>::add_to(val, x);
    Vec8<T>::add_to(val, res);
  };
  int group = 0, index = 0;
  set.settle(group, index);
  for (; set.row(group, index, 0) >= 0; index += kRows, set.settle(group, index)) {
    uint4 x[kRows][kSlots], res[kRows][kSlots];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = set.row(group, index, r);
      const int64_t base = static_cast<int64_t>(row) * row_vecs;
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const int c = t + k * SK_THREADS;
        if (row >= 0 && c < row_vecs) {
          x[r][k] = __ldcg(reduced + base + c);
          res[r][k] = __ldcg(residual_in + base + c);
        }
      }
    }
    float sum_sq[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = set.row(group, index, r);
      const int64_t base = static_cast<int64_t>(row) * row_vecs;
      sum_sq[r] = 0.f;
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const int c = t + k * SK_THREADS;
        if (row >= 0 && c < row_vecs) {
          float val[8];
          sum(val, x[r][k], res[r][k]);
          residual_out[base + c] = Vec8<T>::pack(val);
#pragma unroll
          for (int i = 0; i < 8; ++i) sum_sq[r] += val[i] * val[i];
        }
      }
    }
    bool aborted;
    block_sums<kRows>(sum_sq, sh, aborted);
    if (aborted) return false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = set.row(group, index, r);
      const int64_t base = static_cast<int64_t>(row) * row_vecs;
      const float scale = rsqrtf(sum_sq[r] * p.inv_hidden + p.eps);
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const int c = t + k * SK_THREADS;
        if (row >= 0 && c < row_vecs) {
          float val[8], wf[8];
          sum(val, x[r][k], res[r][k]);
          zero(wf);
          Vec8<T>::add_to(wf, __ldg(weight + c));  // an L1 hit after the first row
#pragma unroll
          for (int i = 0; i < 8; ++i) val[i] = val[i] * scale * wf[i];
          output[base + c] = Vec8<T>::pack(val);
        }
      }
    }
  }
  return true;
}

constexpr int kLowSlots = SK_MAX_RANKS / 2;  // poll_arrived: slots checked without a guard

// How long a Lamport wait may last. A wait for gathered data (the Lamport two-shot's second
// phase) gets twice the bound: where a rank never came, the live ranks' gathers stall too, and
// a gather wait that expired first would record a live rank (the owner of the chunk it reads)
// as missing; the reduce-scatter wait, which names the rank that did not come, must win the
// error record (first error wins).
__device__ __forceinline__ uint64_t wait_bound(const SkLaunchParams& p, int kind) {
  return kind == kKindGather ? 2 * p.timeout_ns : p.timeout_ns;
}

// Polls entry `index` of the slots of ranks [0, polled) other than this one (this rank's
// receive buffer of this call) until no lane of any is empty, into u; the other entries hold
// `mine`, which is sendable, so never empty. False when the wait timed out (or another thread
// of the block gave up), after recording who was missing (`kind`: which phase; see
// wait_bound). One predicated load per peer: at verify sizes the poll's instructions are its
// cost. Each re-poll checks slots 0-3 without a guard and 4-7 behind one uniform branch
// (polled > 4).
__device__ __forceinline__ bool poll_arrived(uint4 (&u)[SK_MAX_RANKS], const SkLaunchParams& p,
                                             Shared& sh, const uint4* slots, int64_t slot_vecs,
                                             int64_t index, const uint4& mine, int polled,
                                             int kind, uint64_t epoch) {
  const int rank = p.rank;
#pragma unroll
  for (int j = 0; j < SK_MAX_RANKS; ++j) {
    u[j] = mine;  // this rank's slot, and ranks past `polled`: never polled
    if (j < polled && j != rank) u[j] = ld_volatile_v4(slots + j * slot_vecs + index);
  }
  uint64_t start = 0;
  for (;;) {
    int missing = -1;  // the lowest rank still missing
    if (polled > kLowSlots) {
#pragma unroll
      for (int j = SK_MAX_RANKS - 1; j >= kLowSlots; --j) {
        if (has_empty_lane(u[j])) missing = j;
      }
    }
#pragma unroll
    for (int j = kLowSlots - 1; j >= 0; --j) {
      if (has_empty_lane(u[j])) missing = j;
    }
    if (missing < 0) return true;
    if (start == 0) {
      start = globaltimer_ns();
    } else if (globaltimer_ns() - start > wait_bound(p, kind)) {
      sh.abort = 1;
      report_timeout(p, missing, kind, epoch);
      return false;
    }
    if (*reinterpret_cast<volatile int*>(&sh.abort)) return false;
#pragma unroll
    for (int j = 0; j < kLowSlots; ++j) {
      if (has_empty_lane(u[j])) u[j] = ld_volatile_v4(slots + j * slot_vecs + index);
    }
    if (polled > kLowSlots) {
#pragma unroll
      for (int j = kLowSlots; j < SK_MAX_RANKS; ++j) {
        if (has_empty_lane(u[j])) u[j] = ld_volatile_v4(slots + j * slot_vecs + index);
      }
    }
  }
}

// Polls one Lamport entry, written by rank `src`, until no lane of it is empty (see
// poll_arrived).
__device__ __forceinline__ bool poll_one(uint4& u, const SkLaunchParams& p, Shared& sh,
                                         const uint4* at, int src, int kind, uint64_t epoch) {
  u = ld_volatile_v4(at);
  if (!has_empty_lane(u)) return true;
  const uint64_t start = globaltimer_ns();
  for (;;) {
    if (*reinterpret_cast<volatile int*>(&sh.abort)) return false;
    if (globaltimer_ns() - start > wait_bound(p, kind)) {
      sh.abort = 1;
      report_timeout(p, src, kind, epoch);
      return false;
    }
    u = ld_volatile_v4(at);
    if (!has_empty_lane(u)) return true;
  }
}

// Sum over ranks of a Lamport-pushed vector: this rank's own input[v] plus what every peer
// pushed into entry `index` of its slot of `slots`, in rank order so all ranks get the same
// bits (see poll_arrived; false: the wait gave up). The one-shot's index is v itself.
template <typename T>
__device__ bool sum_arrived(float (&acc)[8], const SkLaunchParams& p, Shared& sh,
                            const uint4* slots, int64_t slot_vecs, int64_t index,
                            const uint4* input, int64_t v, uint64_t epoch) {
  uint4 u[SK_MAX_RANKS];
  const bool ok = poll_arrived(u, p, sh, slots, slot_vecs, index, sendable(input[v]),
                               p.world_size, kKindPush, epoch);
  zero(acc);
#pragma unroll
  for (int j = 0; j < SK_MAX_RANKS; ++j) {
    if (j < p.world_size) Vec8<T>::add_to(acc, u[j]);
  }
  return ok;
}

// Lamport buffer rotation, shared by the one-shot and the Lamport two-shot (see the top of
// this file): each call of either reads buffer `current` and clears buffer `previous`, which
// it read in its previous call. The call state keeps, per buffer, a dirty word: vectors per
// peer slot written into it, with kDirtyOwnSlot set where this rank also wrote its own slot
// (the fused Lamport two-shot's gather; the one-shot never writes it).
constexpr uint32_t kDirtyOwnSlot = 0x80000000u;

// This call's buffer and the one it clears; the negative control (SK_DEBUG_SINGLE_BUFFER)
// keeps buffer 0 and never clears.
struct LamportBuffers {
  bool single;
  int current, previous;
};

__device__ __forceinline__ LamportBuffers lamport_buffers(const SkLaunchParams& p,
                                                          const uint32_t (&state)[SK_STATE_WORDS]) {
  const bool single = (p.debug_flags & SK_DEBUG_SINGLE_BUFFER) != 0;
  const int current =
      single ? 0 : static_cast<int>(state[kStateOneshotBuffer] % SK_LAMPORT_BUFFERS);
  return {single, current, (current + SK_LAMPORT_BUFFERS - 1) % SK_LAMPORT_BUFFERS};
}

__device__ __forceinline__ uint32_t dirty_word(const uint32_t (&state)[SK_STATE_WORDS],
                                               int buffer) {
  uint32_t word = 0;
  // Constant indices only (a runtime index would put `state` in local memory).
#pragma unroll
  for (int b = 0; b < SK_LAMPORT_BUFFERS; ++b) word = (b == buffer) ? state[kStateDirty + b] : word;
  return word;
}

// The next call's buffer, and what this call leaves dirty in each (`written` in `current`).
__device__ __forceinline__ void advance_buffers(uint32_t (&state)[SK_STATE_WORDS], int current,
                                                int previous, uint32_t written) {
#pragma unroll
  for (int b = 0; b < SK_LAMPORT_BUFFERS; ++b) {
    if (b == previous) state[kStateDirty + b] = 0;
    if (b == current) state[kStateDirty + b] = written;
  }
  state[kStateOneshotBuffer] = (current + 1) % SK_LAMPORT_BUFFERS;
}

// Which threads clear the previous buffer: this thread's index among the `count` clearers of
// the block, or < 0 when it only pushes and polls. When a block's pushes leave at least one warp
// without a vector (verify sizes), those warps clear, so the pushing threads go straight to
// their polls: at TP2, 16 tokens (448 vectors in a 512-thread block, two clearing warps) this
// took the fused one-shot call from 5.3 to 4.8 us (1x H200, ranks as streams); a 256-thread
// row-split block of 224 vectors keeps one clearing warp. Otherwise, and when the previous call
// left more than kMaxSplitClears vectors per peer slot for each such clearer (a prefill before a
// verify step), every thread clears after its pushes. The dirty word, and so the clearer count,
// is the same in every block, so the blocks' shares tile what is dirty. Roles go by whole warps:
// a warp holding one pusher would make it wait for its clearing lanes.
struct ClearRoles {
  int clearer, count;
};

template <int kThreads>
__device__ __forceinline__ ClearRoles clear_roles(int64_t pushed_per_block, uint32_t previous_word,
                                                  int nblocks) {
  constexpr int64_t kMaxSplitClears = 8;
  const int64_t dirty = previous_word & ~kDirtyOwnSlot;
  const int vector_threads = static_cast<int>(min(pushed_per_block, static_cast<int64_t>(kThreads)));
  const int pushers = min(kThreads, (vector_threads + 31) / 32 * 32);
  const int spare = kThreads - pushers;
  const bool split = spare > 0 && dirty <= kMaxSplitClears * static_cast<int64_t>(nblocks) * spare;
  const int t = threadIdx.x;
  return split ? ClearRoles{t - pushers, spare} : ClearRoles{t, kThreads};
}

// Back to "not arrived" (0xFFFF lanes): what peers wrote into `buffer` in this rank's previous
// call of it, and this rank's own slot where it wrote that too. The blocks' clearers split it.
__device__ __forceinline__ void clear_previous_buffer(const KernelParams& p, uint4* buffer,
                                                      int64_t slot_vecs, uint32_t previous_word,
                                                      const ClearRoles& roles) {
  if (roles.clearer < 0) return;  // a pusher goes straight to its polls
  const uint4 empty = make_uint4(kEmptyWord, kEmptyWord, kEmptyWord, kEmptyWord);
  const int64_t dirty = previous_word & ~kDirtyOwnSlot;
  const bool own_slot = (previous_word & kDirtyOwnSlot) != 0;
  const int64_t step = static_cast<int64_t>(gridDim.x) * roles.count;
  for (int src = 0; src < p.world_size; ++src) {
    if (src == p.rank && !own_slot) continue;  // the one-shot never writes its own slot
    uint4* slot = buffer + src * slot_vecs;
    // This rank's own slot holds gather entries only: the upper half of the dirty range.
    const int64_t first = src == p.rank ? dirty / 2 : 0;
    for (int64_t i = first + static_cast<int64_t>(blockIdx.x) * roles.count + roles.clearer;
         i < dirty; i += step) {
      slot[i] = empty;
    }
  }
}

// This block's share [v0, v1) of a one-shot message of nvec vectors (the same partition on
// every rank: rank r's block b pushes exactly what every peer's block b polls); per_block is
// the share size every block but the last has, divided out on the host (KernelParams).
struct OneshotShare {
  int64_t v0, v1, per_block;
};

__device__ __forceinline__ OneshotShare oneshot_share(const KernelParams& p) {
  const int64_t nvec = p.numel / kVecElems, per_block = p.oneshot_per_block;
  const int64_t v0 = min(nvec, static_cast<int64_t>(blockIdx.x) * per_block);
  return {v0, min(nvec, v0 + per_block), per_block};
}

// One-shot, Lamport-style (see the top of this file). `state` is this call's state; the
// one-shot buffer and dirty sizes in it are advanced here for the copies the kernel writes.
template <typename T, bool kFused, bool kPreloaded, bool kRowSplit>
__device__ void run_oneshot(const KernelParams& p, Shared& sh, uint32_t (&state)[SK_STATE_WORDS],
                            uint64_t epoch, const OneshotShare& share, const uint4& first_input) {
  constexpr int kThreads = block_threads(kRowSplit);
  const int world = p.world_size, rank = p.rank, t = threadIdx.x;
  const int nblocks = gridDim.x;
  const LamportBuffers buffers = lamport_buffers(p, state);
  const int current = buffers.current, previous = buffers.previous;
  const int64_t nvec = p.numel / kVecElems;
  const int64_t slot_vecs = p.lamport_slot_bytes / 16;
  const int64_t buffer_vecs = static_cast<int64_t>(world) * slot_vecs;
  const uint4* input = static_cast<const uint4*>(p.input);

  // Push this block's share (by bytes, like the plain reduction below) into every peer's
  // buffer, peer rank+1 first, so each rank starts on a different peer. Each vector is loaded
  // once (the first one before the call state was read, see all_reduce_kernel).
  const int64_t v0 = share.v0, v1 = share.v1, per_block = share.per_block;
  // Unrolled over the peers: independent stores, each through a pointer at a fixed parameter
  // offset (lamport_from), no rank arithmetic.
  const int64_t push_offset = current * buffer_vecs + rank * slot_vecs;
  auto push = [&](int64_t v, const uint4& value) {
    const uint4 data = sendable(value);
#pragma unroll
    for (int s = 1; s < SK_MAX_RANKS; ++s) {
      if (s < world) static_cast<uint4*>(p.lamport_from[s])[push_offset + v] = data;
    }
  };
  int64_t v = v0 + t;
  if (kPreloaded && v < v1) {
    push(v, first_input);
    v += kThreads;
  }
  for (; v < v1; v += kThreads) push(v, input[v]);
  asm volatile("" ::: "memory");  // the pushes stay before every poll below
  stamp(p, 2);

  // Clear the previous buffer while peers' data of this call is on its way (see
  // clear_previous_buffer; clear_roles for who clears).
  uint4* own = static_cast<uint4*>(p.lamport_from[0]);
  if (!buffers.single) {
    const uint32_t previous_word = dirty_word(state, previous);
    const ClearRoles roles = clear_roles<kThreads>(per_block, previous_word, nblocks);
    clear_previous_buffer(p, own + previous * buffer_vecs, slot_vecs, previous_word, roles);
    advance_buffers(state, current, previous, static_cast<uint32_t>(nvec));
  }
  stamp(p, 3);
  debug_delay(p);

  const uint4* slots = own + current * buffer_vecs;
  if constexpr (!kFused) {
    uint4* output = static_cast<uint4*>(p.output);
    for (int64_t v = v0 + t; v < v1; v += kThreads) {
      float acc[8];
      if (!sum_arrived<T>(acc, p, sh, slots, slot_vecs, v, input, v, epoch)) break;
      // Every peer's block of this index pushed vector v: each has started, and it pushes
      // every vector this block waits for (the same partition). A thread without a vector
      // never issues it; a block without any counts as having issued it when it exits.
      if (v == v0 + t) let_next_kernel_launch();
      output[v] = Vec8<T>::pack(acc);
    }
    stamp(p, 4);
  } else {
    // Rows do not follow the push partition, and need not: each block polls the rows (or the
    // slice of its row) it owns.
    auto sum_of = [&](int64_t v, float (&acc)[8]) {
      return sum_arrived<T>(acc, p, sh, slots, slot_vecs, v, input, v, epoch);
    };
    if constexpr (kRowSplit) {
      add_rmsnorm_row_split<T, true>(p, sh, sum_of);
    } else {
      add_rmsnorm_rows<T>(p, sh, sum_of);
    }
    stamp(p, 4);
  }
}

// Lamport two-shot (SK_VARIANT_TWOSHOT_LAMPORT): the two-shot's reduce-scatter and all-gather
// with each phase's data its own "arrived" signal, as in the one-shot: no flags, no release
// fences, no barrier between them. It lives in the one-shot's buffers and rotation (a call of
// either kind reads the next buffer and clears the one it read before). In rank r's buffer,
// slot s holds what rank s wrote: entries [0, chunk) its input's chunk r (reduce-scatter), and
// [chunk, 2 chunk) its reduced chunk s (all-gather). Block b reduces piece b of this rank's
// chunk and polls piece b of every other chunk, so it waits only for block b of each peer,
// which pushes exactly those vectors. The fused kernel's rows span chunks, so its epilogue polls
// the gathered rows wherever they are, this rank's own chunk included: there each block also
// writes its reduced piece into this rank's own slot (kDirtyOwnSlot), from which other blocks of
// this rank read it. Every chunk must be non-empty (sk_launch checks it): the rotation's safety
// needs every peer to wait for data of this rank in every call.
template <typename T, bool kFused, bool kRowSplit>
__device__ void run_twoshot_lamport(const KernelParams& p, Shared& sh,
                                    uint32_t (&state)[SK_STATE_WORDS], uint64_t epoch) {
  constexpr int kThreads = block_threads(kRowSplit);
  const int world = p.world_size, rank = p.rank, t = threadIdx.x;
  const LamportBuffers buffers = lamport_buffers(p, state);
  const int current = buffers.current, previous = buffers.previous;
  const int64_t nvec = p.numel / kVecElems;
  const int64_t slot_vecs = p.lamport_slot_bytes / 16;
  const int64_t buffer_vecs = static_cast<int64_t>(world) * slot_vecs;
  const int64_t chunk = p.twoshot_chunk;
  // This block's piece of every chunk: entries [lo, hi) of it (the last chunk may end early).
  const int64_t lo = min(chunk, static_cast<int64_t>(blockIdx.x) * p.twoshot_piece);
  const int64_t hi = min(chunk, lo + p.twoshot_piece);
  const int64_t last_chunk_end = nvec - (world - 1) * chunk;  // entries of chunk world - 1
  const uint4* input = static_cast<const uint4*>(p.input);
  uint4* own = static_cast<uint4*>(p.lamport_from[0]);
  const int64_t my_slot = current * buffer_vecs + rank * slot_vecs;  // in every rank's buffer

  // Reduce-scatter: entry i of chunk (rank + s) % world goes to that peer, all of a thread's
  // loads first (independent), then its stores, each through a fixed parameter offset.
  for (int64_t i = lo + t; i < hi; i += kThreads) {
    uint4 u[SK_MAX_RANKS];
#pragma unroll
    for (int s = 1; s < SK_MAX_RANKS; ++s) {
      const int owner = rank + s < world ? rank + s : rank + s - world;
      if (s < world && (owner < world - 1 || i < last_chunk_end)) u[s] = input[owner * chunk + i];
    }
#pragma unroll
    for (int s = 1; s < SK_MAX_RANKS; ++s) {
      const int owner = rank + s < world ? rank + s : rank + s - world;
      if (s < world && (owner < world - 1 || i < last_chunk_end)) {
        static_cast<uint4*>(p.lamport_from[s])[my_slot + i] = sendable(u[s]);
      }
    }
  }
  asm volatile("" ::: "memory");  // the pushes stay before every poll below
  stamp(p, 2);

  const uint32_t written = static_cast<uint32_t>(2 * chunk) | (kFused ? kDirtyOwnSlot : 0u);
  if (!buffers.single) {
    const uint32_t previous_word = dirty_word(state, previous);
    // The same count in every block, so that the blocks' clearers tile the buffer.
    const ClearRoles roles = clear_roles<kThreads>(p.twoshot_piece, previous_word, gridDim.x);
    clear_previous_buffer(p, own + previous * buffer_vecs, slot_vecs, previous_word, roles);
    advance_buffers(state, current, previous, written);
  }
  stamp(p, 3);
  debug_delay(p);

  // Reduce this rank's piece, then push it to every rank's gather entries (and, fused, to this
  // rank's own slot; plain, to the output). A thread that gave up stops pushing: its peers'
  // gather waits for the rest time out (their own reduce-scatter waits, if any, first).
  const uint4* slots = own + current * buffer_vecs;
  const int64_t my_end = rank < world - 1 ? chunk : last_chunk_end;
  const int64_t gathered = my_slot + chunk;  // this rank's gather entries, in every buffer
  bool ok = true;
  for (int64_t i = lo + t; i < min(hi, my_end); i += kThreads) {
    float acc[8];
    ok = sum_arrived<T>(acc, p, sh, slots, slot_vecs, i, input + rank * chunk, i, epoch);
    if (!ok) break;
    // Every peer's block of this index pushed entry i: each has started, and from here on this
    // block waits only for those blocks (plain) or for blocks the epilogue reads (fused).
    if (!kFused && i == lo + t) let_next_kernel_launch();
    const uint4 reduced = sendable(Vec8<T>::pack(acc));
#pragma unroll
    for (int s = 1; s < SK_MAX_RANKS; ++s) {
      if (s < world) static_cast<uint4*>(p.lamport_from[s])[gathered + i] = reduced;
    }
    if constexpr (kFused) {
      own[gathered + i] = reduced;
    } else {
      static_cast<uint4*>(p.output)[rank * chunk + i] = reduced;
    }
  }
  asm volatile("" ::: "memory");

  if constexpr (!kFused) {
    // Piece b of every other chunk, from block b of its owner: all owners' entry i at once.
    for (int64_t i = lo + t; ok && i < hi; i += kThreads) {
      uint4 u[SK_MAX_RANKS];
      const int polled = i < last_chunk_end ? world : world - 1;  // the last chunk may end early
      ok = poll_arrived(u, p, sh, slots + chunk, slot_vecs, i, make_uint4(0, 0, 0, 0), polled,
                        kKindGather, epoch);
      if (!ok) break;
      if (i == lo + t) let_next_kernel_launch();
      uint4* output = static_cast<uint4*>(p.output);
#pragma unroll
      for (int j = 0; j < SK_MAX_RANKS; ++j) {
        if (j < polled && j != rank) output[j * chunk + i] = u[j];
      }
    }
    stamp(p, 4);
  } else {
    // Gathered vector v: entry v - k chunk of rank k's slot (k = v / chunk), this rank's own
    // included. A block that gave up above still runs the epilogue (the row split's exchange
    // needs every block of the cluster): its polls see sh.abort and give up at once.
    const uint32_t chunk32 = static_cast<uint32_t>(chunk);  // sk_launch: nvec < 2^31
    auto sum_of = [&](int64_t v, float (&acc)[8]) {
      const uint32_t k = static_cast<uint32_t>(v) / chunk32;
      const int64_t index = v - static_cast<int64_t>(k) * chunk;
      uint4 u;
      const bool arrived =
          poll_one(u, p, sh, slots + chunk + k * slot_vecs + index, k, kKindGather, epoch);
      zero(acc);
      Vec8<T>::add_to(acc, u);
      return arrived;
    };
    if constexpr (kRowSplit) {
      add_rmsnorm_row_split<T, false>(p, sh, sum_of);
    } else {
      add_rmsnorm_rows<T>(p, sh, sum_of);
    }
    stamp(p, 4);
  }
}

// The two-shot fused epilogue over `set`: as many rows per pass as fit in registers.
template <typename T, typename Rows>
__device__ void normalise_gathered(const KernelParams& p, Shared& sh, const uint4* gathered,
                                   const Rows& set) {
  if (p.hidden / kVecElems <= 2 * SK_THREADS) {
    add_rmsnorm_reduced_rows<T, 3, 2>(p, sh, gathered, set);
  } else {
    add_rmsnorm_reduced_rows<T, 2>(p, sh, gathered, set);
  }
}

// Two-shot: reduce-scatter (rank j reduces chunk j), then all-gather of the reduced chunks.
// kPieces (fused only): chunks and pieces are whole rows (p.chunk_rows, p.piece_rows; sk_launch
// picks it when a chunk has at least as many rows as there are blocks and fits a slot; a piece
// is ceil(chunk_rows / blocks) rows, the last blocks' pieces short or empty). Block b then
// reduces whole rows, and normalises the rows of piece b of every chunk after waiting for block
// b of each rank alone, instead of for every block of every rank. Its own instantiation: the
// other two-shot fused kernel keeps only the code its calls run (with both, 8-128 tokens at
// 4 and 8 ranks took 0.5-1.4 us longer, 1x H200).
template <typename T, bool kFused, bool kPieces>
__device__ void run_twoshot(const KernelParams& p, Shared& sh, uint64_t epoch, int parity) {
  const int world = p.world_size, rank = p.rank, t = threadIdx.x;
  const int block = blockIdx.x, nblocks = gridDim.x;
  const int64_t nvec = p.numel / kVecElems;
  const int64_t slot_vecs = p.slot_bytes / 16;
  int64_t chunk, piece;  // vectors owned by each rank; this block's share of a chunk
  if constexpr (kPieces) {
    const int64_t row_vecs = p.hidden / kVecElems;
    chunk = p.chunk_rows * row_vecs;
    piece = p.piece_rows * row_vecs;
  } else {
    chunk = (nvec + world - 1) / world;
    piece = (chunk + nblocks - 1) / nblocks;
  }
  const uint4* input = static_cast<const uint4*>(p.input);
  auto piece_of = [&](int owner, int64_t& lo, int64_t& hi) {
    const int64_t start = owner * chunk;
    lo = min(nvec, start + min(chunk, block * piece));
    hi = min(nvec, start + min(chunk, (block + 1) * piece));
  };

  // Reduce-scatter: this block's piece of chunk j goes to slot [rank] of rank j.
  for (int s = 1; s < world; ++s) {
    const int owner = (rank + s) % world;
    int64_t lo, hi;
    piece_of(owner, lo, hi);
    const int64_t start = owner * chunk;
    uint4* slot = static_cast<uint4*>(p.push[owner]) + (static_cast<int64_t>(parity) * world + rank) * slot_vecs;
    for (int64_t v = lo + t; v < hi; v += SK_THREADS) slot[v - start] = input[v];
  }
  signal(p, kKindPush, parity, epoch, block, false);
  stamp(p, 2);
  if (!wait_for(p, sh, kKindPush, parity, epoch, block, 1, false)) return;
  stamp(p, 3);

  // Reduce this rank's piece and push it to every rank's gather buffer.
  int64_t lo, hi;
  piece_of(rank, lo, hi);
  const int64_t start = rank * chunk;
  const uint4* slots = static_cast<const uint4*>(p.push[rank]) + static_cast<int64_t>(parity) * world * slot_vecs;
  uint4* gather_local = static_cast<uint4*>(p.gather[rank]);
  uint4* reduced = kFused ? gather_local : static_cast<uint4*>(p.output);
  for (int64_t v = lo + t; v < hi; v += SK_THREADS) {
    float acc[8];
    sum_ranks<T>(acc, slots, slot_vecs, v - start, input, v, world, rank);
    reduced[v] = Vec8<T>::pack(acc);
  }
  for (int s = 1; s < world; ++s) {
    uint4* gather = static_cast<uint4*>(p.gather[(rank + s) % world]);
    for (int64_t v = lo + t; v < hi; v += SK_THREADS) gather[v] = reduced[v];  // own stores
  }
  // The strided epilogue also waits for this rank's own blocks; whole-row pieces do not.
  signal(p, kKindGather, parity, epoch, block, kFused && !kPieces);
  stamp(p, 4);

  // After the last wait (its barrier: every thread is past it) the block waits for no peer.
  if constexpr (!kFused) {
    if (!wait_for(p, sh, kKindGather, parity, epoch, block, 1, false)) return;
    let_next_kernel_launch();
    uint4* output = static_cast<uint4*>(p.output);
    for (int s = 1; s < world; ++s) {
      int64_t olo, ohi;
      piece_of((rank + s) % world, olo, ohi);
      for (int64_t v = olo + t; v < ohi; v += SK_THREADS) output[v] = __ldcg(gather_local + v);
    }
  } else if constexpr (kPieces) {
    // This block's rows were reduced by block `block` of each rank (its own by this block).
    if (!wait_for(p, sh, kKindGather, parity, epoch, block, 1, false)) return;
    let_next_kernel_launch();
    normalise_gathered<T>(p, sh, gather_local, PieceRows(p));
  } else {
    // Rows span chunks: wait for every block of every rank, this one included.
    if (!wait_for(p, sh, kKindGather, parity, epoch, 0, nblocks, true)) return;
    let_next_kernel_launch();
    // Rows a block owns: at most one (every block's a row), else as many per pass as fit.
    if (p.rows <= nblocks) {
      add_rmsnorm_reduced_rows<T, 1>(p, sh, gather_local, StridedRows{p.rows});
    } else {
      normalise_gathered<T>(p, sh, gather_local, StridedRows{p.rows});
    }
  }
}

// Residual add + RMSNorm of `input` (already reduced): the second launch of a split fused
// call. No peers, no call state: any grid size.
template <typename T>
__global__ void __launch_bounds__(SK_THREADS, 2) add_rmsnorm_kernel(const KernelParams p) {
  __shared__ Shared sh;
  wait_for_previous_kernel();
  let_next_kernel_launch();  // no waits here: every block of it has started once all issue it
  if (threadIdx.x == 0) sh.abort = 0;
  __syncthreads();
  add_rmsnorm_reduced_rows<T, 1>(p, sh, static_cast<const uint4*>(p.input), StridedRows{p.rows});
}

// One kernel per (dtype, variant, fused): each holds only the code its calls run (the plain
// one-shot kernel is 2.1k SASS instructions; one kernel with every path was 7.4k). Nsight
// Compute at 4 tokens, TP2 H200, warm calls: instruction-fetch stalls are 6% of the plain
// kernel's active warp cycles (FlashInfer's fused kernel: 1.6%); the split did not move the
// graph-timed call time beyond run-to-run noise (README, "Measured").
// kRowSplit: a fused Lamport kernel (one-shot or two-shot) launched as one cluster per row
// (row_blocks > 1), in blocks of kRowSplitThreads; its own instantiation, as both epilogues in
// one kernel exceed 128 registers and spill.
// kPieces: the two-shot fused kernel in whole-row pieces (run_twoshot).
template <typename T, int kVariant, bool kFused, bool kRowSplit = false, bool kPieces = false>
__global__ void __launch_bounds__(block_threads(kRowSplit), kRowSplit ? 2 : 1)
    all_reduce_kernel(const KernelParams p) {
  constexpr int kThreads = block_threads(kRowSplit);
  __shared__ Shared sh;
  uint32_t* ctl = p.control;
  uint32_t* states = ctl + SK_STATE_OFFSET_WORDS;
  const Start start = read_start(p);
  wait_for_previous_kernel();
  stamp_start(p, start);
  if (p.debug_flags & SK_DEBUG_TRIGGER_AT_START) let_next_kernel_launch();
  // Every thread loads this block's call state itself (the same two 16-byte words for the
  // whole block: broadcast loads), in parallel with the error word; no shared-memory staging.
  // One-shot: the first input vector is loaded together with the state (it depends on
  // neither). Not in the block-per-row fused kernel: there the 4 registers it holds would
  // spill (the row split holds a quarter of that kernel's row).
  uint4 first_input = make_uint4(0, 0, 0, 0);
  constexpr bool preload = kVariant == SK_VARIANT_ONESHOT && (!kFused || kRowSplit);
  OneshotShare share{0, 0, 0};
  if constexpr (kVariant == SK_VARIANT_ONESHOT) share = oneshot_share(p);
  if constexpr (preload) {
    if (share.v0 + threadIdx.x < share.v1) {
      first_input = static_cast<const uint4*>(p.input)[share.v0 + threadIdx.x];
    }
  }
  const uint4* my_state = reinterpret_cast<const uint4*>(states + blockIdx.x * SK_STATE_WORDS);
  const uint4 s0 = my_state[0], s1 = my_state[1];
  if (threadIdx.x == 0) {
    sh.abort = ld_volatile(ctl + SK_CTRL_ERR_CODE) != 0u;  // a failed workspace stays failed
  }
  // Row split: the barrier set-up goes while the loads above are in flight (before them, it
  // held them up by ~0.1 us: 1x H200, TP2, 1 token, the state phase 0.52 against 0.42).
  if constexpr (kRowSplit) {
    expect_row_parts(sh);
    cluster_arrive_relaxed();  // "started": see send_row_part
  }
  uint32_t state[SK_STATE_WORDS] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
  static_assert(SK_STATE_WORDS == 8, "the state is loaded as two 16-byte vectors");
  const uint64_t epoch =
      ((static_cast<uint64_t>(state[kStateEpochHigh]) << 32) | state[kStateEpoch]) + 1u;
  state[kStateEpoch] = static_cast<uint32_t>(epoch);
  state[kStateEpochHigh] = static_cast<uint32_t>(epoch >> 32);
  __syncthreads();
  stamp(p, 1);
  if (!sh.abort) {
    if constexpr (kVariant == SK_VARIANT_ONESHOT) {
      run_oneshot<T, kFused, preload, kRowSplit>(p, sh, state, epoch, share, first_input);
    } else if constexpr (kVariant == SK_VARIANT_TWOSHOT_LAMPORT) {
      run_twoshot_lamport<T, kFused, kRowSplit>(p, sh, state, epoch);
    } else {
      const int parity =
          (p.debug_flags & SK_DEBUG_SINGLE_BUFFER) ? 0 : static_cast<int>(epoch & 1u);
      run_twoshot<T, kFused, kPieces>(p, sh, epoch, parity);
    }
  } else if constexpr (kRowSplit) {
    cluster_wait();  // the cluster's other blocks may not have seen the error
    cluster_row_total(sh, 0.f);
  }
  // Next call's state, into every copy this block index stands for (j = blockIdx.x mod grid):
  // copies no other block of this launch reads. One word per thread and copy.
  const int word = threadIdx.x % SK_STATE_WORDS;
  uint32_t value = 0;
#pragma unroll
  for (int i = 0; i < SK_STATE_WORDS; ++i) value = (i == word) ? state[i] : value;
  for (int copy = blockIdx.x + (threadIdx.x / SK_STATE_WORDS) * gridDim.x; copy < SK_MAX_BLOCKS;
       copy += (kThreads / SK_STATE_WORDS) * gridDim.x) {
    states[copy * SK_STATE_WORDS + word] = value;
  }
  stamp(p, 5);
}

using KernelFn = void (*)(const KernelParams);

template <typename T>
KernelFn kernel_for_type(int variant, int fused, bool row_split, bool row_pieces) {
  if (fused == SK_FUSED_NORM_ONLY) return add_rmsnorm_kernel<T>;
  if (variant == SK_VARIANT_ONESHOT) {
    if (row_split) return all_reduce_kernel<T, SK_VARIANT_ONESHOT, true, true>;
    return fused ? all_reduce_kernel<T, SK_VARIANT_ONESHOT, true>
                 : all_reduce_kernel<T, SK_VARIANT_ONESHOT, false>;
  }
  if (variant == SK_VARIANT_TWOSHOT_LAMPORT) {
    if (row_split) return all_reduce_kernel<T, SK_VARIANT_TWOSHOT_LAMPORT, true, true>;
    return fused ? all_reduce_kernel<T, SK_VARIANT_TWOSHOT_LAMPORT, true>
                 : all_reduce_kernel<T, SK_VARIANT_TWOSHOT_LAMPORT, false>;
  }
  if (row_pieces) return all_reduce_kernel<T, SK_VARIANT_TWOSHOT, true, false, true>;
  return fused ? all_reduce_kernel<T, SK_VARIANT_TWOSHOT, true>
               : all_reduce_kernel<T, SK_VARIANT_TWOSHOT, false>;
}

KernelFn kernel_for(int dtype, int variant, int fused, bool row_split, bool row_pieces) {
  if (dtype == SK_DTYPE_BF16) {
    return kernel_for_type<__nv_bfloat16>(variant, fused, row_split, row_pieces);
  }
  if (dtype == SK_DTYPE_FP16) return kernel_for_type<__half>(variant, fused, row_split, row_pieces);
  return nullptr;
}

// Every kernel that spins on peers (the occupancy bound applies to these).
const KernelFn kPeerKernels[] = {
    all_reduce_kernel<__nv_bfloat16, SK_VARIANT_ONESHOT, false>,
    all_reduce_kernel<__nv_bfloat16, SK_VARIANT_ONESHOT, true>,
    all_reduce_kernel<__nv_bfloat16, SK_VARIANT_ONESHOT, true, true>,
    all_reduce_kernel<__nv_bfloat16, SK_VARIANT_TWOSHOT, false>,
    all_reduce_kernel<__nv_bfloat16, SK_VARIANT_TWOSHOT, true>,
    all_reduce_kernel<__nv_bfloat16, SK_VARIANT_TWOSHOT, true, false, true>,
    all_reduce_kernel<__nv_bfloat16, SK_VARIANT_TWOSHOT_LAMPORT, false>,
    all_reduce_kernel<__nv_bfloat16, SK_VARIANT_TWOSHOT_LAMPORT, true>,
    all_reduce_kernel<__nv_bfloat16, SK_VARIANT_TWOSHOT_LAMPORT, true, true>,
    all_reduce_kernel<__half, SK_VARIANT_ONESHOT, false>,
    all_reduce_kernel<__half, SK_VARIANT_ONESHOT, true>,
    all_reduce_kernel<__half, SK_VARIANT_ONESHOT, true, true>,
    all_reduce_kernel<__half, SK_VARIANT_TWOSHOT, false>,
    all_reduce_kernel<__half, SK_VARIANT_TWOSHOT, true>,
    all_reduce_kernel<__half, SK_VARIANT_TWOSHOT, true, false, true>,
    all_reduce_kernel<__half, SK_VARIANT_TWOSHOT_LAMPORT, false>,
    all_reduce_kernel<__half, SK_VARIANT_TWOSHOT_LAMPORT, true>,
    all_reduce_kernel<__half, SK_VARIANT_TWOSHOT_LAMPORT, true, true>,
};

const KernelFn kNormKernels[] = {add_rmsnorm_kernel<__nv_bfloat16>, add_rmsnorm_kernel<__half>};

// Runs `body` with `device` current and restores the caller's device (torch's runtime shares
// the thread's current context with ours).
template <typename Body>
int on_device(int device, Body body) {
  int previous = -1;
  cudaError_t err = cudaGetDevice(&previous);
  if (err != cudaSuccess) return err;
  if (previous != device) {
    err = cudaSetDevice(device);
    if (err != cudaSuccess) return err;
  }
  const int result = body();
  if (previous != device) cudaSetDevice(previous);
  return result;
}

}  // namespace

SK_EXPORT int sk_abi_version(void) { return SK_ABI_VERSION; }

SK_EXPORT int sk_params_size(void) { return static_cast<int>(sizeof(SkLaunchParams)); }

SK_EXPORT const char* sk_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

SK_EXPORT int sk_device_count(int* count) { return cudaGetDeviceCount(count); }

SK_EXPORT int sk_device_pci_bus_id(int device, char* buf, int len) {
  return cudaDeviceGetPCIBusId(buf, len, device);
}

SK_EXPORT int sk_device_by_pci_bus_id(const char* bus_id, int* device) {
  return cudaDeviceGetByPCIBusId(device, bus_id);
}

SK_EXPORT int sk_can_access_peer(int device, int peer_device, int* can_access) {
  if (device == peer_device) {
    *can_access = 1;
    return cudaSuccess;
  }
  return cudaDeviceCanAccessPeer(can_access, device, peer_device);
}

SK_EXPORT int sk_max_resident_blocks(int device, int* blocks) {
  return on_device(device, [&]() -> int {
    int sms = 0;
    cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    int fewest = 1 << 30;
    for (KernelFn fn : kPeerKernels) {
      // Each kernel at the block size it launches with (its __launch_bounds__: the row split's
      // is kRowSplitThreads).
      cudaFuncAttributes attr;
      err = cudaFuncGetAttributes(&attr, fn);
      if (err != cudaSuccess) return err;
      int per_sm = 0;
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, attr.maxThreadsPerBlock, 0);
      if (err != cudaSuccess) return err;
      fewest = per_sm < fewest ? per_sm : fewest;
    }
    *blocks = fewest * sms;
    return cudaSuccess;
  });
}

// The launch attribute of a 1-D thread-block cluster of `size` blocks (the row split).
static cudaLaunchAttribute cluster_of(int size) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(size);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}

// Programmatic dependent launch: the kernel may launch while the one before it in the stream
// finishes (see wait_for_previous_kernel and let_next_kernel_launch). It saves the launch and
// block set-up between back-to-back kernels.
static cudaLaunchAttribute early_launch() {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return attr;
}

// A row-split launch is one cluster per row, and a cluster's blocks are scheduled together
// on one GPC: how many fit at once is cudaOccupancyMaxActiveClusters, not blocks per SM x SMs.
SK_EXPORT int sk_max_active_clusters(int device, int cluster_size, int* clusters) {
  if (cluster_size < 2 || cluster_size > SK_MAX_ROW_BLOCKS) return cudaErrorInvalidValue;
  return on_device(device, [&]() -> int {
    const KernelFn row_split[] = {
        all_reduce_kernel<__nv_bfloat16, SK_VARIANT_ONESHOT, true, true>,
        all_reduce_kernel<__half, SK_VARIANT_ONESHOT, true, true>,
        all_reduce_kernel<__nv_bfloat16, SK_VARIANT_TWOSHOT_LAMPORT, true, true>,
        all_reduce_kernel<__half, SK_VARIANT_TWOSHOT_LAMPORT, true, true>,
    };
    cudaLaunchAttribute cluster[1] = {cluster_of(cluster_size)};
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(cluster_size), 1, 1);
    config.blockDim = dim3(kRowSplitThreads, 1, 1);
    config.attrs = cluster;
    config.numAttrs = 1;
    int fewest = 1 << 30;
    for (KernelFn fn : row_split) {
      int n = 0;
      const cudaError_t err =
          cudaOccupancyMaxActiveClusters(&n, reinterpret_cast<const void*>(fn), &config);
      if (err != cudaSuccess) {
        cudaGetLastError();  // the caller treats a failed query as "none fit": leave no error
        return err;
      }
      fewest = n < fewest ? n : fewest;
    }
    *clusters = fewest;
    return cudaSuccess;
  });
}

SK_EXPORT int sk_alloc_zeroed(int device, size_t bytes, void** ptr) {
  return on_device(device, [&]() -> int {
    cudaError_t err = cudaMalloc(ptr, bytes);
    if (err != cudaSuccess) return err;
    err = cudaMemset(*ptr, 0, bytes);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      cudaFree(*ptr);
      *ptr = nullptr;
    }
    return err;
  });
}

SK_EXPORT int sk_fill(int device, void* ptr, int value, size_t bytes) {
  return on_device(device, [&]() -> int {
    cudaError_t err = cudaMemset(ptr, value, bytes);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    return err;
  });
}

SK_EXPORT int sk_free(int device, void* ptr) {
  return on_device(device, [&]() -> int { return cudaFree(ptr); });
}

SK_EXPORT int sk_host_alloc_mapped(int device, size_t bytes, void** host_ptr, void** device_ptr) {
  return on_device(device, [&]() -> int {
    cudaError_t err = cudaHostAlloc(host_ptr, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (err != cudaSuccess) return err;
    memset(*host_ptr, 0, bytes);
    err = cudaHostGetDevicePointer(device_ptr, *host_ptr, 0);
    if (err != cudaSuccess) {
      cudaFreeHost(*host_ptr);
      *host_ptr = nullptr;
    }
    return err;
  });
}

SK_EXPORT int sk_host_free(void* host_ptr) { return cudaFreeHost(host_ptr); }

SK_EXPORT int sk_ipc_get_handle(int device, void* ptr, void* handle_out) {
  return on_device(device, [&]() -> int {
    cudaIpcMemHandle_t handle;
    const cudaError_t err = cudaIpcGetMemHandle(&handle, ptr);
    if (err == cudaSuccess) memcpy(handle_out, &handle, sizeof(handle));
    return err;
  });
}

SK_EXPORT int sk_ipc_open_handle(int device, const void* handle, void** ptr_out) {
  return on_device(device, [&]() -> int {
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof(h));
    return cudaIpcOpenMemHandle(ptr_out, h, cudaIpcMemLazyEnablePeerAccess);
  });
}

SK_EXPORT int sk_ipc_close_handle(int device, void* ptr) {
  return on_device(device, [&]() -> int { return cudaIpcCloseMemHandle(ptr); });
}

SK_EXPORT int sk_preload(int device) {
  return on_device(device, [&]() -> int {
    for (KernelFn fn : kPeerKernels) {
      cudaFuncAttributes attr;
      const cudaError_t err = cudaFuncGetAttributes(&attr, fn);
      if (err != cudaSuccess) return err;
    }
    for (KernelFn fn : kNormKernels) {
      cudaFuncAttributes attr;
      const cudaError_t err = cudaFuncGetAttributes(&attr, fn);
      if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
  });
}

SK_EXPORT int sk_launch(const SkLaunchParams* params, int device, void* stream) {
  const SkLaunchParams& p = *params;
  const bool row_split = p.row_blocks > 1;
  // A two-shot fused call runs in whole-row pieces when a rank's chunk has at least as many
  // rows as there are blocks and a chunk of whole rows fits a push slot
  // (config.twoshot_row_pieces states the same rule in Python).
  const int64_t chunk_rows = p.world_size > 0 ? (p.rows + p.world_size - 1) / p.world_size : 0;
  const bool row_pieces = p.fused == SK_FUSED_RMSNORM && p.variant == SK_VARIANT_TWOSHOT &&
                          p.blocks > 0 && chunk_rows >= p.blocks &&
                          chunk_rows * (p.hidden / kVecElems) <= p.slot_bytes / 16;
  const KernelFn fn = kernel_for(p.dtype, p.variant, p.fused, row_split, row_pieces);
  const int max_blocks = p.fused == SK_FUSED_NORM_ONLY ? SK_MAX_NORM_BLOCKS : SK_MAX_BLOCKS;
  if (fn == nullptr || p.world_size < 1 || p.world_size > SK_MAX_RANKS || p.rank < 0 ||
      p.rank >= p.world_size || p.blocks < 1 || p.blocks > max_blocks ||
      p.variant < SK_VARIANT_ONESHOT || p.variant > SK_VARIANT_TWOSHOT_LAMPORT ||
      p.fused < SK_FUSED_NONE || p.fused > SK_FUSED_NORM_ONLY || p.numel % kVecElems != 0 ||
      (p.fused && (p.hidden % kVecElems != 0 || p.hidden > kMaxHidden ||
                   static_cast<int64_t>(p.rows) * p.hidden != p.numel))) {
    return cudaErrorInvalidValue;  // the Python layer validates first and explains why
  }
  const int row_vecs = p.hidden / kVecElems;
  if (p.row_blocks < 1 || p.row_blocks > SK_MAX_ROW_BLOCKS ||
      (row_split && (p.fused != SK_FUSED_RMSNORM || p.variant == SK_VARIANT_TWOSHOT ||
                     static_cast<int64_t>(p.rows) * p.row_blocks != p.blocks ||
                     (row_vecs + p.row_blocks - 1) / p.row_blocks >
                         kMaxVecPerSlice * kRowSplitThreads))) {
    return cudaErrorInvalidValue;
  }
  // Lamport two-shot (config.twoshot_lamport_fits states the same rule in Python): every
  // rank's chunk non-empty (see run_twoshot_lamport), a slot holds a chunk twice (reduce-scatter
  // and gather entries), and vector indices fit 31 bits (the epilogue divides in 32).
  const int64_t nvec = p.numel / kVecElems;
  const int64_t chunk = (nvec + p.world_size - 1) / p.world_size;
  if (p.variant == SK_VARIANT_TWOSHOT_LAMPORT && p.fused != SK_FUSED_NORM_ONLY &&
      ((p.world_size - 1) * chunk >= nvec || 2 * chunk > p.lamport_slot_bytes / 16 ||
       nvec >= (int64_t{1} << 31))) {
    return cudaErrorInvalidValue;
  }
  KernelParams kernel_params;
  static_cast<SkLaunchParams&>(kernel_params) = p;
  kernel_params.twoshot_chunk = chunk;
  kernel_params.twoshot_piece = (chunk + p.blocks - 1) / p.blocks;
  for (int s = 0; s < SK_MAX_RANKS; ++s) {
    const int peer = (p.rank + s) % p.world_size;
    kernel_params.lamport_from[s] = s < p.world_size ? p.lamport[peer] : nullptr;
  }
  kernel_params.oneshot_per_block = (p.numel / kVecElems + p.blocks - 1) / p.blocks;
  kernel_params.chunk_rows = static_cast<int32_t>(chunk_rows);
  kernel_params.piece_rows = static_cast<int32_t>((chunk_rows + p.blocks - 1) / p.blocks);
  kernel_params.inv_hidden = p.hidden > 0 ? 1.0f / static_cast<float>(p.hidden) : 0.f;
  return on_device(device, [&]() -> int {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(p.blocks);
    config.blockDim = dim3(block_threads(row_split));
    config.stream = static_cast<cudaStream_t>(stream);
    cudaLaunchAttribute attrs[2];
    unsigned count = 0;
    if (row_split) attrs[count++] = cluster_of(p.row_blocks);
    if (p.early_launch) attrs[count++] = early_launch();
    config.attrs = attrs;
    config.numAttrs = count;
    return cudaLaunchKernelEx(&config, fn, kernel_params);
  });
}
