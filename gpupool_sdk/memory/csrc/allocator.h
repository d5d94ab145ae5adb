/*
 * gpupool caching allocator: C core.
 *
 * A caching allocator in the style of PyTorch's CUDACachingAllocator (512-byte rounding,
 * small and large pools, block splitting and coalescing, per-stream free lists,
 * record_stream), with a hard quota on reserved bytes and a balloon target. Two backends:
 * host memory with fake streams (deterministic, for tests and benchmarks) and CUDA through
 * a libcudart loaded with dlopen at run time, so no CUDA header is needed to build it.
 *
 * Every entry point takes the allocator's mutex; all of them are thread safe.
 */
#ifndef GPUPOOL_ALLOCATOR_H
#define GPUPOOL_ALLOCATOR_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GP_BACKEND_HOST 0
#define GP_BACKEND_CUDA 1

/* Return codes of gp_malloc / gp_free / gp_record_stream. */
#define GP_OK 0
#define GP_ERR_QUOTA 1   /* growth would exceed min(quota, target) */
#define GP_ERR_DEVICE 2  /* the backend (cudaMalloc / malloc) failed */
#define GP_ERR_INVALID 3 /* unknown pointer, double free, bad argument */

/* Stat kinds, each reported for the pools all / small_pool / large_pool and as
 * current / peak / allocated / freed (PyTorch's memory_stats layout). */
enum {
  GP_ST_ALLOCATION = 0,
  GP_ST_SEGMENT,
  GP_ST_ACTIVE,
  GP_ST_INACTIVE_SPLIT,
  GP_ST_ALLOCATED_BYTES,
  GP_ST_RESERVED_BYTES,
  GP_ST_ACTIVE_BYTES,
  GP_ST_INACTIVE_SPLIT_BYTES,
  GP_ST_REQUESTED_BYTES,
  GP_ST_N
};

/* Scalar counters following the stat table in gp_stats's output. */
enum {
  GP_C_NUM_ALLOC_RETRIES = 0,
  GP_C_NUM_OOMS,
  GP_C_NUM_DEVICE_ALLOC,
  GP_C_NUM_DEVICE_FREE,
  GP_C_NUM_SYNC_ALL_STREAMS,
  GP_C_QUOTA,
  GP_C_TARGET,
  GP_C_FREE_BYTES,
  GP_C_LARGEST_FREE,
  GP_C_PENDING_BLOCKS,
  GP_C_PENDING_BYTES,
  GP_C_RELEASED_BYTES_TOTAL,
  GP_C_N
};

#define GP_STATS_LEN (GP_ST_N * 3 * 4 + GP_C_N)
/* One row of gp_snapshot: seg_base, seg_size, seg_stream, pool, ptr, size, requested, state. */
#define GP_SNAPSHOT_COLS 8
#define GP_STATE_FREE 0
#define GP_STATE_ALLOCATED 1
#define GP_STATE_PENDING 2

typedef struct gp_alloc gp_alloc;

gp_alloc *gp_create(int backend, int device, int64_t quota, const char *cudart_path, char *err, size_t errlen);
void gp_destroy(gp_alloc *a);
int gp_malloc(gp_alloc *a, int64_t size, uint64_t stream, uint64_t *out_ptr);
/* Same as gp_malloc, for callers that cannot pass an out pointer cheaply (ctypes): returns the
 * address, or 0 with the return code kept for gp_last_rc() in the calling thread. */
uint64_t gp_malloc_ptr(gp_alloc *a, int64_t size, uint64_t stream);
int gp_last_rc(void);
int gp_free(gp_alloc *a, uint64_t ptr);
int gp_record_stream(gp_alloc *a, uint64_t ptr, uint64_t stream);
int64_t gp_block_size(gp_alloc *a, uint64_t ptr);
int64_t gp_set_quota(gp_alloc *a, int64_t quota);
int64_t gp_set_target(gp_alloc *a, int64_t target);
int64_t gp_trim(gp_alloc *a);
int gp_stream_synchronize(gp_alloc *a, uint64_t stream);
int gp_synchronize(gp_alloc *a);
void gp_stats(gp_alloc *a, int64_t *out, int n);
void gp_reset_peak_stats(gp_alloc *a);
int64_t gp_snapshot(gp_alloc *a, int64_t *out, int64_t max_rows);
const char *gp_last_error(gp_alloc *a);
int64_t gp_round_size(int64_t size);

/* Process-global instances, one per device, used by the torch / CuPy entry points. */
int gp_global_set(int device, gp_alloc *a);
gp_alloc *gp_global_get(int device);
void *gpupool_torch_malloc(ssize_t size, int device, void *stream);
void gpupool_torch_free(void *ptr, ssize_t size, int device, void *stream);

/* Benchmark helper: replays an allocation sequence `iters` times in C. */
int64_t gp_bench_replay(gp_alloc *a, const int64_t *sizes, const int32_t *slots, int64_t n, int64_t nslots,
                        int64_t iters, int use_libc);

#ifdef __cplusplus
}
#endif

#endif
