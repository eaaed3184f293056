/* ab_cuda_loader.c -- finds and loads libattn_backends_cuda.so, once, on first use.
 *
 * The library sits beside this module's own shared object; dladdr() on one of our symbols gives
 * that directory, so the lookup does not depend on LD_LIBRARY_PATH or the working directory.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "ab_core.h"
#include "cuda/ab_cuda.h"

#define AB_CUDA_LIB_NAME "libattn_backends_cuda.so"

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static const ab_cuda_api* g_api;
static char g_path[4096];
static char g_why[512];

static void locate(void) {
  Dl_info info;
  g_path[0] = 0;
  if (dladdr((void*)&ab_cuda_load, &info) && info.dli_fname) {
    const char* slash = strrchr(info.dli_fname, '/');
    size_t dir = slash ? (size_t)(slash - info.dli_fname) : 0;
    if (dir + sizeof(AB_CUDA_LIB_NAME) + 1 < sizeof g_path) {
      memcpy(g_path, info.dli_fname, dir);
      snprintf(g_path + dir, sizeof g_path - dir, "%s%s", dir ? "/" : "", AB_CUDA_LIB_NAME);
    }
  }
  if (!g_path[0]) snprintf(g_path, sizeof g_path, "%s", AB_CUDA_LIB_NAME);
}

static void load_once(void) {
  (void)ab_cuda_library_path();
  void* handle = dlopen(g_path, RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* e = dlerror();
    snprintf(g_why, sizeof g_why, "the CUDA library could not be loaded (%.400s)", e ? e : g_path);
    return;
  }
  typedef const ab_cuda_api* (*getter)(void);
  getter get = (getter)dlsym(handle, "ab_cuda_api_get");
  const ab_cuda_api* api = get ? get() : NULL;
  if (!api) {
    snprintf(g_why, sizeof g_why, "%.400s does not export ab_cuda_api_get", g_path);
    return;
  }
  if (api->api_version != AB_CUDA_API_VERSION) {
    snprintf(g_why, sizeof g_why, "%.400s has launcher table version %d, this module needs %d; rebuild",
             g_path, api->api_version, AB_CUDA_API_VERSION);
    return;
  }
  g_api = api; /* the handle stays open for the life of the process */
}

const ab_cuda_api* ab_cuda_load(ab_error* err) {
  pthread_once(&g_once, load_once);
  if (!g_api) ab_error_set(err, AB_ERR_UNAVAILABLE, "%s", g_why);
  return g_api;
}

const char* ab_cuda_library_path(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, locate);
  return g_path;
}
