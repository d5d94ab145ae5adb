/*
 * gpupool caching allocator: C core. See allocator.h for the contract and
 * docs/memory.md for the design.
 *
 * Layout
 *   segment  one backend allocation (cudaMalloc / aligned malloc), owned by one stream
 *   block    a piece of a segment: free, allocated, or pending (freed but still in use
 *            by another stream until its events complete). Blocks of a segment form a
 *            doubly linked list in address order; adjacent free blocks are coalesced.
 *   pool     small (requests <= 1 MiB, carved from 2 MiB segments) or large.
 *   bins     free blocks of one (stream, pool) are kept in segregated bins (exact bins
 *            below 32 KiB, then 16 bins per power of two) with a bitmap of non-empty
 *            bins; each bin is sorted by size, so the search is an exact best fit.
 *   quick    small-pool blocks are freed into exact-size LIFO lists without coalescing
 *            (like dlmalloc's fastbins): a training step frees and re-requests the same
 *            sizes, so the hot path neither splits nor merges. Quick blocks are coalesced
 *            ("flushed") before the allocator would grow, release or report anything, so
 *            every observable state (stats, snapshot, trim, quota) is the coalesced one.
 */
#define _GNU_SOURCE
#include "allocator.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define KMIN_BLOCK 512
#define KSMALL_SIZE (1 << 20)
#define KSMALL_BUFFER (2 << 20)
#define KLARGE_BUFFER (20 << 20)
#define KMIN_LARGE_ALLOC (10 << 20)
#define KROUND_LARGE (2 << 20)

#define POOL_SMALL 0
#define POOL_LARGE 1

#define NBINS 704
#define NWORDS (NBINS / 64)
#define NQUICK (KSMALL_SIZE / KMIN_BLOCK + 1)
#define NQWORDS ((NQUICK + 63) / 64)
#define GP_STATE_QUICK 3 /* internal: freed into a quick list, not yet coalesced */

#define GP_MAX_DEVICES 64
#define NO_TARGET (-1)

typedef struct Segment Segment;
typedef struct StreamPool StreamPool;

typedef struct Block {
  uintptr_t ptr;
  size_t size;
  size_t requested;
  struct Block *prev, *next;   /* neighbours inside the segment */
  struct Block *fprev, *fnext; /* free-bin list */
  Segment *seg;
  int state;
  int event_count;
  int nuses, uses_cap;
  uint64_t *uses; /* streams recorded with record_stream */
} Block;

struct Segment {
  uintptr_t base;
  size_t size;
  int pool;
  StreamPool *sp;
  Block *head;
  Segment *prev, *next;
};

struct StreamPool {
  uint64_t stream;
  int pool;
  Block *bins[NBINS];
  uint64_t bitmap[NWORDS];
  int64_t nquick;
  Block *quick[NQUICK];
  uint64_t qbitmap[NQWORDS];
};

typedef struct {
  int64_t current, peak, allocated, freed;
} Stat;

typedef struct {
  uint64_t a, b; /* host: fake stream index and sequence number; cuda: cudaEvent_t */
  Block *block;
} Pending;

typedef struct {
  uint64_t id;
  uint64_t recorded;
  uint64_t completed;
} FakeStream;

typedef struct {
  uintptr_t key;
  Block *val;
} HEntry;

/* cudart entry points, resolved with dlsym. Handles are opaque pointers. */
typedef int (*cuda_malloc_t)(void **, size_t);
typedef int (*cuda_free_t)(void *);
typedef int (*cuda_get_device_t)(int *);
typedef int (*cuda_set_device_t)(int);
typedef int (*cuda_stream_sync_t)(void *);
typedef int (*cuda_device_sync_t)(void);
typedef int (*cuda_event_create_t)(void **, unsigned int);
typedef int (*cuda_event_record_t)(void *, void *);
typedef int (*cuda_event_query_t)(void *);
typedef int (*cuda_event_sync_t)(void *);
typedef int (*cuda_event_destroy_t)(void *);
typedef int (*cuda_get_last_error_t)(void);

typedef struct {
  void *lib;
  cuda_malloc_t malloc_;
  cuda_free_t free_;
  cuda_get_device_t get_device;
  cuda_set_device_t set_device;
  cuda_stream_sync_t stream_sync;
  cuda_device_sync_t device_sync;
  cuda_event_create_t event_create;
  cuda_event_record_t event_record;
  cuda_event_query_t event_query;
  cuda_event_sync_t event_sync;
  cuda_event_destroy_t event_destroy;
  cuda_get_last_error_t get_last_error;
} Cudart;

struct gp_alloc {
  pthread_mutex_t mu;
  int backend;
  int device;
  int64_t quota;
  int64_t target;
  Stat stats[GP_ST_N][3];
  int64_t counters[GP_C_N];
  Segment *segments;
  StreamPool **sps;
  int nsps, cap_sps;
  StreamPool *last_sp[2]; /* per pool: the hot path alternates pools */
  HEntry *tab;
  size_t tab_cap, tab_count;
  int tab_shift;
  Block *block_freelist;
  void **chunks;
  int nchunks, cap_chunks;
  Pending *pending;
  size_t npending, cap_pending;
  int64_t pending_bytes;
  FakeStream *fstreams;
  int nfstreams, cap_fstreams;
  Cudart cu;
  char err[512];
};

static gp_alloc *g_global[GP_MAX_DEVICES];

/* ------------------------------------------------------------------ helpers */

static void set_err(gp_alloc *a, const char *fmt, const char *detail) {
  snprintf(a->err, sizeof(a->err), fmt, detail ? detail : "");
}

int64_t gp_round_size(int64_t size) {
  if (size < KMIN_BLOCK) return KMIN_BLOCK;
  return KMIN_BLOCK * ((size + KMIN_BLOCK - 1) / KMIN_BLOCK);
}

static size_t segment_size_for(size_t rsize) {
  if (rsize <= KSMALL_SIZE) return KSMALL_BUFFER;
  if (rsize < KMIN_LARGE_ALLOC) return KLARGE_BUFFER;
  return KROUND_LARGE * ((rsize + KROUND_LARGE - 1) / KROUND_LARGE);
}

/* Hot path: called several times per malloc/free, so branch-free and inlined. "freed" is
 * allocated - current and is derived when stats are read. */
static inline __attribute__((always_inline)) void stat_bump(Stat *s, int64_t delta) {
  s->current += delta;
  s->allocated += delta > 0 ? delta : 0;
  s->peak = s->current > s->peak ? s->current : s->peak;
}

static inline __attribute__((always_inline)) void stat_update(gp_alloc *a, int kind, int pool, int64_t delta) {
  stat_bump(&a->stats[kind][0], delta);
  stat_bump(&a->stats[kind][pool + 1], delta);
}

static int64_t growth_limit(const gp_alloc *a) {
  if (a->target >= 0 && a->target < a->quota) return a->target;
  return a->quota;
}

static int64_t reserved_now(const gp_alloc *a) { return a->stats[GP_ST_RESERVED_BYTES][0].current; }

static int is_split(const Block *b) { return b->prev != NULL || b->next != NULL; }

/* ------------------------------------------------------------------ block structs */

static Block *block_new(gp_alloc *a) {
  if (!a->block_freelist) {
    const int n = 256;
    Block *chunk = (Block *)calloc((size_t)n, sizeof(Block));
    if (!chunk) return NULL;
    if (a->nchunks == a->cap_chunks) {
      int cap = a->cap_chunks ? a->cap_chunks * 2 : 16;
      void **c = (void **)realloc(a->chunks, (size_t)cap * sizeof(void *));
      if (!c) {
        free(chunk);
        return NULL;
      }
      a->chunks = c;
      a->cap_chunks = cap;
    }
    a->chunks[a->nchunks++] = chunk;
    for (int i = 0; i < n; i++) {
      chunk[i].fnext = a->block_freelist;
      a->block_freelist = &chunk[i];
    }
  }
  Block *b = a->block_freelist;
  a->block_freelist = b->fnext;
  uint64_t *uses = b->uses;
  int cap = b->uses_cap;
  memset(b, 0, sizeof(*b));
  b->uses = uses;
  b->uses_cap = cap;
  return b;
}

static void block_release(gp_alloc *a, Block *b) {
  b->fnext = a->block_freelist;
  a->block_freelist = b;
}

/* ------------------------------------------------------------------ ptr -> block map */

static inline size_t hslot(const gp_alloc *a, uintptr_t k) {
  return (size_t)(((uint64_t)k * 0x9E3779B97F4A7C15ull) >> a->tab_shift);
}

static int tab_grow(gp_alloc *a) {
  size_t ncap = a->tab_cap ? a->tab_cap * 2 : 1024;
  HEntry *nt = (HEntry *)calloc(ncap, sizeof(HEntry));
  if (!nt) return -1;
  HEntry *old = a->tab;
  size_t ocap = a->tab_cap;
  a->tab = nt;
  a->tab_cap = ncap;
  int bits = 0;
  while (((size_t)1 << bits) < ncap) bits++;
  a->tab_shift = 64 - bits;
  for (size_t i = 0; i < ocap; i++) {
    if (!old[i].key) continue;
    size_t j = hslot(a, old[i].key);
    while (nt[j].key) j = (j + 1) & (ncap - 1);
    nt[j] = old[i];
  }
  free(old);
  return 0;
}

static int tab_put(gp_alloc *a, uintptr_t k, Block *v) {
  if ((a->tab_count + 1) * 2 > a->tab_cap && tab_grow(a) != 0) return -1;
  size_t mask = a->tab_cap - 1, j = hslot(a, k);
  while (a->tab[j].key) j = (j + 1) & mask;
  a->tab[j].key = k;
  a->tab[j].val = v;
  a->tab_count++;
  return 0;
}

static Block *tab_get(const gp_alloc *a, uintptr_t k, size_t *slot) {
  if (!a->tab_cap) return NULL;
  size_t mask = a->tab_cap - 1, j = hslot(a, k);
  while (a->tab[j].key) {
    if (a->tab[j].key == k) {
      if (slot) *slot = j;
      return a->tab[j].val;
    }
    j = (j + 1) & mask;
  }
  return NULL;
}

/* Linear probing deletion by backward shift: no tombstones, so lookups stay short. */
static void tab_del_slot(gp_alloc *a, size_t i) {
  size_t mask = a->tab_cap - 1, j = i;
  for (;;) {
    j = (j + 1) & mask;
    if (!a->tab[j].key) break;
    size_t h = hslot(a, a->tab[j].key);
    int between = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
    if (between) continue;
    a->tab[i] = a->tab[j];
    i = j;
  }
  a->tab[i].key = 0;
  a->tab[i].val = NULL;
  a->tab_count--;
}

/* ------------------------------------------------------------------ free bins */

static inline int bin_index(size_t size) {
  uint64_t u = (uint64_t)size >> 9;
  if (u < 64) return (int)u;
  int fl = 63 - __builtin_clzll(u);
  int sl = (int)((u >> (fl - 4)) & 15);
  int idx = 64 + (fl - 6) * 16 + sl;
  return idx < NBINS ? idx : NBINS - 1;
}

static void bin_insert(gp_alloc *a, Block *b) {
  StreamPool *sp = b->seg->sp;
  int i = bin_index(b->size);
  Block **pp = &sp->bins[i], *prev = NULL;
  /* Sorted by size; equal sizes are LIFO (the most recently freed block is warm). */
  while (*pp && (*pp)->size < b->size) {
    prev = *pp;
    pp = &(*pp)->fnext;
  }
  b->fnext = *pp;
  b->fprev = prev;
  if (*pp) (*pp)->fprev = b;
  *pp = b;
  sp->bitmap[i >> 6] |= (uint64_t)1 << (i & 63);
  b->state = GP_STATE_FREE;
  if (is_split(b)) {
    stat_update(a, GP_ST_INACTIVE_SPLIT, b->seg->pool, 1);
    stat_update(a, GP_ST_INACTIVE_SPLIT_BYTES, b->seg->pool, (int64_t)b->size);
  }
}

static void bin_remove(gp_alloc *a, Block *b) {
  StreamPool *sp = b->seg->sp;
  int i = bin_index(b->size);
  if (b->fprev)
    b->fprev->fnext = b->fnext;
  else
    sp->bins[i] = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  if (!sp->bins[i]) sp->bitmap[i >> 6] &= ~((uint64_t)1 << (i & 63));
  b->fprev = b->fnext = NULL;
  if (is_split(b)) {
    stat_update(a, GP_ST_INACTIVE_SPLIT, b->seg->pool, -1);
    stat_update(a, GP_ST_INACTIVE_SPLIT_BYTES, b->seg->pool, -(int64_t)b->size);
  }
}

static Block *bin_find(StreamPool *sp, size_t rsize) {
  int i = bin_index(rsize);
  for (Block *b = sp->bins[i]; b; b = b->fnext)
    if (b->size >= rsize) return b;
  int w = (i + 1) >> 6;
  if (w >= NWORDS) return NULL;
  uint64_t bits = sp->bitmap[w] & (~(uint64_t)0 << ((i + 1) & 63));
  for (;;) {
    if (bits) return sp->bins[w * 64 + __builtin_ctzll(bits)];
    if (++w >= NWORDS) return NULL;
    bits = sp->bitmap[w];
  }
}

static inline void quick_push(StreamPool *sp, Block *b) {
  size_t u = b->size >> 9;
  b->fnext = sp->quick[u];
  sp->quick[u] = b;
  sp->qbitmap[u >> 6] |= (uint64_t)1 << (u & 63);
  b->state = GP_STATE_QUICK;
  sp->nquick++;
}

static inline Block *quick_pop(StreamPool *sp, size_t rsize) {
  size_t u = rsize >> 9;
  Block *b = sp->quick[u];
  if (!b) return NULL;
  sp->quick[u] = b->fnext;
  if (!b->fnext) sp->qbitmap[u >> 6] &= ~((uint64_t)1 << (u & 63));
  b->fnext = NULL;
  sp->nquick--;
  return b;
}

static void free_block(gp_alloc *a, Block *b);

/* Coalesces every quick block of a stream pool into the free bins. */
static void quick_flush(gp_alloc *a, StreamPool *sp) {
  if (!sp->nquick) return;
  for (int w = 0; w < NQWORDS; w++) {
    uint64_t bits = sp->qbitmap[w];
    while (bits) {
      int u = w * 64 + __builtin_ctzll(bits);
      bits &= bits - 1;
      Block *b = sp->quick[u];
      sp->quick[u] = NULL;
      while (b) {
        Block *n = b->fnext;
        b->fnext = NULL;
        free_block(a, b);
        b = n;
      }
    }
    sp->qbitmap[w] = 0;
  }
  sp->nquick = 0;
}

static void quick_flush_all(gp_alloc *a) {
  for (int i = 0; i < a->nsps; i++) quick_flush(a, a->sps[i]);
}

static StreamPool *stream_pool(gp_alloc *a, uint64_t stream, int pool) {
  StreamPool *sp = a->last_sp[pool];
  if (sp && sp->stream == stream) return sp;
  for (int i = 0; i < a->nsps; i++) {
    if (a->sps[i]->stream == stream && a->sps[i]->pool == pool) {
      a->last_sp[pool] = a->sps[i];
      return a->sps[i];
    }
  }
  if (a->nsps == a->cap_sps) {
    int cap = a->cap_sps ? a->cap_sps * 2 : 8;
    StreamPool **n = (StreamPool **)realloc(a->sps, (size_t)cap * sizeof(*n));
    if (!n) return NULL;
    a->sps = n;
    a->cap_sps = cap;
  }
  sp = (StreamPool *)calloc(1, sizeof(StreamPool));
  if (!sp) return NULL;
  sp->stream = stream;
  sp->pool = pool;
  a->sps[a->nsps++] = sp;
  a->last_sp[pool] = sp;
  return sp;
}

/* ------------------------------------------------------------------ backends */

static int fake_stream_index(gp_alloc *a, uint64_t id) {
  for (int i = 0; i < a->nfstreams; i++)
    if (a->fstreams[i].id == id) return i;
  if (a->nfstreams == a->cap_fstreams) {
    int cap = a->cap_fstreams ? a->cap_fstreams * 2 : 8;
    FakeStream *n = (FakeStream *)realloc(a->fstreams, (size_t)cap * sizeof(*n));
    if (!n) return -1;
    a->fstreams = n;
    a->cap_fstreams = cap;
  }
  a->fstreams[a->nfstreams].id = id;
  a->fstreams[a->nfstreams].recorded = 0;
  a->fstreams[a->nfstreams].completed = 0;
  return a->nfstreams++;
}

/* Runs a cudart call on this allocator's device and restores the caller's device. */
static int cuda_enter(gp_alloc *a, int *prev) {
  *prev = -1;
  if (a->cu.get_device(prev) != 0) return -1;
  if (*prev != a->device && a->cu.set_device(a->device) != 0) return -1;
  return 0;
}

static void cuda_leave(gp_alloc *a, int prev) {
  if (prev >= 0 && prev != a->device) a->cu.set_device(prev);
}

static int backend_alloc(gp_alloc *a, size_t size, uintptr_t *out) {
  void *p = NULL;
  if (a->backend == GP_BACKEND_HOST) {
    if (posix_memalign(&p, KMIN_BLOCK, size) != 0 || !p) return -1;
  } else {
    int prev;
    if (cuda_enter(a, &prev) != 0) return -1;
    int rc = a->cu.malloc_(&p, size);
    if (rc != 0) a->cu.get_last_error(); /* clear the sticky-free OOM error */
    cuda_leave(a, prev);
    if (rc != 0 || !p) return -1;
  }
  *out = (uintptr_t)p;
  a->counters[GP_C_NUM_DEVICE_ALLOC]++;
  return 0;
}

static void backend_free(gp_alloc *a, uintptr_t p) {
  if (a->backend == GP_BACKEND_HOST) {
    free((void *)p);
  } else {
    int prev;
    if (cuda_enter(a, &prev) == 0) {
      a->cu.free_((void *)p);
      cuda_leave(a, prev);
    }
  }
  a->counters[GP_C_NUM_DEVICE_FREE]++;
}

static int event_record(gp_alloc *a, uint64_t stream, Pending *pe) {
  if (a->backend == GP_BACKEND_HOST) {
    int i = fake_stream_index(a, stream);
    if (i < 0) return -1;
    pe->a = (uint64_t)i;
    pe->b = ++a->fstreams[i].recorded;
    return 0;
  }
  void *ev = NULL;
  int prev;
  if (cuda_enter(a, &prev) != 0) return -1;
  int rc = a->cu.event_create(&ev, 0x02 /* cudaEventDisableTiming */);
  if (rc == 0) rc = a->cu.event_record(ev, (void *)(uintptr_t)stream);
  cuda_leave(a, prev);
  if (rc != 0) return -1;
  pe->a = (uint64_t)(uintptr_t)ev;
  pe->b = 0;
  return 0;
}

/* 1 when the event has completed. */
static int event_done(gp_alloc *a, const Pending *pe, int wait) {
  if (a->backend == GP_BACKEND_HOST) {
    FakeStream *fs = &a->fstreams[pe->a];
    if (wait && fs->completed < pe->b) fs->completed = fs->recorded;
    return fs->completed >= pe->b;
  }
  void *ev = (void *)(uintptr_t)pe->a;
  int rc = wait ? a->cu.event_sync(ev) : a->cu.event_query(ev);
  if (rc == 0) {
    a->cu.event_destroy(ev);
    return 1;
  }
  if (rc != 600 /* cudaErrorNotReady */) a->cu.get_last_error();
  return 0;
}

static int load_cudart(gp_alloc *a, const char *path) {
  if (path && path[0]) {
    /* An explicit path is used alone: silently loading another runtime would hide the mistake. */
    a->cu.lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!a->cu.lib) {
      const char *why = dlerror();
      snprintf(a->err, sizeof(a->err), "could not dlopen libcudart at %s (%s); fix GPUPOOL_CUDART_PATH", path,
               why ? why : "unknown error");
      return -1;
    }
  } else {
    const char *names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"};
    for (int i = 0; i < 4 && !a->cu.lib; i++) a->cu.lib = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
    if (!a->cu.lib) {
      set_err(a, "could not dlopen libcudart (tried libcudart.so, .so.13, .so.12, .so.11.0)%s; install the CUDA "
                 "runtime or set GPUPOOL_CUDART_PATH to the library's path",
              NULL);
      return -1;
    }
  }
#define SYM(field, name, type)                                   \
  a->cu.field = (type)dlsym(a->cu.lib, name);                     \
  if (!a->cu.field) {                                            \
    set_err(a, "libcudart has no symbol %s", name);              \
    return -1;                                                   \
  }
  SYM(malloc_, "cudaMalloc", cuda_malloc_t)
  SYM(free_, "cudaFree", cuda_free_t)
  SYM(get_device, "cudaGetDevice", cuda_get_device_t)
  SYM(set_device, "cudaSetDevice", cuda_set_device_t)
  SYM(stream_sync, "cudaStreamSynchronize", cuda_stream_sync_t)
  SYM(device_sync, "cudaDeviceSynchronize", cuda_device_sync_t)
  SYM(event_create, "cudaEventCreateWithFlags", cuda_event_create_t)
  SYM(event_record, "cudaEventRecord", cuda_event_record_t)
  SYM(event_query, "cudaEventQuery", cuda_event_query_t)
  SYM(event_sync, "cudaEventSynchronize", cuda_event_sync_t)
  SYM(event_destroy, "cudaEventDestroy", cuda_event_destroy_t)
  SYM(get_last_error, "cudaGetLastError", cuda_get_last_error_t)
#undef SYM
  return 0;
}

/* ------------------------------------------------------------------ core */

/* Puts a block that is no longer in use back into its free bin, merged with free neighbours. */
static void free_block(gp_alloc *a, Block *b) {
  Block *p = b->prev, *n = b->next;
  if (p && p->state == GP_STATE_FREE) {
    bin_remove(a, p);
    p->size += b->size;
    p->next = n;
    if (n) n->prev = p;
    block_release(a, b);
    b = p;
  }
  n = b->next;
  if (n && n->state == GP_STATE_FREE) {
    bin_remove(a, n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    block_release(a, n);
  }
  bin_insert(a, b);
}

static void finish_pending(gp_alloc *a, Block *b) {
  stat_update(a, GP_ST_ACTIVE, b->seg->pool, -1);
  stat_update(a, GP_ST_ACTIVE_BYTES, b->seg->pool, -(int64_t)b->size);
  a->pending_bytes -= (int64_t)b->size;
  free_block(a, b);
}

static void process_events(gp_alloc *a, int wait) {
  size_t w = 0;
  for (size_t i = 0; i < a->npending; i++) {
    Pending *pe = &a->pending[i];
    if (event_done(a, pe, wait)) {
      Block *b = pe->block;
      if (--b->event_count == 0) finish_pending(a, b);
    } else {
      a->pending[w++] = *pe;
    }
  }
  a->npending = w;
}

static int segment_fully_free(const Segment *s) {
  return s->head->state == GP_STATE_FREE && s->head->next == NULL;
}

static int64_t release_segment(gp_alloc *a, Segment *s) {
  Block *b = s->head;
  bin_remove(a, b);
  block_release(a, b);
  if (s->prev)
    s->prev->next = s->next;
  else
    a->segments = s->next;
  if (s->next) s->next->prev = s->prev;
  backend_free(a, s->base);
  stat_update(a, GP_ST_SEGMENT, s->pool, -1);
  stat_update(a, GP_ST_RESERVED_BYTES, s->pool, -(int64_t)s->size);
  int64_t sz = (int64_t)s->size;
  a->counters[GP_C_RELEASED_BYTES_TOTAL] += sz;
  free(s);
  return sz;
}

/* Releases fully free segments, largest first, until reserved <= until (until < 0: all). */
static int64_t release_free_segments(gp_alloc *a, int64_t until) {
  int64_t released = 0;
  quick_flush_all(a);
  while (until < 0 || reserved_now(a) > until) {
    Segment *best = NULL;
    for (Segment *s = a->segments; s; s = s->next)
      if (segment_fully_free(s) && (!best || s->size > best->size)) best = s;
    if (!best) break;
    released += release_segment(a, best);
  }
  return released;
}

static void synchronize_events(gp_alloc *a) {
  if (a->npending) {
    a->counters[GP_C_NUM_SYNC_ALL_STREAMS]++;
    process_events(a, 1);
  }
}

/* Brings reserved bytes under the growth limit: release free segments, and if that is not
 * enough, wait for pending blocks and try again. */
static int64_t shrink_to_limit(gp_alloc *a) {
  int64_t limit = growth_limit(a);
  if (reserved_now(a) <= limit) return 0;
  process_events(a, 0);
  int64_t released = release_free_segments(a, limit);
  if (reserved_now(a) > limit && a->npending) {
    synchronize_events(a);
    released += release_free_segments(a, limit);
  }
  return released;
}

static Block *grow(gp_alloc *a, StreamPool *sp, size_t rsize, int pool, int *device_failed) {
  size_t seg = segment_size_for(rsize);
  int64_t limit = growth_limit(a);
  if (reserved_now(a) + (int64_t)seg > limit) {
    /* Under a tight quota a large request may get a segment of its own rounded size. */
    size_t alt = KROUND_LARGE * ((rsize + KROUND_LARGE - 1) / KROUND_LARGE);
    if (pool == POOL_LARGE && alt < seg && reserved_now(a) + (int64_t)alt <= limit)
      seg = alt;
    else
      return NULL;
  }
  uintptr_t base;
  if (backend_alloc(a, seg, &base) != 0) {
    *device_failed = 1;
    return NULL;
  }
  Segment *s = (Segment *)calloc(1, sizeof(Segment));
  Block *b = block_new(a);
  if (!s || !b) {
    free(s);
    if (b) block_release(a, b);
    backend_free(a, base);
    *device_failed = 1;
    return NULL;
  }
  s->base = base;
  s->size = seg;
  s->pool = pool;
  s->sp = sp;
  s->head = b;
  s->next = a->segments;
  if (a->segments) a->segments->prev = s;
  a->segments = s;
  b->ptr = base;
  b->size = seg;
  b->seg = s;
  b->state = GP_STATE_FREE;
  stat_update(a, GP_ST_SEGMENT, pool, 1);
  stat_update(a, GP_ST_RESERVED_BYTES, pool, (int64_t)seg);
  return b; /* not in a bin: the caller takes it */
}

int gp_malloc(gp_alloc *a, int64_t size, uint64_t stream, uint64_t *out_ptr) {
  if (size < 0 || !out_ptr) return GP_ERR_INVALID;
  if (size > ((int64_t)1 << 56)) { /* no device has 64 PiB; also keeps the rounding from overflowing */
    pthread_mutex_lock(&a->mu);
    a->counters[GP_C_NUM_OOMS]++;
    int rc = (int64_t)(size) > growth_limit(a) ? GP_ERR_QUOTA : GP_ERR_DEVICE;
    pthread_mutex_unlock(&a->mu);
    return rc;
  }
  pthread_mutex_lock(&a->mu);
  if (a->npending) process_events(a, 0);
  size_t rsize = (size_t)gp_round_size(size);
  int pool = rsize <= KSMALL_SIZE ? POOL_SMALL : POOL_LARGE;
  StreamPool *sp = stream_pool(a, stream, pool);
  if (!sp) {
    set_err(a, "out of host memory for allocator bookkeeping%s", NULL);
    pthread_mutex_unlock(&a->mu);
    return GP_ERR_DEVICE;
  }
  int device_failed = 0;
  Block *b = pool == POOL_SMALL ? quick_pop(sp, rsize) : NULL;
  if (b) goto found; /* exact size: no split */
  b = bin_find(sp, rsize);
  if (!b && sp->nquick) {
    quick_flush(a, sp);
    b = bin_find(sp, rsize);
  }
  if (b) {
    bin_remove(a, b);
  } else {
    b = grow(a, sp, rsize, pool, &device_failed);
    if (!b) {
      /* PyTorch's retry: wait for pending blocks, free every cached segment, try again. */
      a->counters[GP_C_NUM_ALLOC_RETRIES]++;
      synchronize_events(a);
      release_free_segments(a, -1); /* flushes quick lists first */
      b = bin_find(sp, rsize);
      if (b) {
        bin_remove(a, b);
      } else {
        device_failed = 0;
        b = grow(a, sp, rsize, pool, &device_failed);
      }
      if (!b) {
        a->counters[GP_C_NUM_OOMS]++;
        set_err(a, device_failed ? "the backend could not allocate a new segment%s"
                                 : "the allocation would exceed the quota or balloon target%s",
                NULL);
        pthread_mutex_unlock(&a->mu);
        return device_failed ? GP_ERR_DEVICE : GP_ERR_QUOTA;
      }
    }
  }
  size_t remaining = b->size - rsize;
  int split = pool == POOL_SMALL ? remaining >= KMIN_BLOCK : remaining > KSMALL_SIZE;
  if (split) {
    Block *r = block_new(a);
    if (r) {
      r->ptr = b->ptr + rsize;
      r->size = remaining;
      r->seg = b->seg;
      r->prev = b;
      r->next = b->next;
      if (b->next) b->next->prev = r;
      b->next = r;
      b->size = rsize;
      bin_insert(a, r);
    }
  }
found:
  b->state = GP_STATE_ALLOCATED;
  b->requested = (size_t)size;
  b->nuses = 0;
  b->event_count = 0;
  if (tab_put(a, b->ptr, b) != 0) {
    free_block(a, b);
    set_err(a, "out of host memory for allocator bookkeeping%s", NULL);
    pthread_mutex_unlock(&a->mu);
    return GP_ERR_DEVICE;
  }
  stat_update(a, GP_ST_ALLOCATION, pool, 1);
  stat_update(a, GP_ST_ALLOCATED_BYTES, pool, (int64_t)b->size);
  stat_update(a, GP_ST_ACTIVE, pool, 1);
  stat_update(a, GP_ST_ACTIVE_BYTES, pool, (int64_t)b->size);
  stat_update(a, GP_ST_REQUESTED_BYTES, pool, size);
  *out_ptr = (uint64_t)b->ptr;
  pthread_mutex_unlock(&a->mu);
  return GP_OK;
}

static __thread int tls_last_rc;

uint64_t gp_malloc_ptr(gp_alloc *a, int64_t size, uint64_t stream) {
  uint64_t p = 0;
  tls_last_rc = gp_malloc(a, size, stream, &p);
  return tls_last_rc == GP_OK ? p : 0;
}

int gp_last_rc(void) { return tls_last_rc; }

int gp_free(gp_alloc *a, uint64_t ptr) {
  pthread_mutex_lock(&a->mu);
  size_t slot = 0;
  Block *b = tab_get(a, (uintptr_t)ptr, &slot);
  if (!b) {
    snprintf(a->err, sizeof(a->err), "pointer 0x%llx was not allocated by this allocator or was already freed",
             (unsigned long long)ptr);
    pthread_mutex_unlock(&a->mu);
    return GP_ERR_INVALID;
  }
  tab_del_slot(a, slot);
  int pool = b->seg->pool;
  stat_update(a, GP_ST_ALLOCATION, pool, -1);
  stat_update(a, GP_ST_ALLOCATED_BYTES, pool, -(int64_t)b->size);
  stat_update(a, GP_ST_REQUESTED_BYTES, pool, -(int64_t)b->requested);
  if (b->nuses) {
    b->state = GP_STATE_PENDING;
    for (int i = 0; i < b->nuses; i++) {
      if (a->npending == a->cap_pending) {
        size_t cap = a->cap_pending ? a->cap_pending * 2 : 64;
        Pending *n = (Pending *)realloc(a->pending, cap * sizeof(Pending));
        if (!n) break; /* degrade to immediate synchronisation below */
        a->pending = n;
        a->cap_pending = cap;
      }
      Pending *pe = &a->pending[a->npending];
      if (event_record(a, b->uses[i], pe) != 0) {
        if (a->backend == GP_BACKEND_CUDA) a->cu.stream_sync((void *)(uintptr_t)b->uses[i]);
        continue;
      }
      pe->block = b;
      a->npending++;
      b->event_count++;
    }
    b->nuses = 0;
    if (b->event_count) {
      a->pending_bytes += (int64_t)b->size;
      pthread_mutex_unlock(&a->mu);
      return GP_OK;
    }
  }
  stat_update(a, GP_ST_ACTIVE, pool, -1);
  stat_update(a, GP_ST_ACTIVE_BYTES, pool, -(int64_t)b->size);
  if (pool == POOL_SMALL)
    quick_push(b->seg->sp, b);
  else
    free_block(a, b);
  pthread_mutex_unlock(&a->mu);
  return GP_OK;
}

int gp_record_stream(gp_alloc *a, uint64_t ptr, uint64_t stream) {
  pthread_mutex_lock(&a->mu);
  Block *b = tab_get(a, (uintptr_t)ptr, NULL);
  if (!b) {
    snprintf(a->err, sizeof(a->err), "record_stream: pointer 0x%llx is not a live allocation",
             (unsigned long long)ptr);
    pthread_mutex_unlock(&a->mu);
    return GP_ERR_INVALID;
  }
  if (stream == b->seg->sp->stream) {
    pthread_mutex_unlock(&a->mu);
    return GP_OK; /* the allocation stream is ordered with itself */
  }
  for (int i = 0; i < b->nuses; i++) {
    if (b->uses[i] == stream) {
      pthread_mutex_unlock(&a->mu);
      return GP_OK;
    }
  }
  if (b->nuses == b->uses_cap) {
    int cap = b->uses_cap ? b->uses_cap * 2 : 4;
    uint64_t *n = (uint64_t *)realloc(b->uses, (size_t)cap * sizeof(uint64_t));
    if (!n) {
      set_err(a, "out of host memory for allocator bookkeeping%s", NULL);
      pthread_mutex_unlock(&a->mu);
      return GP_ERR_DEVICE;
    }
    b->uses = n;
    b->uses_cap = cap;
  }
  b->uses[b->nuses++] = stream;
  pthread_mutex_unlock(&a->mu);
  return GP_OK;
}

int64_t gp_block_size(gp_alloc *a, uint64_t ptr) {
  pthread_mutex_lock(&a->mu);
  Block *b = tab_get(a, (uintptr_t)ptr, NULL);
  int64_t r = b ? (int64_t)b->size : -1;
  pthread_mutex_unlock(&a->mu);
  return r;
}

int64_t gp_set_quota(gp_alloc *a, int64_t quota) {
  pthread_mutex_lock(&a->mu);
  a->quota = quota < 0 ? INT64_MAX : quota;
  a->counters[GP_C_QUOTA] = a->quota;
  int64_t r = shrink_to_limit(a);
  pthread_mutex_unlock(&a->mu);
  return r;
}

int64_t gp_set_target(gp_alloc *a, int64_t target) {
  pthread_mutex_lock(&a->mu);
  a->target = target < 0 ? NO_TARGET : target;
  a->counters[GP_C_TARGET] = a->target;
  int64_t r = shrink_to_limit(a);
  pthread_mutex_unlock(&a->mu);
  return r;
}

int64_t gp_trim(gp_alloc *a) {
  pthread_mutex_lock(&a->mu);
  synchronize_events(a);
  int64_t r = release_free_segments(a, -1);
  pthread_mutex_unlock(&a->mu);
  return r;
}

int gp_stream_synchronize(gp_alloc *a, uint64_t stream) {
  pthread_mutex_lock(&a->mu);
  int rc = 0;
  if (a->backend == GP_BACKEND_HOST) {
    int i = fake_stream_index(a, stream);
    if (i >= 0) a->fstreams[i].completed = a->fstreams[i].recorded;
  } else {
    int prev;
    if (cuda_enter(a, &prev) == 0) {
      rc = a->cu.stream_sync((void *)(uintptr_t)stream);
      cuda_leave(a, prev);
    } else {
      rc = -1;
    }
  }
  process_events(a, 0);
  pthread_mutex_unlock(&a->mu);
  return rc;
}

int gp_synchronize(gp_alloc *a) {
  pthread_mutex_lock(&a->mu);
  int rc = 0;
  if (a->backend == GP_BACKEND_HOST) {
    for (int i = 0; i < a->nfstreams; i++) a->fstreams[i].completed = a->fstreams[i].recorded;
  } else {
    int prev;
    if (cuda_enter(a, &prev) == 0) {
      rc = a->cu.device_sync();
      cuda_leave(a, prev);
    } else {
      rc = -1;
    }
  }
  process_events(a, 0);
  pthread_mutex_unlock(&a->mu);
  return rc;
}

void gp_stats(gp_alloc *a, int64_t *out, int n) {
  pthread_mutex_lock(&a->mu);
  quick_flush_all(a);
  int64_t buf[GP_STATS_LEN];
  int k = 0;
  for (int s = 0; s < GP_ST_N; s++)
    for (int p = 0; p < 3; p++) {
      buf[k++] = a->stats[s][p].current;
      buf[k++] = a->stats[s][p].peak;
      buf[k++] = a->stats[s][p].allocated;
      buf[k++] = a->stats[s][p].allocated - a->stats[s][p].current;
    }
  int64_t free_bytes = 0, largest = 0;
  for (Segment *s = a->segments; s; s = s->next)
    for (Block *b = s->head; b; b = b->next)
      if (b->state == GP_STATE_FREE) {
        free_bytes += (int64_t)b->size;
        if ((int64_t)b->size > largest) largest = (int64_t)b->size;
      }
  a->counters[GP_C_QUOTA] = a->quota;
  a->counters[GP_C_TARGET] = a->target;
  a->counters[GP_C_FREE_BYTES] = free_bytes;
  a->counters[GP_C_LARGEST_FREE] = largest;
  /* Distinct pending blocks: one block may wait on several events. */
  int64_t npending_blocks = 0;
  for (Segment *s = a->segments; s; s = s->next)
    for (Block *b = s->head; b; b = b->next)
      if (b->state == GP_STATE_PENDING) npending_blocks++;
  a->counters[GP_C_PENDING_BLOCKS] = npending_blocks;
  a->counters[GP_C_PENDING_BYTES] = a->pending_bytes;
  for (int c = 0; c < GP_C_N; c++) buf[k++] = a->counters[c];
  pthread_mutex_unlock(&a->mu);
  memcpy(out, buf, (size_t)(n < GP_STATS_LEN ? n : GP_STATS_LEN) * sizeof(int64_t));
}

void gp_reset_peak_stats(gp_alloc *a) {
  pthread_mutex_lock(&a->mu);
  for (int s = 0; s < GP_ST_N; s++)
    for (int p = 0; p < 3; p++) a->stats[s][p].peak = a->stats[s][p].current;
  pthread_mutex_unlock(&a->mu);
}

int64_t gp_snapshot(gp_alloc *a, int64_t *out, int64_t max_rows) {
  pthread_mutex_lock(&a->mu);
  quick_flush_all(a);
  int64_t rows = 0;
  for (Segment *s = a->segments; s; s = s->next)
    for (Block *b = s->head; b; b = b->next) {
      if (out && rows < max_rows) {
        int64_t *r = out + rows * GP_SNAPSHOT_COLS;
        r[0] = (int64_t)s->base;
        r[1] = (int64_t)s->size;
        r[2] = (int64_t)s->sp->stream;
        r[3] = s->pool;
        r[4] = (int64_t)b->ptr;
        r[5] = (int64_t)b->size;
        r[6] = b->state == GP_STATE_ALLOCATED ? (int64_t)b->requested : 0;
        r[7] = b->state;
      }
      rows++;
    }
  pthread_mutex_unlock(&a->mu);
  return rows;
}

const char *gp_last_error(gp_alloc *a) { return a->err; }

gp_alloc *gp_create(int backend, int device, int64_t quota, const char *cudart_path, char *err, size_t errlen) {
  gp_alloc *a = (gp_alloc *)calloc(1, sizeof(gp_alloc));
  if (!a) {
    if (err && errlen) snprintf(err, errlen, "out of host memory");
    return NULL;
  }
  pthread_mutex_init(&a->mu, NULL);
  a->backend = backend;
  a->device = device;
  a->quota = quota < 0 ? INT64_MAX : quota;
  a->target = NO_TARGET;
  if (backend == GP_BACKEND_CUDA && load_cudart(a, cudart_path) != 0) {
    if (err && errlen) snprintf(err, errlen, "%s", a->err);
    if (a->cu.lib) dlclose(a->cu.lib);
    pthread_mutex_destroy(&a->mu);
    free(a);
    return NULL;
  }
  if (backend != GP_BACKEND_HOST && backend != GP_BACKEND_CUDA) {
    if (err && errlen) snprintf(err, errlen, "unknown backend %d", backend);
    pthread_mutex_destroy(&a->mu);
    free(a);
    return NULL;
  }
  return a;
}

void gp_destroy(gp_alloc *a) {
  if (!a) return;
  for (int d = 0; d < GP_MAX_DEVICES; d++)
    if (g_global[d] == a) g_global[d] = NULL;
  pthread_mutex_lock(&a->mu);
  synchronize_events(a);
  Segment *s = a->segments;
  while (s) {
    Segment *n = s->next;
    backend_free(a, s->base);
    free(s);
    s = n;
  }
  for (int i = 0; i < a->nchunks; i++) {
    Block *chunk = (Block *)a->chunks[i];
    for (int j = 0; j < 256; j++) free(chunk[j].uses);
    free(chunk);
  }
  free(a->chunks);
  for (int i = 0; i < a->nsps; i++) free(a->sps[i]);
  free(a->sps);
  free(a->tab);
  free(a->pending);
  free(a->fstreams);
  pthread_mutex_unlock(&a->mu);
  pthread_mutex_destroy(&a->mu);
  /* libcudart stays loaded: torch or CuPy may share it. */
  free(a);
}

/* ------------------------------------------------------------------ process-global hooks */

int gp_global_set(int device, gp_alloc *a) {
  if (device < 0 || device >= GP_MAX_DEVICES) return GP_ERR_INVALID;
  __atomic_store_n(&g_global[device], a, __ATOMIC_RELEASE);
  return GP_OK;
}

gp_alloc *gp_global_get(int device) {
  if (device < 0 || device >= GP_MAX_DEVICES) return NULL;
  return __atomic_load_n(&g_global[device], __ATOMIC_ACQUIRE);
}

void *gpupool_torch_malloc(ssize_t size, int device, void *stream) {
  gp_alloc *a = gp_global_get(device);
  uint64_t p = 0;
  if (!a) {
    fprintf(stderr, "gpupool: no allocator for CUDA device %d; call install_torch_allocator(devices=[...])\n",
            device);
    return NULL;
  }
  int rc = gp_malloc(a, (int64_t)size, (uint64_t)(uintptr_t)stream, &p);
  if (rc == GP_OK) return (void *)(uintptr_t)p;
  /* The pluggable-allocator interface has no way to raise: say why on stderr, since some torch
   * versions turn the NULL into a CUDA error later rather than an OutOfMemoryError. */
  pthread_mutex_lock(&a->mu);
  long long quota = a->quota == INT64_MAX ? -1 : (long long)a->quota, target = (long long)a->target;
  long long reserved = a->stats[GP_ST_RESERVED_BYTES][0].current;
  long long allocated = a->stats[GP_ST_ALLOCATED_BYTES][0].current;
  pthread_mutex_unlock(&a->mu);
  fprintf(stderr,
          "gpupool: CUDA allocation of %lld bytes on device %d refused (%s): quota %lld, balloon target %lld, "
          "reserved %lld, allocated %lld bytes\n",
          (long long)size, device, rc == GP_ERR_QUOTA ? "over the quota" : "device out of memory", quota, target,
          reserved, allocated);
  return NULL;
}

void gpupool_torch_free(void *ptr, ssize_t size, int device, void *stream) {
  (void)size;
  (void)stream;
  gp_alloc *a = gp_global_get(device);
  if (a && ptr) gp_free(a, (uint64_t)(uintptr_t)ptr);
}

/* ------------------------------------------------------------------ benchmark */

/* CPU time of the calling thread: robust to a loaded machine, and it includes the kernel
 * time of mmap/munmap calls made by glibc for large blocks. */
static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Replays n operations `iters` times: sizes[i] >= 0 allocates into slots[i], sizes[i] < 0
 * frees slots[i]. use_libc selects glibc malloc/free instead of the allocator. Returns the
 * thread CPU nanoseconds spent, or -1 on an allocation failure. */
int64_t gp_bench_replay(gp_alloc *a, const int64_t *sizes, const int32_t *slots, int64_t n, int64_t nslots,
                        int64_t iters, int use_libc) {
  uint64_t *held = (uint64_t *)calloc((size_t)nslots, sizeof(uint64_t));
  if (!held) return -1;
  int64_t t0 = now_ns();
  int64_t rc = 0;
  for (int64_t it = 0; it < iters && rc == 0; it++) {
    for (int64_t i = 0; i < n; i++) {
      int32_t s = slots[i];
      if (sizes[i] >= 0) {
        if (use_libc) {
          void *p = malloc((size_t)sizes[i]);
          if (!p) {
            rc = -1;
            break;
          }
          /* Keep the compiler from eliding the pair. */
          __asm__ volatile("" : : "r"(p) : "memory");
          held[s] = (uint64_t)(uintptr_t)p;
        } else if (gp_malloc(a, sizes[i], 0, &held[s]) != GP_OK) {
          rc = -1;
          break;
        }
      } else {
        if (use_libc)
          free((void *)(uintptr_t)held[s]);
        else
          gp_free(a, held[s]);
        held[s] = 0;
      }
    }
  }
  int64_t t1 = now_ns();
  for (int64_t s = 0; s < nslots; s++)
    if (held[s]) {
      if (use_libc)
        free((void *)(uintptr_t)held[s]);
      else
        gp_free(a, held[s]);
    }
  free(held);
  return rc == 0 ? t1 - t0 : -1;
}
