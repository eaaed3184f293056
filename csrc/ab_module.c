/* ab_module.c -- the CPython module attn_backends._C (limited API, abi3): the only file that
 * includes Python.h.
 *
 * Loading this shared object also runs torch_shim.cpp's static registration of the
 * attn_backends::* ops, which is why attn_backends/__init__.py imports torch first.  The functions
 * here expose the tensor-free parts of the core: build facts, CPU features and backend names.
 * Multi-phase initialisation, no global Python state, so it is safe in subinterpreters.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdio.h>

#include "ab_core.h"
#include "ab_shim.h"
#include "cuda/ab_cuda.h"

#ifndef AB_CUDA_ARCHS
#define AB_CUDA_ARCHS ""
#endif

static int dict_set_str(PyObject* d, const char* key, const char* value) {
  PyObject* v = PyUnicode_FromString(value);
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
#undef FLAG
  if (dict_set_str(d, "vendor", f->vendor) < 0) goto fail;
  if (dict_set_str(d, "brand", f->brand) < 0) goto fail;
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

/* [(name, (aliases...), kind, summary), ...] in the registry's order. */
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
    PyObject* aliases = PyTuple_New(na);
    if (!aliases) goto fail;
    for (Py_ssize_t a = 0; a < na; ++a) {
      PyObject* s = PyUnicode_FromString(b->aliases[a]);
      if (!s) {
        Py_DECREF(aliases);
        goto fail;
      }
      PyTuple_SetItem(aliases, a, s); /* steals s */
    }
    PyObject* row = Py_BuildValue("(sNss)", b->name, aliases, kind_name(b->kind), b->summary);
    if (!row) goto fail;
    PyList_SetItem(list, i, row); /* steals row */
  }
  return list;
fail:
  Py_DECREF(list);
  return NULL;
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

/* cuda_device(index) -> (compute capability as int, e.g. 90, bool: our library has code for it),
 * or (0, False, reason) when the library or the device is missing.  Loads the CUDA library: call it
 * only once a CUDA tensor has arrived. */
static PyObject* ab_py_cuda_device(PyObject* self, PyObject* arg) {
  (void)self;
  long index = PyLong_AsLong(arg);
  if (index == -1 && PyErr_Occurred()) return NULL;
  ab_error err;
  err.msg[0] = 0;
  const ab_cuda_api* api = ab_cuda_load(&err);
  if (!api) return Py_BuildValue("(iOs)", 0, Py_False, err.msg);
  int cc = 0;
  if (api->device_capability((int)index, &cc, &err) != AB_OK)
    return Py_BuildValue("(iOs)", 0, Py_False, err.msg);
  const int ok = api->supports_cc(cc);
  return Py_BuildValue("(iOs)", cc, ok ? Py_True : Py_False,
                       ok ? "" : "the CUDA library was not built for this compute capability");
}

static PyMethodDef ab_methods[] = {
    {"cpu_features", ab_py_cpu_features, METH_NOARGS,
     "cpu_features() -> dict: x86 ISA extensions usable by this process (CPUID and XGETBV)."},
    {"build_info", ab_py_build_info, METH_NOARGS,
     "build_info() -> dict: version, torch ABI target, CUDA archs, compiler."},
    {"backend_table", ab_py_backend_table, METH_NOARGS,
     "backend_table() -> list of (name, aliases, kind, summary) rows of the registry."},
    {"cuda_device", ab_py_cuda_device, METH_O,
     "cuda_device(index) -> (cc, supported, why_not): loads the CUDA library and asks the device."},
    {"lookup", ab_py_lookup, METH_O,
     "lookup(name) -> canonical backend name for any accepted name, or None."},
    {NULL, NULL, 0, NULL},
};

static int ab_exec(PyObject* module) {
  return PyModule_AddStringConstant(module, "__version__", AB_VERSION);
}

static PyModuleDef_Slot ab_slots[] = {
    {Py_mod_exec, (void*)ab_exec},
    {0, NULL},
};

static struct PyModuleDef ab_module = {
    PyModuleDef_HEAD_INIT,
    "attn_backends._C",
    "C core of attn_backends: build facts, CPU features, backend names.  Importing it registers\n"
    "the attn_backends::* torch ops.",
    0,
    ab_methods,
    ab_slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&ab_module); }
