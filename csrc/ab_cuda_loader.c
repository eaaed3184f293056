/* ab_cuda_loader.c -- finds and loads libattn_backends_cuda.so, once, on first use; and the CUDA
 * emulator's twin, libattn_backends_cuda_emu.so (the same launchers built with g++ against
 * csrc/cuda/emu), loaded when ATTN_BACKENDS_CUDA_EMULATE switches the emulation on.
 *
 * Beside the tables, the planner's question for the kernels behind them (ab_cuda_flash_why_not,
 * ab_cuda_sage_why_not): the launchers' own head-dim rule and configs (cuda/ab_cuda_limits.h) against
 * the shared memory the device reports.
 *
 * The libraries sit beside this module's own shared object; dladdr() on one of our symbols gives
 * that directory, so the lookup does not depend on LD_LIBRARY_PATH or the working directory.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "ab_core.h"
#include "ab_planner.h"
#include "cuda/ab_cuda.h"
#include "cuda/ab_cuda_limits.h"

#define AB_CUDA_LIB_NAME "libattn_backends_cuda.so"
#define AB_CUDA_EMU_LIB_NAME "libattn_backends_cuda_emu.so"

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static const ab_cuda_api* g_api;
static char g_path[4096];
static char g_why[512];

/* path = the directory of this module + "/" + name */
static void beside_module(const char* name, char* path, size_t n) {
  Dl_info info;
  path[0] = 0;
  if (dladdr((void*)&ab_cuda_load, &info) && info.dli_fname) {
    const char* slash = strrchr(info.dli_fname, '/');
    size_t dir = slash ? (size_t)(slash - info.dli_fname) : 0;
    if (dir + strlen(name) + 2 < n) {
      memcpy(path, info.dli_fname, dir);
      snprintf(path + dir, n - dir, "%s%s", dir ? "/" : "", name);
    }
  }
  if (!path[0]) snprintf(path, n, "%s", name);
}

static void locate(void) { beside_module(AB_CUDA_LIB_NAME, g_path, sizeof g_path); }

/* Opens path and returns the table its `symbol` gives, or NULL with why. */
static const ab_cuda_api* open_table(const char* path, const char* symbol, char* why, size_t n) {
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* e = dlerror();
    snprintf(why, n, "the CUDA library could not be loaded (%.400s)", e ? e : path);
    return NULL;
  }
  typedef const ab_cuda_api* (*getter)(void);
  getter get = (getter)dlsym(handle, symbol);
  const ab_cuda_api* api = get ? get() : NULL;
  if (!api) {
    snprintf(why, n, "%.400s does not export %s", path, symbol);
    return NULL;
  }
  if (api->api_version != AB_CUDA_API_VERSION) {
    snprintf(why, n, "%.400s has launcher table version %d, this module needs %d; rebuild", path,
             api->api_version, AB_CUDA_API_VERSION);
    return NULL;
  }
  return api; /* the handle stays open for the life of the process */
}

static void load_once(void) {
  (void)ab_cuda_library_path();
  g_api = open_table(g_path, "ab_cuda_api_get", g_why, sizeof g_why);
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

/* ---- the emulator ---------------------------------------------------------------------------- */

static pthread_once_t g_emu_once = PTHREAD_ONCE_INIT;
static const ab_cuda_api* g_emu_api;
static char g_emu_path[4096];
static char g_emu_why[512];
static volatile int g_emu_on; /* set under the GIL, read by the ops */

static void load_emu_once(void) {
  beside_module(AB_CUDA_EMU_LIB_NAME, g_emu_path, sizeof g_emu_path);
  g_emu_api = open_table(g_emu_path, "ab_cuda_emu_api_get", g_emu_why, sizeof g_emu_why);
}

const char* ab_cuda_emu_library_path(void) {
  pthread_once(&g_emu_once, load_emu_once);
  return g_emu_path;
}

ab_status ab_cuda_set_emulation(int on, ab_error* err) {
  if (on) {
    pthread_once(&g_emu_once, load_emu_once);
    if (!g_emu_api) return ab_error_set(err, AB_ERR_UNAVAILABLE, "CUDA emulation: %s", g_emu_why);
  }
  g_emu_on = on != 0;
  return AB_OK;
}

const ab_cuda_api* ab_cuda_emulation(void) { return g_emu_on ? g_emu_api : NULL; }

/* ---- what the kernels behind the tables can serve, for the planner ------------------------------ */

/* Shared memory per block of the device a call runs on: the described CUDA device's (0 = not known),
 * or for a CPU call under the CUDA emulation the emulated device's. */
static int64_t call_smem(const ab_call* c) {
  if (c->device == AB_DEVICE_CUDA) return c->cuda_smem;
  const ab_cuda_api* emu = ab_cuda_emulation();
  int bytes = 0;
  ab_error err;
  return emu && emu->device_smem_optin(0, &bytes, &err) == AB_OK ? bytes : 0;
}

void ab_cuda_flash_why_not(const ab_call* c, char* out, size_t n) {
  const int64_t smem = call_smem(c);
  if (ab_cuda_kernel_why_not(AB_CUDA_FLASH_FWD, c->D, c->Dv, smem, out, n)) return;
  if (c->need_grad) ab_cuda_kernel_why_not(AB_CUDA_FLASH_BWD, c->D, c->Dv, smem, out, n);
}

void ab_cuda_sage_why_not(const ab_call* c, char* out, size_t n) {
  ab_cuda_kernel_why_not(AB_CUDA_SAGE_FWD, c->D, c->Dv, call_smem(c), out, n);
}
