/* cpu_threads.c -- per-thread scratch of the CPU kernels (cpu_threads.h). */
#include <pthread.h>
#include <stdlib.h>

#include "cpu_threads.h"

typedef struct scratch {
  void* ptr;
  size_t bytes;
} scratch;

static pthread_key_t g_scratch_key;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;

static void scratch_destroy(void* v) {
  scratch* s = (scratch*)v;
  free(s->ptr);
  free(s);
}

static void scratch_key_init(void) { pthread_key_create(&g_scratch_key, scratch_destroy); }

void* ab_scratch_alloc(size_t bytes) {
  pthread_once(&g_scratch_once, scratch_key_init);
  scratch* s = (scratch*)pthread_getspecific(g_scratch_key);
  if (!s) {
    s = (scratch*)calloc(1, sizeof *s);
    if (!s || pthread_setspecific(g_scratch_key, s) != 0) {
      free(s);
      return NULL;
    }
  }
  const size_t want = (bytes + 63) & ~(size_t)63;
  if (s->ptr && s->bytes >= want) return s->ptr;
  free(s->ptr);
  s->bytes = 0;
  s->ptr = aligned_alloc(64, want ? want : 64);
  if (s->ptr) s->bytes = want;
  return s->ptr;
}

void ab_scratch_free(void* ptr) {
  scratch* s = (scratch*)pthread_getspecific(g_scratch_key);
  if (s && s->ptr == ptr && s->bytes > ((size_t)64 << 20)) {
    free(s->ptr);
    s->ptr = NULL;
    s->bytes = 0;
  }
}
