// C API of libsgl_kernel_sm120: plain CUDA, no torch, loaded from Python with ctypes.
//
// Every function returns a cudaError_t value as int (0 = success); sk_error_string turns it into
// text. The launch parameters are one POD struct whose layout is mirrored field by field in
// python/sgl_kernel_sm120/_lib.py (_LaunchParams): change both together and bump SK_ABI_VERSION.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SK_ABI_VERSION 8
#define SK_MAX_RANKS 8
#define SK_MAX_BLOCKS 128
#define SK_THREADS 512

// Flags (two-shot only): uint64 [kind][parity][src rank][block], kind 0 = reduce-scatter push,
// kind 1 = gather (all-gather of the reduced chunks). Each holds the number of the call that
// last set it: 64 bits never wrap, so a flag no call has set for a long time cannot pass for a
// new one.
#define SK_FLAG_KINDS 2
#define SK_FLAG_WORDS (SK_FLAG_KINDS * 2 * SK_MAX_RANKS * SK_MAX_BLOCKS)
// Control words (rank-local): error record, then one copy of the call state per block.
#define SK_CTRL_ERR_CODE 2  // 0 = fine, 1 = timed out waiting for a peer
#define SK_CTRL_ERR_SRC 3   // the rank that did not arrive
#define SK_CTRL_ERR_KIND 4  // what it was waited for (0 push / one-shot data, 1 gather)
#define SK_CTRL_ERR_EPOCH 5 // the call (epoch) that timed out, low 32 bits
#define SK_CTRL_ERR_EPOCH_HIGH 6  // and high 32 bits
#define SK_CTRL_WORDS 8
// Call state, one copy per block index so that no block ever reads a word another block of the
// same launch writes (no atomics, no end barrier).
#define SK_STATE_OFFSET_WORDS 64
#define SK_STATE_WORDS 8
#define SK_STATE_EPOCH 0           // the call number (epoch), low 32 bits
#define SK_STATE_ONESHOT_BUFFER 1  // the next Lamport call's buffer (one-shot or Lamport
                                   // two-shot), 0-2 (read mod 3)
#define SK_STATE_DIRTY 2           // 3 words: vectors per peer slot written into each buffer
                                   // (bit 31: this rank's own slot too)
#define SK_STATE_EPOCH_HIGH 5      // the call number, high 32 bits (words 6-7: pad)
#define SK_CONTROL_WORDS (SK_STATE_OFFSET_WORDS + SK_MAX_BLOCKS * SK_STATE_WORDS)

// One-shot buffers hold 16-bit lanes; this value means "not arrived yet" (a NaN; a 0xFFFF lane
// in an input is sent as 0x7FFF, also a NaN).
#define SK_LAMPORT_BUFFERS 3

#define SK_DTYPE_BF16 0
#define SK_DTYPE_FP16 1
#define SK_VARIANT_ONESHOT 0
#define SK_VARIANT_TWOSHOT 1
#define SK_VARIANT_TWOSHOT_LAMPORT 2  // two-shot in the one-shot buffers, no flags (up to
                                      // a Lamport slot holding two chunks)

#define SK_FUSED_NONE 0       // plain all-reduce
#define SK_FUSED_RMSNORM 1    // all-reduce + residual add + RMSNorm in one launch
#define SK_FUSED_NORM_ONLY 2  // residual add + RMSNorm of `input` (already reduced), no
                              // communication: the second launch of a split fused call, one
                              // block per row (grid up to SK_MAX_NORM_BLOCKS), any variant
#define SK_MAX_NORM_BLOCKS 65535
#define SK_MAX_ROW_BLOCKS 8  // the portable cluster size (SM90, SM120)

// Debug switches, used only by tests.
#define SK_DEBUG_SINGLE_BUFFER 1  // UNSAFE: one buffer instead of three / two (negative control)
#define SK_DEBUG_TRIGGER_AT_START 2  // UNSAFE: with early_launch, every block lets the next kernel
                                     // launch before any peer wait (negative control)

typedef struct {
  // Tensors of this rank (device pointers).
  const void* input;         // all-reduce input
  void* output;              // plain: reduced result; fused: normed output
  const void* residual_in;   // fused only
  void* residual_out;        // fused only; must not overlap residual_in or weight (read
                             // through the read-only cache)
  const void* weight;        // fused only, [hidden]
  // Workspace of every rank, indexed by rank (entries >= world_size unused).
  void* lamport[SK_MAX_RANKS];     // Lamport region (one-shot and Lamport two-shot):
                                   // [3 buffers][world][lamport_slot_bytes]
  void* push[SK_MAX_RANKS];        // two-shot region base: [2 parities][world][slot_bytes]
  void* gather[SK_MAX_RANKS];      // gather region base: [max_bytes]
  uint64_t* flags[SK_MAX_RANKS];   // flag words, SK_FLAG_WORDS each
  uint32_t* control;         // this rank's SK_CONTROL_WORDS control words (device memory)
  uint32_t* error_host;      // device alias of host-mapped SK_CTRL_WORDS mirror (error record)
  unsigned long long* timeline;  // debug: clock64 stamps of block 0 per phase, or null
  int64_t numel;             // elements in input (multiple of 8)
  int64_t slot_bytes;        // capacity of one two-shot push slot
  int64_t lamport_slot_bytes;  // capacity of one Lamport slot
  uint64_t timeout_ns;       // bound on every wait for a peer
  uint64_t debug_delay_ns;   // delay injected after each wait on debug_delay_rank
  int32_t rows;              // fused: tokens
  int32_t hidden;            // fused: row length (multiple of 8, <= 16384)
  float eps;                 // fused: RMSNorm epsilon
  int32_t rank;
  int32_t world_size;
  int32_t variant;           // SK_VARIANT_*
  int32_t fused;             // SK_FUSED_*
  int32_t blocks;            // grid size, <= SK_MAX_BLOCKS, identical on every rank
  int32_t dtype;             // SK_DTYPE_*
  int32_t debug_flags;       // SK_DEBUG_*
  int32_t debug_delay_rank;  // -1: none
  int32_t row_blocks;        // fused one-shot: blocks per row, one thread-block cluster each
                             // (1: a block owns whole rows; 2..SK_MAX_ROW_BLOCKS: blocks ==
                             // rows x row_blocks, launched as clusters of row_blocks)
  int32_t early_launch;      // 1: programmatic dependent launch (the kernel may start while
                             // the one before it in the stream finishes; SM90 and later)
} SkLaunchParams;

int sk_abi_version(void);
// sizeof(SkLaunchParams), checked by the Python mirror.
int sk_params_size(void);
const char* sk_error_string(int code);

int sk_device_count(int* count);
int sk_device_pci_bus_id(int device, char* buf, int len);
int sk_device_by_pci_bus_id(const char* bus_id, int* device);
int sk_can_access_peer(int device, int peer_device, int* can_access);
// Blocks of the launch kernel that fit on the device at once (occupancy x SMs).
int sk_max_resident_blocks(int device, int* blocks);
// Clusters of cluster_size (2..SK_MAX_ROW_BLOCKS) blocks of the row-split kernel that fit
// on the device at once (cudaOccupancyMaxActiveClusters).
int sk_max_active_clusters(int device, int cluster_size, int* clusters);

int sk_alloc_zeroed(int device, size_t bytes, void** ptr);
// Sets `bytes` bytes at ptr to `value` and waits (one-shot buffers start as all 0xFF).
int sk_fill(int device, void* ptr, int value, size_t bytes);
int sk_free(int device, void* ptr);
int sk_host_alloc_mapped(int device, size_t bytes, void** host_ptr, void** device_ptr);
int sk_host_free(void* host_ptr);
int sk_ipc_get_handle(int device, void* ptr, void* handle_out);  // 64 bytes
int sk_ipc_open_handle(int device, const void* handle, void** ptr_out);
int sk_ipc_close_handle(int device, void* ptr);

// Loads every kernel now (lazy module loading would otherwise do it at the first launch,
// which must not happen during CUDA graph capture).
int sk_preload(int device);
int sk_launch(const SkLaunchParams* params, int device, void* stream);

#ifdef __cplusplus
}
#endif
