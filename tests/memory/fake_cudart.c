/*
 * A stand-in for libcudart with the few entry points the allocator's CUDA backend resolves,
 * backed by host memory, so the dlopen / dlsym path and the event logic run on a CPU-only
 * machine. Events complete when their stream (or the device) is synchronised, like fake
 * streams on the host backend. Test hooks: fake_* functions.
 */
#include <stdint.h>
#include <stdlib.h>

#define MAX_EVENTS 4096

typedef struct {
  int done;
  void *stream;
} Event;

static int g_device = 0;
static int g_set_device_calls = 0;
static long long g_limit = -1; /* bytes cudaMalloc may hand out; -1: no limit */
static long long g_in_use = 0;
static int g_last_malloc_device = -1;
static Event *g_events[MAX_EVENTS];

typedef struct {
  size_t size;
  long long pad;
} Header;

int cudaMalloc(void **p, size_t n) {
  if (g_limit >= 0 && g_in_use + (long long)n > g_limit) return 2; /* cudaErrorMemoryAllocation */
  Header *h = (Header *)malloc(sizeof(Header) + n);
  if (!h) return 2;
  h->size = n;
  g_in_use += (long long)n;
  g_last_malloc_device = g_device;
  *p = h + 1;
  return 0;
}

int cudaFree(void *p) {
  if (!p) return 0;
  Header *h = (Header *)p - 1;
  g_in_use -= (long long)h->size;
  free(h);
  return 0;
}

int cudaGetDevice(int *d) {
  *d = g_device;
  return 0;
}

int cudaSetDevice(int d) {
  g_device = d;
  g_set_device_calls++;
  return 0;
}

int cudaStreamSynchronize(void *s) {
  for (int i = 0; i < MAX_EVENTS; i++)
    if (g_events[i] && g_events[i]->stream == s) g_events[i]->done = 1;
  return 0;
}

int cudaDeviceSynchronize(void) {
  for (int i = 0; i < MAX_EVENTS; i++)
    if (g_events[i]) g_events[i]->done = 1;
  return 0;
}

int cudaEventCreateWithFlags(void **e, unsigned int flags) {
  (void)flags;
  for (int i = 0; i < MAX_EVENTS; i++)
    if (!g_events[i]) {
      g_events[i] = (Event *)calloc(1, sizeof(Event));
      *e = g_events[i];
      return 0;
    }
  return 2;
}

int cudaEventRecord(void *e, void *s) {
  ((Event *)e)->done = 0;
  ((Event *)e)->stream = s;
  return 0;
}

int cudaEventQuery(void *e) { return ((Event *)e)->done ? 0 : 600; /* cudaErrorNotReady */ }

int cudaEventSynchronize(void *e) {
  ((Event *)e)->done = 1;
  return 0;
}

int cudaEventDestroy(void *e) {
  for (int i = 0; i < MAX_EVENTS; i++)
    if (g_events[i] == e) g_events[i] = NULL;
  free(e);
  return 0;
}

int cudaGetLastError(void) { return 0; }

/* Test hooks. */
void fake_set_limit(long long limit) { g_limit = limit; }
long long fake_in_use(void) { return g_in_use; }
int fake_device(void) { return g_device; }
int fake_last_malloc_device(void) { return g_last_malloc_device; }
int fake_set_device_calls(void) { return g_set_device_calls; }
int fake_live_events(void) {
  int n = 0;
  for (int i = 0; i < MAX_EVENTS; i++) n += g_events[i] != NULL;
  return n;
}
