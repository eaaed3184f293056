/* ab_planner.c -- chooses the backend for a described call and says why every other one cannot
 * serve it.  Reads only the registry (ab_registry.c); no tensors, no torch, no Python, so the
 * tests can describe any device (a CUDA 6.1 GPU, an MPS machine, a build without CUDA).
 *
 * Candidates, in order:
 *   1. the requested backend (unless "auto"),
 *   2. its chain (sage -> flash; flash_attn_pkg -> flash; _native_* -> sdpa; math -> eager; ...),
 *   3. the device's priority list: CPU flash, math, eager; CUDA flash, sdpa, math, eager (our
 *      kernels first on 8.0+, torch SDPA's kernels first below that, since ours need 8.0);
 *      MPS sdpa, eager; other devices eager.  KV-cache calls have their own lists: CPU
 *      paged_attention, flash, math, eager; CUDA paged_attention, eager (torch SDPA first in 16-bit
 *      types for the calls it reads in place: torch_first_kv); MPS sdpa, eager; others eager.  For
 *      auto on a CPU where torch SDPA computes the dtype on a matrix unit our kernels do not use
 *      (AMX), torch SDPA comes before the list (torch_first, with the registry's data), and the
 *      plan's note says why.
 * The first candidate with no reason against it is chosen.  eager serves every call, so a plan
 * always ends somewhere unless the call itself is impossible.
 */
#include <stdio.h>
#include <string.h>

#include "ab_planner.h"

#define END (-1)

static const int k_auto[AB_DEV_COUNT][8] = {
    [AB_DEVICE_CPU] = {AB_BK_FLASH, AB_BK_FLASH_VARLEN, AB_BK_MATH, AB_BK_EAGER, END},
    [AB_DEVICE_CUDA] = {AB_BK_FLASH, AB_BK_FLASH_VARLEN, AB_BK_SDPA, AB_BK_MATH, AB_BK_EAGER, END},
    [AB_DEVICE_MPS] = {AB_BK_SDPA, AB_BK_EAGER, END},
    [AB_DEVICE_OTHER] = {AB_BK_EAGER, END},
};

/* KV-cache calls (attention_with_kvcache): the decode kernel first, then the gathered paths; on MPS torch
 * SDPA (for the calls it reads in place: why_not), then eager. */
static const int k_kvcache[AB_DEV_COUNT][8] = {
    [AB_DEVICE_CPU] = {AB_BK_PAGED, AB_BK_FLASH, AB_BK_MATH, AB_BK_EAGER, END},
    [AB_DEVICE_CUDA] = {AB_BK_PAGED, AB_BK_EAGER, END},
    [AB_DEVICE_MPS] = {AB_BK_SDPA, AB_BK_EAGER, END}, /* torch's own kernels are all MPS has */
    [AB_DEVICE_OTHER] = {AB_BK_EAGER, END},
};

/* What a named backend falls back to before the device's list. */
static const int* chain_of(int id) {
  static const int flash[] = {AB_BK_FLASH_VARLEN, END};
  static const int flash_varlen[] = {AB_BK_FLASH, END};
  static const int to_flash[] = {AB_BK_FLASH, AB_BK_FLASH_VARLEN, END};
  static const int sage_pkg[] = {AB_BK_SAGE, AB_BK_FLASH, AB_BK_FLASH_VARLEN, END};
  static const int to_sdpa[] = {AB_BK_SDPA, END};
  static const int to_eager[] = {AB_BK_EAGER, END};
  static const int none[] = {END};
  switch (id) {
    case AB_BK_FLASH: return flash;
    case AB_BK_FLASH_VARLEN: return flash_varlen;
    case AB_BK_SAGE: case AB_BK_XFORMERS: case AB_BK_FLASH_ATTN_PKG: return to_flash;
    case AB_BK_SAGE_PKG: return sage_pkg;
    case AB_BK_NATIVE_FLASH: case AB_BK_NATIVE_EFFICIENT: case AB_BK_NATIVE_CUDNN:
    case AB_BK_NATIVE_MATH: case AB_BK_FLEX: return to_sdpa;
    case AB_BK_MATH: return to_eager;
    default: return none;
  }
}

static const char* dtype_list(uint32_t bits, char* buf, size_t n) {
  static const ab_dtype order[] = {AB_DTYPE_F16, AB_DTYPE_BF16, AB_DTYPE_F32, AB_DTYPE_F64};
  size_t used = 0;
  buf[0] = 0;
  for (size_t i = 0; i < sizeof order / sizeof order[0]; ++i)
    if (bits & AB_DTYPE_BIT(order[i]))
      used += (size_t)snprintf(buf + used, used < n ? n - used : 0, "%s%s", used ? ", " : "",
                               ab_dtype_name(order[i]));
  return buf;
}

static int is_torch_sdpa(int id) {
  return id == AB_BK_SDPA || id == AB_BK_NATIVE_FLASH || id == AB_BK_NATIVE_EFFICIENT ||
         id == AB_BK_NATIVE_CUDNN || id == AB_BK_NATIVE_MATH;
}

#define WHY(...)                       \
  do {                                 \
    snprintf(out, n, __VA_ARGS__);     \
    return;                            \
  } while (0)

/* The matrix units this CPU has that torch SDPA computes the call's dtype on and our kernels' ISA path does not
 * (ab_registry.c holds both lists); *unless: the features under which torch does not use them. */
static uint32_t torch_unit_gap(const ab_call* c, uint32_t* unless) {
  *unless = 0;
  return ab_torch_cpu_units(c->dtype, unless) & c->cpu_units & ~ab_our_cpu_units(c->cpu_isa, c->dtype);
}

/* torch_unit_gap for a CPU KV-cache call, less the units our decode kernel computes chunked prefill on
 * (ab_our_kv_cpu_units: AMX-BF16 on the avx512 and amx paths), in the dtype where it was measured to pay in
 * chunked prefill (bfloat16 on AMX-BF16, with a kernel of float32 FMAs: torch_first_kv); 0 for any other (float16
 * on AMX-FP16 is not measured). */
static uint32_t cpu_kv_torch_unit(const ab_call* c) {
  uint32_t unless;
  return c->device == AB_DEVICE_CPU && c->dtype == AB_DTYPE_BF16
             ? torch_unit_gap(c, &unless) & ~ab_our_kv_cpu_units(c->cpu_isa, c->dtype)
             : 0;
}

/* Writes why backend id cannot serve call c into out ("" when it can). */
static void why_not(const ab_call* c, int id, char* out, size_t n) {
  const ab_backend_info* b = ab_backend_at(id);
  const ab_caps* k = &b->caps[c->device < AB_DEV_COUNT ? c->device : AB_DEVICE_OTHER];
  if (c->device == AB_DEVICE_CPU && ab_registry_emulated_caps(id)) k = ab_registry_emulated_caps(id);
  const uint32_t f = k->features;
  const char* pw = NULL;
  char buf[96];
  out[0] = 0;
  if (k->unavailable) WHY("%s", k->unavailable);
  if (!ab_provider_available(id, &pw)) WHY("%s", pw);
  if (c->device == AB_DEVICE_CUDA) {
    if (k->min_cc && c->cuda_cc < k->min_cc)
      WHY("needs compute capability >= %d.%d, this GPU is %d.%d", k->min_cc / 10, k->min_cc % 10,
          c->cuda_cc / 10, c->cuda_cc % 10);
    if (k->needs_cuda_lib && !c->cuda_lib_ok)
      WHY("the CUDA library is not built for compute capability %d.%d", c->cuda_cc / 10,
          c->cuda_cc % 10);
  }
  if (!(k->dtypes & AB_DTYPE_BIT(c->dtype)))
    WHY("no %s support here (supports %s)", ab_dtype_name(c->dtype), dtype_list(k->dtypes, buf, sizeof buf));
  if ((k->min_d && c->D < k->min_d) || (k->max_d && c->D > k->max_d))
    WHY("head dim %lld outside %d..%d", (long long)c->D, k->min_d ? k->min_d : 1, k->max_d);
  if (k->d_multiple && c->D % k->d_multiple)
    WHY("head dim %lld is not a multiple of %d", (long long)c->D, k->d_multiple);
  /* the kind of call before its details: a backend for another kind of call has one reason, whatever
   * the details (one warning per reason) */
  if (c->varlen == 2 && !(f & AB_F_KVCACHE)) WHY("does not serve KV-cache calls (attention_with_kvcache)");
  if (c->varlen == 1 && !(f & AB_F_VARLEN)) WHY("does not take packed (varlen) sequences");
  if (!c->varlen && !(f & AB_F_DENSE))
    WHY("%s", (f & AB_F_VARLEN) ? "takes packed (varlen) sequences only"
                                : "serves KV-cache calls (attention_with_kvcache) only");
  if (c->Dv != c->D && !(f & AB_F_DV))
    WHY("needs the value head dim equal to the query head dim (Dv %lld != D %lld)", (long long)c->Dv,
        (long long)c->D);
  /* a KV-cache call has no attn_mask: its mask field says what a dense attention of the cache would need */
  if (c->varlen != 2 && c->mask == 1 && !(f & AB_F_BOOL_MASK)) WHY("no bool attn_mask support");
  if (c->varlen != 2 && c->mask == 2 && !(f & AB_F_FLOAT_MASK)) WHY("no float attn_mask support");
  if (c->mask_grad && !(f & AB_F_MASK_GRAD)) WHY("cannot compute the gradient of a float attn_mask");
  if (c->causal == AB_CAUSAL_TOP_LEFT && !(f & AB_F_CAUSAL_TL)) WHY("no top-left causal mask");
  if (c->causal == AB_CAUSAL_BOTTOM_RIGHT && !(f & AB_F_CAUSAL_BR)) WHY("no bottom-right causal mask");
  if (c->window && !(f & AB_F_WINDOW)) WHY("no sliding window");
  if ((f & AB_F_BR_ALIGNED) && !c->square &&
      (c->causal == AB_CAUSAL_TOP_LEFT || (c->window && c->causal == AB_CAUSAL_NONE)))
    WHY("aligns causal masks and windows bottom-right, which differs from top-left when Sq != Sk");
  if (c->softcap && !(f & AB_F_SOFTCAP)) WHY("no softcap");
  if (c->dropout && !(f & AB_F_DROPOUT)) WHY("no dropout");
  if (c->need_grad && !(f & AB_F_BACKWARD)) WHY("forward only, and this call needs a gradient");
  if (c->need_grad && c->deterministic && !(f & AB_F_DETERMINISTIC))
    WHY("its backward is not deterministic and deterministic algorithms are requested");
  if (c->want_lse && !(f & AB_F_LSE)) WHY("cannot return lse");
  /* torch SDPA reads a KV cache only in place (attn_backends/_kvcache.py run_sdpa), with at most a
   * bottom-right causal mask built from the host-known sizes (mask 2): the gathered copy, the mask and the
   * index values read back to the host took 2.5-11.4x the CUDA kernel's time (H200) and 4-68x the CPU
   * kernel's (Zen 4; benchmarks/bench_kv_routes.py), so a call that needs them is not torch's to serve */
  if (c->varlen == 2 && id == AB_BK_SDPA && (c->mask == 1 || (c->mask == 2 && c->device != AB_DEVICE_CPU)))
    WHY("reads a KV cache only in place (a dense cache, an int cache_seqlens, no leftpad or window%s); this "
        "call needs a mask or its index values on the host",
        c->device == AB_DEVICE_CPU ? "" : ", causal only for one query token");
  /* On the CPU our decode kernel ran 5.6x (float32) to 34x (bfloat16) faster than torch SDPA at 4096 keys
   * (bench_kv_routes.py, Zen 4), and faster in chunked prefill too but where torch has a unit it does not
   * use (cpu_kv_torch_unit): torch serves only that chunked prefill there, named or not */
  if (c->varlen == 2 && id == AB_BK_SDPA && c->device == AB_DEVICE_CPU && !(c->many_rows && cpu_kv_torch_unit(c)))
    WHY("serves a KV-cache call on the CPU only from %d query rows per KV head and %d tokens, in bfloat16 "
        "on AMX-BF16 that our decode kernel leaves unused (elsewhere ours ran faster)", AB_KV_MANY_ROWS,
        AB_KV_MANY_TOKENS);
  if (c->gqa && !(f & AB_F_GQA)) WHY("no grouped-query attention (Hq != Hkv)");
  if (c->sinks && !(f & AB_F_SINKS)) WHY("no attention sinks");
  if (c->alibi && !(f & AB_F_ALIBI)) WHY("no ALiBi (alibi_slopes)");
  if ((c->sinks || c->alibi) && c->need_grad && !(f & AB_F_SINKS_ALIBI_GRAD))
    WHY("its backward takes no attention sinks or ALiBi (forward only), and this call needs a gradient");
  /* bottom-right causal and windows reach torch SDPA as an explicit bool mask (torch_sdpa.py sdpa_mask),
   * whose rows may see no key at all (Sq > Sk): the same NaN as a caller's mask.  A KV-cache call's mask
   * field already counts them. */
  if (c->device == AB_DEVICE_MPS && c->mps_fix && !c->need_grad && is_torch_sdpa(id) &&
      (c->mask || (c->varlen != 2 && (c->causal == AB_CAUSAL_BOTTOM_RIGHT || c->window))))
    WHY("torch SDPA on MPS gives NaN with an attention mask in evaluation, bottom-right causal and windows "
        "included (ATTN_BACKENDS_DISABLE_MPS_FIX=1 or --disable_mps_fix uses it anyway)");
  if (k->why_not) {
    k->why_not(c, out, n); /* the kernel family's own limits (head dims, shared memory, ...) */
    if (out[0]) return;
  }
  if (b->lossy && c->requested == AB_BK_AUTO) WHY("lossy, so never chosen by auto (name it to use it)");
}

static void push(ab_plan* p, int id) {
  for (int i = 0; i < p->norder; ++i)
    if (p->order[i] == id) return;
  p->order[p->norder++] = id;
}

static const char* unit_name(uint32_t unit) {
  switch (unit) {
    case AB_UNIT_AMX_BF16: return "AMX-BF16";
    case AB_UNIT_AMX_FP16: return "AMX-FP16";
    case AB_UNIT_AMX_INT8: return "AMX-INT8";
    default: return "a matrix unit";
  }
}

/* auto is never slower than torch SDPA: on a CPU with a unit torch computes this dtype on and the
 * ISA path of our kernels does not (ab_registry.c holds both lists), or for the calls where torch's
 * kernel measured faster on this kind of CPU (ab_torch_cpu_faster), torch SDPA goes first; our
 * kernels still serve what it cannot (packed sequences, softcap, lse, ...). */
static void torch_first(const ab_call* c, ab_plan* plan) {
  if (c->device != AB_DEVICE_CPU) return;
  uint32_t unless;
  const uint32_t gap = torch_unit_gap(c, &unless);
  /* Decode through ab.attention in bfloat16 on the avx512 and amx paths goes to the decode kernel even where
   * torch has a unit ours lack: decode reads more than it computes, and the kernel streams each KV head once
   * for its query heads (an Intel Xeon with AMX, 2 threads, bfloat16, D=128, (B, H, S, D) caches as HF keeps
   * them, 2026-12-07: 1.66-2.30x torch SDPA's speed at one token, 2.0-4.65x at 2 and 4 tokens causal, B=1
   * Hq=32 Hkv=8 over 4096 keys, B=8 over 2048, MHA B=4 over 2048; docs/benchmarks.md, "Decode through
   * ab.attention on the AMX Xeon") */
  if (gap && ab_call_decode_route(c) && c->dtype == AB_DTYPE_BF16 &&
      (c->cpu_isa == AB_ISA_AVX512 || c->cpu_isa == AB_ISA_AMX))
    return;
  if (!gap) {
    const char* what = ab_torch_cpu_faster(c);
    if (!what) return;
    push(plan, AB_BK_SDPA);
    snprintf(plan->note, sizeof plan->note,
             "torch SDPA first: its kernel measured faster than ours on this kind of CPU for %s "
             "with no causal mask (docs/benchmarks.md)", what);
    return;
  }
  const uint32_t has = (c->dropout ? AB_F_DROPOUT : 0u) | (c->window ? AB_F_WINDOW : 0u);
  if (has & unless) return;
  push(plan, AB_BK_SDPA);
  snprintf(plan->note, sizeof plan->note,
           "torch SDPA first: it computes %s on %s here, which our %s path does not use, so it is faster",
           ab_dtype_name(c->dtype), unit_name(gap & (0u - gap)), ab_cpu_isa_name((ab_cpu_isa)c->cpu_isa));
}

/* KV-cache calls on CUDA in 16-bit types: our CUDA decode kernel took 1.8-5.6x torch SDPA's time there
 * (H200, bfloat16, 2026-11-27: 0.18-0.56x torch's speed; 2026-12-04, with the tensor-core attention for
 * GQA: 0.40-0.55x; docs/benchmarks.md, "GPU"; float32 ran 2.2-5.8x faster than torch and keeps it).
 * So torch SDPA goes first for the calls it reads in place: a dense cache whose rows all hold the same
 * number of tokens, known on the host (an int cache_seqlens), with no leftpad, no window, and causal
 * only for one query token (mask 0: no mask to build, no index value to read, so no synchronisation and
 * nothing gathered).  The rest (tensor lengths, block tables, lse, softcap, sinks, ALiBi) keep the
 * kernel: torch needs a mask or a gathered copy and host copies of the index values there, and took
 * 2.5-11.4x the kernel's time (H200, benchmarks/bench_kv_routes.py). */
static void torch_first_kv(const ab_call* c, ab_plan* plan) {
  if (plan->reason[AB_BK_SDPA][0]) return; /* torch cannot serve it: lse, softcap, sinks, ALiBi, a mask */
  if (c->device == AB_DEVICE_CPU) {
    /* Chunked prefill on a CPU with a unit torch computes this dtype on and our decode kernel does not
     * (AMX-BF16 on the generic and avx2 paths; the avx512 and amx paths compute it on the tiles,
     * ab_our_kv_cpu_units): from AB_KV_MANY_ROWS query rows per KV head the kernel, bound by its float32 FMAs,
     * took 2.2-3x torch's time over the cache's view (an Intel Xeon with AMX, 2 threads, bfloat16, B=1 Hq=32
     * D=128 over 4096 keys, 2026-12-07, docs/decode.md "Chunked prefill on an AMX CPU": 4 query heads per KV head, 64
     * to 256 tokens, 256 to 1024 rows, 20.5-78.6 ms against 9.4-26.3; 16 per KV head, 32 to 64 tokens,
     * 512 to 1024 rows, 10.2-20.1 against 7.6-15.1; 8 per KV head, 32 tokens: 0.90x our time through the
     * route; MHA, 256 tokens: 0.45x).  Below it torch was as slow or slower (4 per KV head, 33-48 tokens:
     * 1.04-1.15x our time; MHA, 32-128 tokens: 0.96-1.62x), and at 16 tokens of 16 heads per KV head (256
     * rows) even with the kernel, which is why it takes 32 tokens too; sdpa's why_not keeps it off those
     * calls. */
    const uint32_t gap = cpu_kv_torch_unit(c);
    if (!gap || !c->many_rows) return;
    push(plan, AB_BK_SDPA);
    snprintf(plan->note, sizeof plan->note,
             "torch SDPA first: from %d query rows per KV head and %d tokens it computes %s on %s here, "
             "which our decode kernel does not use, so it is faster", AB_KV_MANY_ROWS, AB_KV_MANY_TOKENS,
             ab_dtype_name(c->dtype), unit_name(gap & (0u - gap)));
    return;
  }
  if (c->device != AB_DEVICE_CUDA || (c->dtype != AB_DTYPE_F16 && c->dtype != AB_DTYPE_BF16) || c->mask) return;
  push(plan, AB_BK_SDPA);
  snprintf(plan->note, sizeof plan->note,
           "torch SDPA first: our CUDA decode kernel measured slower than torch SDPA in %s (H200: "
           "0.40-0.55x its speed, docs/benchmarks.md), and this call needs no mask",
           ab_dtype_name(c->dtype));
}

void ab_plan_build(const ab_call* call, ab_plan* plan) {
  memset(plan, 0, sizeof *plan);
  plan->chosen = -1;
  for (int id = 0; id < AB_BK_COUNT; ++id)
    if (id == AB_BK_AUTO)
      snprintf(plan->reason[id], AB_REASON_LEN, "the planner, not a backend");
    else
      why_not(call, id, plan->reason[id], AB_REASON_LEN);
  const int dev = call->device < AB_DEV_COUNT ? call->device : AB_DEVICE_OTHER;
  if (call->requested > AB_BK_AUTO && call->requested < AB_BK_COUNT) {
    push(plan, call->requested);
    for (const int* c = chain_of(call->requested); *c != END; ++c) push(plan, *c);
  }
  if (call->requested == AB_BK_AUTO) (call->varlen == 2 ? torch_first_kv : torch_first)(call, plan);
  for (const int* c = (call->varlen == 2 ? k_kvcache : k_auto)[dev]; *c != END; ++c) push(plan, *c);
  for (int i = 0; i < plan->norder; ++i)
    if (plan->reason[plan->order[i]][0] == 0) {
      plan->chosen = plan->order[i];
      break;
    }
  if (plan->chosen < 0) return;
  const ab_backend_info* b = ab_backend_at(plan->chosen);
  if (b->kind != AB_KIND_BUNDLED)
    snprintf(plan->path, sizeof plan->path, "%s", b->kind == AB_KIND_TORCH ? "torch" : "package");
  else if (call->device == AB_DEVICE_CPU && ab_registry_emulated_caps(plan->chosen))
    snprintf(plan->path, sizeof plan->path, "cuda emulated on cpu");
  else if (call->device == AB_DEVICE_CPU)
    snprintf(plan->path, sizeof plan->path, "cpu %s", ab_cpu_isa_name((ab_cpu_isa)call->cpu_isa));
  else if (call->device == AB_DEVICE_CUDA)
    snprintf(plan->path, sizeof plan->path, "cuda sm%d", call->cuda_cc);
  else
    snprintf(plan->path, sizeof plan->path, "aten composite");
}
