/* ab_module.c -- the CPython module attn_backends._C (limited API, abi3); with ab_direct.c (the calls
 * that skip the dispatcher) the only files that include Python.h (ab_module.h).
 *
 * Loading this shared object also runs torch_shim.cpp's static registration of the
 * attn_backends::* ops, which is why attn_backends/__init__.py imports torch first.  The functions
 * here expose the tensor-free parts of the core (build facts, CPU features, backend names, the
 * planner) and one direct call of the CPU flash forward for calls that need no autograd
 * (flash_fwd_cpu).  Multi-phase initialisation, state in the module (no global Python state), so it
 * is safe in subinterpreters.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ab_module.h"
#include "ab_shim.h"
#include "cuda/ab_cuda.h"

#ifndef AB_CUDA_ARCHS
#define AB_CUDA_ARCHS ""
#endif

static ab_state* state_of(PyObject* module) { return (ab_state*)PyModule_GetState(module); }

ab_state* ab_module_state(PyObject* module) { return state_of(module); }

static int dict_set_str(PyObject* d, const char* key, const char* value) {
  PyObject* v = PyUnicode_FromString(value);
  if (!v) return -1;
  int rc = PyDict_SetItemString(d, key, v);
  Py_DECREF(v);
  return rc;
}

static int dict_set_int(PyObject* d, const char* key, long long value) {
  PyObject* v = PyLong_FromLongLong(value);
  if (!v) return -1;
  int rc = PyDict_SetItemString(d, key, v);
  Py_DECREF(v);
  return rc;
}

static int dict_set_bool(PyObject* d, const char* key, int value) {
  return PyDict_SetItemString(d, key, value ? Py_True : Py_False);
}

static PyObject* ab_py_cpu_features(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  const ab_cpu_features* f = ab_cpu_features_get();
  PyObject* d = PyDict_New();
  if (!d) return NULL;
#define FLAG(name) \
  if (dict_set_bool(d, #name, f->name) < 0) goto fail;
  FLAG(sse42) FLAG(avx) FLAG(avx2) FLAG(fma) FLAG(f16c)
  FLAG(avx512f) FLAG(avx512bw) FLAG(avx512vl) FLAG(avx512dq) FLAG(avx512_vnni)
  FLAG(avx512_bf16) FLAG(avx512_fp16) FLAG(avx_vnni) FLAG(amx_tile) FLAG(amx_bf16) FLAG(amx_int8)
  FLAG(amx_fp16)
#undef FLAG
  if (dict_set_str(d, "amx_state", f->amx_state) < 0) goto fail;
  if (dict_set_str(d, "vendor", f->vendor) < 0) goto fail;
  if (dict_set_str(d, "brand", f->brand) < 0) goto fail;
  /* CPUID's display family and model (0 off x86); the L3 one core sees (0: CPUID does not say) */
  if (dict_set_int(d, "family", f->family) < 0 || dict_set_int(d, "model", f->model) < 0 ||
      dict_set_int(d, "l3_bytes", (long long)f->l3_bytes) < 0)
    goto fail;
  return d;
fail:
  Py_DECREF(d);
  return NULL;
}

static PyObject* ab_py_build_info(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  ab_shim_info shim = ab_shim_info_get();
  PyObject* d = PyDict_New();
  if (!d) return NULL;
  if (dict_set_str(d, "version", AB_VERSION) < 0) goto fail;
  char ver[32];
  /* torch packs versions as major << 56 | minor << 48 | patch << 40 */
  snprintf(ver, sizeof ver, "%d.%d", (int)(shim.torch_target_version >> 56),
           (int)((shim.torch_target_version >> 48) & 0xff));
  if (dict_set_str(d, "torch_target_version", ver) < 0) goto fail;
  snprintf(ver, sizeof ver, "%d.%d", (int)(shim.torch_abi_version >> 56),
           (int)((shim.torch_abi_version >> 48) & 0xff));
  if (dict_set_str(d, "torch_headers_version", ver) < 0) goto fail;
  if (dict_set_str(d, "cuda_archs", AB_CUDA_ARCHS) < 0) goto fail;
  if (dict_set_str(d, "cuda_library", ab_cuda_library_path()) < 0) goto fail;
  if (dict_set_str(d, "cuda_emu_library", ab_cuda_emu_library_path()) < 0) goto fail;
#if defined(__clang__)
  if (dict_set_str(d, "compiler", "clang " __clang_version__) < 0) goto fail;
#elif defined(__GNUC__)
  if (dict_set_str(d, "compiler", "gcc " __VERSION__) < 0) goto fail;
#else
  if (dict_set_str(d, "compiler", "unknown") < 0) goto fail;
#endif
  return d;
fail:
  Py_DECREF(d);
  return NULL;
}

static const char* kind_name(ab_backend_kind kind) {
  switch (kind) {
    case AB_KIND_BUNDLED: return "bundled";
    case AB_KIND_TORCH: return "torch";
    case AB_KIND_EXTERNAL: return "external";
    default: return "planner";
  }
}

static const char* const k_feature_names[] = {
    "bool_mask", "float_mask", "mask_grad", "causal_top_left", "bottom_right_aligned",
    "causal_bottom_right", "window", "softcap", "dropout", "backward", "deterministic", "lse",
    "gqa", "dv_ne_d", "dense", "varlen", "kvcache", "sinks", "alibi", "sinks_alibi_grad"};

static PyObject* str_tuple(const char* const* items, Py_ssize_t n) {
  PyObject* t = PyTuple_New(n);
  if (!t) return NULL;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* s = PyUnicode_FromString(items[i]);
    if (!s) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SetItem(t, i, s); /* steals s */
  }
  return t;
}

/* (unavailable or None, dtypes, features, min_d, max_d, d_multiple, min_cc, needs_cuda_lib) */
static PyObject* caps_tuple(const ab_caps* k) {
  const char* dts[4];
  const char* fts[sizeof k_feature_names / sizeof k_feature_names[0]];
  Py_ssize_t nd = 0, nf = 0;
  static const ab_dtype order[] = {AB_DTYPE_F16, AB_DTYPE_BF16, AB_DTYPE_F32, AB_DTYPE_F64};
  for (int i = 0; i < 4; ++i)
    if (k->dtypes & AB_DTYPE_BIT(order[i])) dts[nd++] = ab_dtype_name(order[i]);
  for (size_t i = 0; i < sizeof k_feature_names / sizeof k_feature_names[0]; ++i)
    if (k->features & (1u << i)) fts[nf++] = k_feature_names[i];
  PyObject* dt = str_tuple(dts, nd);
  PyObject* ft = dt ? str_tuple(fts, nf) : NULL;
  if (!ft) {
    Py_XDECREF(dt);
    return NULL;
  }
  PyObject* why = k->unavailable ? PyUnicode_FromString(k->unavailable) : Py_NewRef(Py_None);
  if (!why) {
    Py_DECREF(dt);
    Py_DECREF(ft);
    return NULL;
  }
  return Py_BuildValue("(NNNiiiii)", why, dt, ft, k->min_d, k->max_d, k->d_multiple, k->min_cc,
                       k->needs_cuda_lib);
}

/* [(name, aliases, kind, summary, lossy, provider, (caps cpu, cuda, mps, other)), ...] in id order. */
static PyObject* ab_py_backend_table(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  const int n = ab_backend_count();
  PyObject* list = PyList_New(n);
  if (!list) return NULL;
  for (int i = 0; i < n; ++i) {
    const ab_backend_info* b = ab_backend_at(i);
    Py_ssize_t na = 0;
    while (b->aliases[na]) ++na;
    PyObject* aliases = str_tuple(b->aliases, na);
    PyObject* caps = aliases ? PyTuple_New(AB_DEV_COUNT) : NULL;
    if (!caps) {
      Py_XDECREF(aliases);
      goto fail;
    }
    for (int d = 0; d < AB_DEV_COUNT; ++d) {
      PyObject* c = caps_tuple(&b->caps[d]);
      if (!c) {
        Py_DECREF(aliases);
        Py_DECREF(caps);
        goto fail;
      }
      PyTuple_SetItem(caps, d, c);
    }
    PyObject* row = Py_BuildValue("(sNssiiN)", b->name, aliases, kind_name(b->kind), b->summary,
                                  b->lossy, b->provider, caps);
    if (!row) goto fail;
    PyList_SetItem(list, i, row); /* steals row */
  }
  return list;
fail:
  Py_DECREF(list);
  return NULL;
}

/* set_provider(id, available, why_not) */
static PyObject* ab_py_set_provider(PyObject* self, PyObject* args) {
  int id, available;
  const char* why;
  if (!PyArg_ParseTuple(args, "ips", &id, &available, &why)) return NULL;
  if (id < 0 || id >= AB_BK_COUNT) {
    PyErr_SetString(PyExc_ValueError, "backend id out of range");
    return NULL;
  }
  ab_provider_set(id, available, why);
  ab_direct_forget(state_of(self));
  Py_RETURN_NONE;
}

/* enable_cuda_flash(on): see ab_registry_enable_cuda_flash. */
static PyObject* ab_py_enable_cuda_flash(PyObject* self, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return NULL;
  ab_registry_enable_cuda_flash(on);
  ab_direct_forget(state_of(self));
  Py_RETURN_NONE;
}

/* enable_cuda_sage(on): see ab_registry_enable_cuda_sage. */
static PyObject* ab_py_enable_cuda_sage(PyObject* self, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return NULL;
  ab_registry_enable_cuda_sage(on);
  ab_direct_forget(state_of(self));
  Py_RETURN_NONE;
}

/* enable_cuda_decode(on): see ab_registry_enable_cuda_decode. */
static PyObject* ab_py_enable_cuda_decode(PyObject* self, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return NULL;
  ab_registry_enable_cuda_decode(on);
  ab_direct_forget(state_of(self));
  Py_RETURN_NONE;
}

/* set_cuda_emulation(on): CPU tensors of flash, flash_varlen, sage, math and paged_attention run the
 * CUDA kernels on the emulator (docs/cuda.md); loads its library (RuntimeError when it is missing)
 * and tells the planner, which then plans those backends on the CPU with their CUDA capabilities. */
static PyObject* ab_py_set_cuda_emulation(PyObject* self, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return NULL;
  ab_error err;
  err.msg[0] = 0;
  if (ab_cuda_set_emulation(on, &err) != AB_OK) {
    PyErr_SetString(PyExc_RuntimeError, err.msg);
    return NULL;
  }
  ab_registry_set_cuda_emulation(on);
  ab_direct_forget(state_of(self));
  Py_RETURN_NONE;
}

/* cuda_emulation() -> whether the CUDA emulation is on. */
static PyObject* ab_py_cuda_emulation(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return PyBool_FromLong(ab_cuda_emulation() != NULL);
}

/* ---- the call descriptor: ab_call and its Python mirror, Call ---------------------------------- */

#define CALL_FIELD_DESC(type, name, doc) {#name, doc},
static PyStructSequence_Field k_call_fields[] = {AB_CALL_FIELDS(CALL_FIELD_DESC){NULL, NULL}};
#undef CALL_FIELD_DESC

static PyStructSequence_Desc k_call_desc = {
    "attn_backends._C.Call",
    "A call described without tensors, as the planner sees it (csrc/ab_planner.h, ab_call): built by\n"
    "attn_backends._planner.new_call, read by field name by the planner, the report and explain.",
    k_call_fields,
    AB_CALL_NFIELDS,
};

int ab_call_from_py(PyObject* obj, ab_call* c) {
  if (!PyTuple_Check(obj) || PyTuple_Size(obj) != AB_CALL_NFIELDS) {
    PyErr_Format(PyExc_TypeError, "a call descriptor is a Call (or a tuple of %d ints)", (int)AB_CALL_NFIELDS);
    return -1;
  }
  memset(c, 0, sizeof *c);
  Py_ssize_t i = 0;
  long long v;
#define CALL_FIELD_FROM(type, name, doc)                         \
  v = PyLong_AsLongLong(PyTuple_GetItem(obj, i++));              \
  if (v == -1 && PyErr_Occurred()) return -1;                    \
  c->name = (type)v;
  AB_CALL_FIELDS(CALL_FIELD_FROM)
#undef CALL_FIELD_FROM
  if ((int)c->device < 0 || c->device >= AB_DEV_COUNT || (int)c->dtype < 0 || c->dtype > AB_DTYPE_OTHER ||
      (int)c->causal < 0 || c->causal > 2 || c->mask < 0 || c->mask > 2 || c->requested < 0 ||
      c->requested >= AB_BK_COUNT ||
      c->cpu_isa < 0 || c->cpu_isa >= AB_ISA_COUNT || c->cpu_vendor < 0 || c->cpu_vendor >= AB_VENDOR_COUNT ||
      c->cpu_family < 0) {
    PyErr_SetString(PyExc_ValueError, "plan: a field of the call is out of range");
    return -1;
  }
  return 0;
}

/* enum_names() -> {"device": (...), "dtype": (the four floating dtypes), "causal": (...), "mask": (...),
 * "cpu_isa": (...), "cpu_units": (name of bit i, ...), "cpu_vendor": (...)}: each tuple indexed by the C
 * enum's value. */
static PyObject* ab_py_enum_names(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  const char* names[AB_ISA_COUNT > AB_DEV_COUNT ? AB_ISA_COUNT + 4 : AB_DEV_COUNT + 4];
  PyObject* d = PyDict_New();
  if (!d) return NULL;
  PyObject* t;
#define ENUM_ENTRY(key, count, expr)                        \
  for (int i = 0; i < (count); ++i) names[i] = (expr);      \
  t = str_tuple(names, (count));                            \
  if (!t || PyDict_SetItemString(d, key, t) < 0) goto fail; \
  Py_DECREF(t);
  ENUM_ENTRY("device", AB_DEV_COUNT, ab_device_name((ab_device_type)i))
  ENUM_ENTRY("dtype", AB_DTYPE_F64 + 1, ab_dtype_name((ab_dtype)i))
  ENUM_ENTRY("causal", 3, ab_causal_name((ab_causal)i))
  ENUM_ENTRY("mask", 3, ab_mask_kind_name(i))
  ENUM_ENTRY("cpu_isa", AB_ISA_COUNT, ab_cpu_isa_name((ab_cpu_isa)i))
  ENUM_ENTRY("cpu_units", AB_UNIT_COUNT, ab_unit_name(i))
  ENUM_ENTRY("cpu_vendor", AB_VENDOR_COUNT, ab_cpu_vendor_name(i))
#undef ENUM_ENTRY
  return d;
fail:
  Py_XDECREF(t);
  Py_DECREF(d);
  return NULL;
}

/* call_fields() -> the names of Call's fields, in order (the planner's signature). */
static PyObject* ab_py_call_fields(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  PyObject* t = PyTuple_New(AB_CALL_NFIELDS);
  if (!t) return NULL;
  for (int i = 0; i < AB_CALL_NFIELDS; ++i) {
    PyObject* s = PyUnicode_FromString(k_call_fields[i].name);
    if (!s) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SetItem(t, i, s);
  }
  return t;
}

/* plan(call) -> (chosen id or -1, (order...), (reason per id...), path, note) for a Call. */
static PyObject* ab_py_plan(PyObject* self, PyObject* arg) {
  (void)self;
  ab_call c;
  if (ab_call_from_py(arg, &c) < 0) return NULL;
  ab_plan p;
  ab_plan_build(&c, &p);
  PyObject* order = PyTuple_New(p.norder);
  PyObject* reasons = order ? PyTuple_New(AB_BK_COUNT) : NULL;
  if (!reasons) {
    Py_XDECREF(order);
    return NULL;
  }
  for (int i = 0; i < p.norder; ++i) PyTuple_SetItem(order, i, PyLong_FromLong(p.order[i]));
  for (int i = 0; i < AB_BK_COUNT; ++i) {
    PyObject* s = PyUnicode_FromString(p.reason[i]);
    if (!s) {
      Py_DECREF(order);
      Py_DECREF(reasons);
      return NULL;
    }
    PyTuple_SetItem(reasons, i, s);
  }
  return Py_BuildValue("(iNNss)", p.chosen, order, reasons, p.path, p.note);
}

/* lookup(name) -> canonical name, or None when the name is unknown. */
static PyObject* ab_py_lookup(PyObject* self, PyObject* arg) {
  (void)self;
  if (!PyUnicode_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "backend name must be a str");
    return NULL;
  }
  const char* name = PyUnicode_AsUTF8AndSize(arg, NULL);
  if (!name) return NULL;
  int idx = ab_backend_lookup(name);
  if (idx < 0) Py_RETURN_NONE;
  return PyUnicode_FromString(ab_backend_at(idx)->name);
}

/* cuda_device(index) -> (compute capability as int, e.g. 90, bool: our library has code for it, why
 * not, bytes of shared memory a block may opt in to), or (0, False, reason, 0) when the library or the
 * device is missing.  Loads the CUDA library: call it only once a CUDA tensor has arrived. */
static PyObject* ab_py_cuda_device(PyObject* self, PyObject* arg) {
  (void)self;
  long index = PyLong_AsLong(arg);
  if (index == -1 && PyErr_Occurred()) return NULL;
  ab_error err;
  err.msg[0] = 0;
  const ab_cuda_api* api = ab_cuda_load(&err);
  if (!api) return Py_BuildValue("(iOsi)", 0, Py_False, err.msg, 0);
  int cc = 0, smem = 0;
  if (api->device_capability((int)index, &cc, &err) != AB_OK ||
      api->device_smem_optin((int)index, &smem, &err) != AB_OK)
    return Py_BuildValue("(iOsi)", 0, Py_False, err.msg, 0);
  const int ok = api->supports_cc(cc);
  return Py_BuildValue("(iOsi)", cc, ok ? Py_True : Py_False,
                       ok ? "" : "the CUDA library was not built for this compute capability", smem);
}

static int isa_from_name(PyObject* arg) {
  const char* name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8AndSize(arg, NULL) : NULL;
  if (!name) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "ISA name must be a str");
    return -1;
  }
  for (int i = AB_ISA_GENERIC; i < AB_ISA_COUNT; ++i)
    if (strcmp(name, ab_cpu_isa_name((ab_cpu_isa)i)) == 0) return i;
  PyErr_Format(PyExc_ValueError, "unknown CPU ISA %R; valid: generic, avx2, avx512, amx, amx_emu", arg);
  return -1;
}

/* cpu_isa() -> the path the CPU kernels use now ("generic", "avx2", "avx512", "amx", "amx_emu"). */
static PyObject* ab_py_cpu_isa(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return PyUnicode_FromString(ab_cpu_isa_name(ab_cpu_isa_get()));
}

/* cpu_isa_index() -> the path as its ab_cpu_isa number (the planner's call field; cheap per call). */
static PyObject* ab_py_cpu_isa_index(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return PyLong_FromLong((long)ab_cpu_isa_get());
}

/* cpu_isa_error() -> why ATTN_BACKENDS_CPU_ISA cannot be honoured, or None. */
static PyObject* ab_py_cpu_isa_error(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  const char* e = ab_cpu_isa_error();
  if (!e) Py_RETURN_NONE;
  return PyUnicode_FromString(e);
}

/* cpu_units() -> the AB_UNIT_* bits this CPU has and this process may use (AMX tiles). */
static PyObject* ab_py_cpu_units(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return PyLong_FromUnsignedLong(ab_cpu_units_detect());
}

/* cpu_vendor() -> who made this CPU, as an ab_cpu_vendor number (0 other, 1 Intel, 2 AMD). */
static PyObject* ab_py_cpu_vendor(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return PyLong_FromLong((long)ab_cpu_vendor_detect());
}

/* cpu_isa_supported(name) -> bool */
static PyObject* ab_py_cpu_isa_supported(PyObject* self, PyObject* arg) {
  (void)self;
  int isa = isa_from_name(arg);
  if (isa < 0) return NULL;
  return PyBool_FromLong(ab_cpu_isa_supported((ab_cpu_isa)isa));
}

/* set_cpu_isa(name) -> bool: switches the path for the whole process (False if unsupported). */
static PyObject* ab_py_set_cpu_isa(PyObject* self, PyObject* arg) {
  (void)self;
  int isa = isa_from_name(arg);
  if (isa < 0) return NULL;
  return PyBool_FromLong(ab_cpu_isa_set((ab_cpu_isa)isa));
}

/* sage_cpu_isa() -> the path the sage kernel uses now ("generic", "avx2", "avx512_vnni", "amx_int8",
 * "amx_emu"). */
static PyObject* ab_py_sage_cpu_isa(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return PyUnicode_FromString(ab_sage_cpu_isa_name());
}

/* fma_peak(seconds, threads) -> float32 flop/s of FMA chains on that many threads (GIL released). */
static PyObject* ab_py_fma_peak(PyObject* self, PyObject* args) {
  (void)self;
  double seconds = 0.3;
  int threads = 1;
  if (!PyArg_ParseTuple(args, "|di", &seconds, &threads)) return NULL;
  double rate;
  Py_BEGIN_ALLOW_THREADS rate = ab_cpu_fma_peak(seconds, threads);
  Py_END_ALLOW_THREADS return PyFloat_FromDouble(rate);
}

/* _amx_emu_dot(op, a, b, c, (rows_c, colsb_c, rows_a, colsb_a, rows_b, colsb_b)) -> bytes: one
 * product on the emulated tiles (tests of the emulation; ab_amx_emu_dot). */
static PyObject* ab_py_amx_emu_dot(PyObject* self, PyObject* args) {
  (void)self;
  int op, shape[6];
  PyObject *a, *b, *c;
  if (!PyArg_ParseTuple(args, "iSSS(iiiiii)", &op, &a, &b, &c, &shape[0], &shape[1], &shape[2], &shape[3],
                        &shape[4], &shape[5]))
    return NULL;
  char *pa, *pb, *pc;
  Py_ssize_t na, nb, nc;
  if (PyBytes_AsStringAndSize(a, &pa, &na) < 0 || PyBytes_AsStringAndSize(b, &pb, &nb) < 0 ||
      PyBytes_AsStringAndSize(c, &pc, &nc) < 0)
    return NULL;
  const Py_ssize_t want[3] = {(Py_ssize_t)shape[0] * shape[1], (Py_ssize_t)shape[2] * shape[3],
                              (Py_ssize_t)shape[4] * shape[5]};
  const Py_ssize_t have[3] = {nc, na, nb};
  for (int i = 0; i < 6; ++i)
    if (shape[i] < 0 || shape[i] > 255) {
      PyErr_Format(PyExc_ValueError, "_amx_emu_dot: shape[%d] = %d is not in [0, 255]", i, shape[i]);
      return NULL;
    }
  static const char* const names[3] = {"c", "a", "b"};
  Py_ssize_t room = 1024; /* a whole tile, at least: a valid configuration never reads past it */
  for (int i = 0; i < 3; ++i) {
    if (have[i] != want[i]) {
      PyErr_Format(PyExc_ValueError, "_amx_emu_dot: %s has %zd bytes, its shape says %zd", names[i], have[i],
                   want[i]);
      return NULL;
    }
    if (have[i] > room) room = have[i];
  }
  char* out = (char*)PyMem_Calloc((size_t)room * 3, 1);
  if (!out) return PyErr_NoMemory();
  memcpy(out, pc, (size_t)nc);
  memcpy(out + room, pa, (size_t)na);
  memcpy(out + 2 * room, pb, (size_t)nb);
  ab_amx_emu_dot(op, out + room, out + 2 * room, out, shape);
  PyObject* r = PyBytes_FromStringAndSize(out, nc);
  PyMem_Free(out);
  return r;
}

static PyMethodDef ab_methods[] = {
    {"_amx_emu_dot", ab_py_amx_emu_dot, METH_VARARGS,
     "_amx_emu_dot(op, a, b, c, shape) -> C after one emulated tile product (tests of the emulation)."},
    {"fma_peak", ab_py_fma_peak, METH_VARARGS,
     "fma_peak(seconds=0.3, threads=1) -> float32 flop/s of independent FMA chains on the CPU path."},
    {"cpu_isa", ab_py_cpu_isa, METH_NOARGS,
     "cpu_isa() -> the instruction-set path of the CPU kernels (ATTN_BACKENDS_CPU_ISA forces one)."},
    {"cpu_isa_index", ab_py_cpu_isa_index, METH_NOARGS,
     "cpu_isa_index() -> the CPU kernels' path as a number (0 generic, 1 avx2, 2 avx512, 3 amx, 4 amx_emu)."},
    {"cpu_isa_error", ab_py_cpu_isa_error, METH_NOARGS,
     "cpu_isa_error() -> why ATTN_BACKENDS_CPU_ISA cannot be honoured (CPU kernel calls fail with it), or None."},
    {"cpu_units", ab_py_cpu_units, METH_NOARGS,
     "cpu_units() -> bits of the CPU matrix units this process may use (1 AMX-BF16, 2 AMX-FP16, 4 AMX-INT8)."},
    {"cpu_vendor", ab_py_cpu_vendor, METH_NOARGS,
     "cpu_vendor() -> who made this CPU, for the call descriptor (0 other, 1 Intel, 2 AMD)."},
    {"cpu_isa_supported", ab_py_cpu_isa_supported, METH_O,
     "cpu_isa_supported(name) -> whether this CPU and OS can run that path."},
    {"set_cpu_isa", ab_py_set_cpu_isa, METH_O,
     "set_cpu_isa(name) -> switch the CPU kernels' path for this process; False if unsupported."},
    {"sage_cpu_isa", ab_py_sage_cpu_isa, METH_NOARGS,
     "sage_cpu_isa() -> the sage kernel's path: the CPU path, except AVX-512 without VNNI runs avx2."},
    {"cpu_features", ab_py_cpu_features, METH_NOARGS,
     "cpu_features() -> dict: x86 ISA extensions usable by this process (CPUID and XGETBV)."},
    {"build_info", ab_py_build_info, METH_NOARGS,
     "build_info() -> dict: version, torch ABI target, CUDA archs, compiler."},
    {"backend_table", ab_py_backend_table, METH_NOARGS,
     "backend_table() -> the registry: (name, aliases, kind, summary, lossy, provider, caps) rows."},
    {"enable_cuda_flash", ab_py_enable_cuda_flash, METH_O,
     "enable_cuda_flash(on): serve flash/flash_varlen (forward, backward) and math backward on CUDA from our (not yet verified) kernels."},
    {"enable_cuda_sage", ab_py_enable_cuda_sage, METH_O,
     "enable_cuda_sage(on): serve sage on CUDA (forward only) from our (not yet verified) kernel."},
    {"enable_cuda_decode", ab_py_enable_cuda_decode, METH_O,
     "enable_cuda_decode(on): serve paged_attention (attention_with_kvcache) on CUDA from our kernel (on by default)."},
    {"set_provider", ab_py_set_provider, METH_VARARGS,
     "set_provider(id, available, why_not): record whether a torch feature or package exists."},
    {"plan", ab_py_plan, METH_O,
     "plan(call) -> (chosen, order, reasons, path, note) for a Call (see ab_planner.h)."},
    {"call_fields", ab_py_call_fields, METH_NOARGS, "call_fields() -> the names of Call's fields, in order."},
    {"enum_names", ab_py_enum_names, METH_NOARGS,
     "enum_names() -> {enum: names indexed by value} for the call descriptor's enum fields."},
    {"set_cuda_emulation", ab_py_set_cuda_emulation, METH_O,
     "set_cuda_emulation(on): CPU tensors of flash, flash_varlen, sage and math run the CUDA kernels on the emulator."},
    {"cuda_emulation", ab_py_cuda_emulation, METH_NOARGS, "cuda_emulation() -> whether the CUDA emulation is on."},
    {"cuda_device", ab_py_cuda_device, METH_O,
     "cuda_device(index) -> (cc, supported, why_not): loads the CUDA library and asks the device."},
    {"lookup", ab_py_lookup, METH_O,
     "lookup(name) -> canonical backend name for any accepted name, or None."},
    {NULL, NULL, 0, NULL},
};

static int ab_exec(PyObject* module) {
  ab_state* st = state_of(module);
  if (ab_direct_init(st) < 0 || PyModule_AddFunctions(module, ab_direct_methods) < 0) return -1;
  st->call_type = (PyObject*)PyStructSequence_NewType(&k_call_desc);
  if (!st->call_type || PyModule_AddObjectRef(module, "Call", st->call_type) < 0) return -1;
  if (PyModule_AddIntConstant(module, "FEW_QUERIES", AB_FEW_QUERIES) < 0) return -1;
  if (PyModule_AddIntConstant(module, "KV_MANY_ROWS", AB_KV_MANY_ROWS) < 0) return -1;
  if (PyModule_AddIntConstant(module, "KV_MANY_TOKENS", AB_KV_MANY_TOKENS) < 0) return -1;
  return PyModule_AddStringConstant(module, "__version__", AB_VERSION);
}

static int ab_traverse(PyObject* module, visitproc visit, void* arg) {
  ab_state* st = state_of(module);
  if (!st) return 0;
  return ab_state_traverse(st, visit, arg);
}

static int ab_clear(PyObject* module) {
  ab_state* st = state_of(module);
  if (!st) return 0;
  ab_state_clear(st);
  return 0;
}

static void ab_free(void* module) { ab_clear((PyObject*)module); }

static PyModuleDef_Slot ab_slots[] = {
    {Py_mod_exec, (void*)ab_exec},
    {0, NULL},
};

static struct PyModuleDef ab_module = {
    PyModuleDef_HEAD_INIT,
    "attn_backends._C",
    "C core of attn_backends: build facts, CPU features, backend names.  Importing it registers\n"
    "the attn_backends::* torch ops.",
    sizeof(ab_state),
    ab_methods,
    ab_slots,
    ab_traverse,
    ab_clear,
    ab_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&ab_module); }
