/* ab_cpu_features.c -- which x86 instruction sets this process may use, detected once.
 *
 * An ISA counts only when CPUID reports it AND the OS saves its registers on a context switch
 * (XGETBV: XMM/YMM for AVX, opmask/ZMM for AVX-512, tile data for AMX).  AMX needs one step more
 * on Linux: tile data is off for a process until it asks for it (arch_prctl
 * ARCH_REQ_XCOMP_PERM, Linux 5.16+); a tile instruction before that raises SIGILL.  We ask once,
 * here, and count AMX only if the kernel agrees, so no path can SIGILL on a machine that refuses.
 * Other architectures report no x86 features and run the generic C paths.
 */
#define _GNU_SOURCE /* syscall() */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "ab_core.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* Asks the kernel for the tile-data state component (XFEATURE 18); 0 on success, else errno. */
static int request_tile_permission(void) {
#if defined(__linux__) && defined(__x86_64__) && defined(SYS_arch_prctl)
  enum { ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return errno ? errno : EPERM;
  unsigned long long perm = 0;
  if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &perm) != 0) return errno ? errno : EPERM;
  return (perm >> XFEATURE_XTILEDATA) & 1 ? 0 : EPERM;
#else
  return ENOSYS; /* no way to ask: only Linux on x86-64 is known to hand out tile data */
#endif
}

static unsigned long long read_xcr0(void) {
  unsigned int eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((unsigned long long)edx << 32) | eax;
}

static void detect(ab_cpu_features* f) {
  unsigned int a, b, c, d, max_leaf;
  memset(f, 0, sizeof *f);
  snprintf(f->amx_state, sizeof f->amx_state, "absent (CPUID reports no AMX tiles)");
  max_leaf = __get_cpuid_max(0, NULL);
  if (max_leaf == 0) return;
  __cpuid(0, a, b, c, d);
  memcpy(f->vendor + 0, &b, 4);
  memcpy(f->vendor + 4, &d, 4);
  memcpy(f->vendor + 8, &c, 4);
  f->vendor[12] = 0;

  __cpuid(1, a, b, c, d);
  {
    const unsigned int base = (a >> 8) & 0xf, ext = (a >> 20) & 0xff;
    f->family = (int)(base == 0xf ? base + ext : base);
    f->model = (int)(((base == 0x6 || base == 0xf) ? ((a >> 16) & 0xf) << 4 : 0) | ((a >> 4) & 0xf));
  }
  const int osxsave = (c >> 27) & 1;
  unsigned long long xcr0 = osxsave ? read_xcr0() : 0;
  const int os_avx = (xcr0 & 0x6) == 0x6;       /* XMM and YMM state */
  const int os_avx512 = (xcr0 & 0xe6) == 0xe6;  /* plus opmask, ZMM_Hi256, Hi16_ZMM */
  const int os_amx = (xcr0 & 0x60000) == 0x60000; /* XTILECFG and XTILEDATA */
  f->sse42 = (c >> 20) & 1;
  f->avx = os_avx && ((c >> 28) & 1);
  f->fma = f->avx && ((c >> 12) & 1);
  f->f16c = f->avx && ((c >> 29) & 1);

  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f->avx2 = f->avx && ((b >> 5) & 1);
    f->avx512f = os_avx512 && ((b >> 16) & 1);
    f->avx512dq = f->avx512f && ((b >> 17) & 1);
    f->avx512bw = f->avx512f && ((b >> 30) & 1);
    f->avx512vl = f->avx512f && ((b >> 31) & 1);
    f->avx512_vnni = f->avx512f && ((c >> 11) & 1);
    f->avx512_fp16 = f->avx512f && ((d >> 23) & 1);
    const int cpuid_tile = (d >> 24) & 1, cpuid_bf16 = (d >> 22) & 1, cpuid_int8 = (d >> 25) & 1;
    __cpuid_count(7, 1, a, b, c, d);
    f->avx_vnni = f->avx2 && ((a >> 4) & 1);
    f->avx512_bf16 = f->avx512f && ((a >> 5) & 1);
    const int cpuid_fp16 = (a >> 21) & 1;
    if (!cpuid_tile) {
      snprintf(f->amx_state, sizeof f->amx_state, "absent (CPUID reports no AMX tiles)");
    } else if (!os_amx) {
      snprintf(f->amx_state, sizeof f->amx_state,
               "unusable: the OS does not enable tile state (XCR0 bits 17-18 clear)");
    } else {
      const int e = request_tile_permission();
      if (e) {
        snprintf(f->amx_state, sizeof f->amx_state,
                 "unusable: the kernel refused tile data (arch_prctl ARCH_REQ_XCOMP_PERM: %s)", strerror(e));
      } else {
        f->amx_tile = 1;
        f->amx_bf16 = cpuid_bf16;
        f->amx_int8 = cpuid_int8;
        f->amx_fp16 = cpuid_fp16;
        snprintf(f->amx_state, sizeof f->amx_state, "usable (tile data permission granted)");
      }
    }
  }

  unsigned int max_ext = __get_cpuid_max(0x80000000u, NULL);
  if (max_ext >= 0x80000004u) {
    unsigned int regs[12];
    for (unsigned int leaf = 0; leaf < 3; ++leaf)
      __cpuid(0x80000002u + leaf, regs[leaf * 4], regs[leaf * 4 + 1], regs[leaf * 4 + 2],
              regs[leaf * 4 + 3]);
    memcpy(f->brand, regs, 48);
    f->brand[48] = 0;
  }

  /* the L3 one core sees, from the deterministic cache parameters (leaf 4 on Intel; 0x8000001D on
   * AMD, with TopologyExtensions): ways x partitions x line size x sets of the unified level-3 cache,
   * kept only below 1 TiB (a hypervisor's garbage is 0: not known) */
  const int amd = strcmp(f->vendor, "AuthenticAMD") == 0;
  int topo_ext = 0;
  if (amd && max_ext >= 0x80000001u) {
    __cpuid(0x80000001u, a, b, c, d);
    topo_ext = (c >> 22) & 1;
  }
  const unsigned int cache_leaf = amd ? 0x8000001Du : 4u;
  if (amd ? topo_ext && max_ext >= cache_leaf : max_leaf >= cache_leaf)
    for (unsigned int i = 0; i < 16; ++i) {
      __cpuid_count(cache_leaf, i, a, b, c, d);
      const unsigned int type = a & 0x1f, level = (a >> 5) & 0x7;
      if (type == 0) break;
      if (level == 3 && type == 3) {
        const double bytes = ((b >> 22) + 1.0) * (((b >> 12) & 0x3ff) + 1.0) * ((b & 0xfff) + 1.0) * (c + 1.0);
        f->l3_bytes = bytes < 1099511627776.0 ? (int64_t)bytes : 0;
      }
    }
}
#else
static void detect(ab_cpu_features* f) {
  memset(f, 0, sizeof *f);
  snprintf(f->amx_state, sizeof f->amx_state, "absent (not an x86 CPU)");
}
#endif

static ab_cpu_features g_features;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void detect_once(void) { detect(&g_features); }

const ab_cpu_features* ab_cpu_features_get(void) {
  pthread_once(&g_once, detect_once);
  return &g_features;
}

ab_cpu_vendor ab_cpu_vendor_detect(void) {
  const char* v = ab_cpu_features_get()->vendor;
  if (strcmp(v, "GenuineIntel") == 0) return AB_VENDOR_INTEL;
  return strcmp(v, "AuthenticAMD") == 0 ? AB_VENDOR_AMD : AB_VENDOR_OTHER;
}
