// emu_device.cpp -- the CUDA emulator's device (emu_block.cpp runs the threads of a block): the
// session of one launcher call (its device memory, its first failure), the emulated device (compute
// capability, shared-memory limits, kernel attributes), the runtime API the launchers call, and
// launches (checked as a device would, then run block by block, on the caller's pool when it has one).
#include <algorithm>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "emu_internal.h"

namespace ab_emu {
namespace detail {

// An integer setting (decimal, or hex with 0x): a value that is not one leaves the default, with a line on
// stderr naming the variable (strtoull read "junk" as 0: seed 0, compute capability 0).
static bool env_integer(const char* name, unsigned long long* out) {
  const char* text = getenv(name);
  if (!text || !*text) return false;
  char* end = nullptr;
  const unsigned long long v = strtoull(text, &end, 0);
  if (*end != '\0' || text[0] == '-') {
    fprintf(stderr, "attn_backends: %s=%s is not a non-negative integer; the default is kept\n", name, text);
    return false;
  }
  *out = v;
  return true;
}

Session& session() {
  static Session* s = [] {
    Session* x = new Session();
    unsigned long long v = 0;
    x->cc = env_integer("ATTN_BACKENDS_CUDA_EMULATE_SM", &v) && v <= 1000 ? (int)v : 80;
    if (env_integer("ATTN_BACKENDS_CUDA_EMULATE_SEED", &v)) x->seed = v;
    return x;
  }();
  return *s;
}

// Shared memory an SM holds for its blocks (the opt-in limit plus the 1 KiB the system keeps per block,
// as the devices report it: an H100 228 KiB, an A100 164 KiB, sm_86 and sm_89 100 KiB).
size_t sm_smem(int cc) {
  if (cc == 90) return 233472;
  if (cc == 86 || cc == 89 || cc / 10 == 12) return 102400;
  if (cc == 80 || cc == 87) return 167936;
  return 65536;
}

size_t optin_smem(int cc) {
  if (cc == 90) return 232448;                         // 227 KiB
  if (cc == 86 || cc == 89 || cc / 10 == 12) return 101376;  // 99 KiB
  if (cc == 80 || cc == 87) return 166912;             // 163 KiB
  return 49152;
}

void record_failure(const std::string& msg) {
  Session& s = session();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.failure.empty()) s.failure = msg;
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

// Whether [p, p + n) lies inside one buffer of the call: the fast path of the explicit checks.
bool in_buffer(const void* p, size_t n) {
  const unsigned char* a = static_cast<const unsigned char*>(p);
  for (const Buffer& b : session().buffers)
    if (a >= b.data && a + n <= b.data + b.bytes) return true;
  return false;
}

// Where a host address falls: inside a buffer, in the canary or guard page next to one.
std::string describe_global(const void* p, size_t n) {
  const unsigned char* a = static_cast<const unsigned char*>(p);
  for (const Buffer& b : session().buffers) {
    if (a >= b.map && a < b.map + b.map_len) {
      const long long off = (long long)(a - b.data);
      if (off >= 0 && (size_t)off + n <= b.bytes)
        return format("bytes [%lld, %lld) of '%s' (in range)", off, off + (long long)n, b.name.c_str());
      const long long es = (long long)(b.elsize ? b.elsize : 1);
      const std::string at = format("byte offset %lld (element %lld%s) of '%s', which has %zu bytes", off,
                                    off >= 0 ? off / es : -((-off + es - 1) / es),
                                    off % es ? ", misaligned" : "", b.name.c_str(), b.bytes);
      if (off < 0) return at + ", before its start";
      return at + ((size_t)off >= b.bytes ? ", past its end" : ", running past its end");
    }
  }
  return format("%zu bytes at %p, outside every buffer the launcher was given", n, p);
}


// "fwd_launch_config [with T = __half; int kD = 64; ...]: kernel" from the launcher's
// __PRETTY_FUNCTION__ and the kernel expression
std::string kernel_label(const char* name, const char* where) {
  std::string w = where ? where : "";
  std::string fn = w.substr(0, w.find('('));
  const size_t sp = fn.rfind(' ');
  if (sp != std::string::npos) fn = fn.substr(sp + 1);
  // the template arguments, without g++'s echo of the typedefs in the signature (int64_t = long, ...)
  std::string with;
  const size_t wp = w.find("[with ");
  if (wp != std::string::npos) {
    const std::string args = w.substr(wp + 6, w.rfind(']') - wp - 6);
    size_t at = 0;
    while (at < args.size()) {
      size_t end = args.find("; ", at);
      if (end == std::string::npos) end = args.size();
      const std::string a = args.substr(at, end - at);
      const std::string lhs = a.substr(0, a.find(" = "));
      if (lhs.compare(0, 3, "ab_") != 0 && (lhs.size() < 2 || lhs.compare(lhs.size() - 2, 2, "_t") != 0))
        with += (with.empty() ? "" : ", ") + a;
      at = end + 2;
    }
  }
  return fn + (with.empty() ? "" : "<" + with + ">") + ": " + name;
}

}  // namespace detail

using namespace detail;

// ---- the runtime API ----------------------------------------------------------------------------------

cudaError_t get_device(int* device) {
  if (session().sticky) return session().last_error;
  *device = 0;
  return cudaSuccess;
}

cudaError_t device_attribute(int* value, cudaDeviceAttr attr, int device) {
  Session& s = session();
  if (s.sticky) return s.last_error;
  if (device != 0) return cudaErrorInvalidValue;
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor: *value = s.cc / 10; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = s.cc % 10; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)optin_smem(s.cc); return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = (int)sm_smem(s.cc); return cudaSuccess;
    case cudaDevAttrReservedSharedMemoryPerBlock: *value = 1024; return cudaSuccess;
    // the SMs of an A100, an RTX A6000, an L40 and an H100 (the decode launcher sizes its splits by them)
    case cudaDevAttrMultiProcessorCount: *value = s.cc == 86 ? 84 : s.cc == 89 ? 142 : s.cc == 90 ? 132 : 108; return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

cudaError_t func_set_attribute(const void* fn, cudaFuncAttribute attr, int value) {
  Session& s = session();
  if (s.sticky) return s.last_error;
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || (size_t)value > optin_smem(s.cc)) {
    record_failure(format("cudaFuncSetAttribute: %d bytes of dynamic shared memory, the device allows %zu", value,
                          optin_smem(s.cc)));
    return cudaErrorInvalidValue;
  }
  s.attrs[fn].max_dynamic_smem = value;
  return cudaSuccess;
}

// The dynamic shared memory a block of fn may ask for: what cudaFuncSetAttribute allowed it, at least the
// default 48 KiB.
static size_t allowed_smem(const Session& s, const void* fn) {
  const auto it = s.attrs.find(fn);
  return it != s.attrs.end() && (size_t)it->second.max_dynamic_smem > kDefaultSmem ? (size_t)it->second.max_dynamic_smem
                                                                                   : kDefaultSmem;
}

// Blocks of fn an SM holds at once, as cudaOccupancyMaxActiveBlocksPerMultiprocessor answers: bound by
// the threads an SM runs (2048; 1536 on sm_86 and sm_89), its shared memory (sm_smem, 1 KiB kept per
// block) and 32 blocks.  The emulator does not know a kernel's registers, which on a device often bind
// first: its answer is an upper bound of the device's.  A block asking for more dynamic shared memory
// than the kernel is allowed (cudaFuncSetAttribute) fits 0 times.
cudaError_t occupancy(int* blocks, const void* fn, int threads, size_t smem) {
  Session& s = session();
  if (s.sticky) return s.last_error;
  if (threads <= 0 || threads > 1024) return cudaErrorInvalidValue;
  const size_t allowed = allowed_smem(s, fn);
  const size_t by_threads = (s.cc == 86 || s.cc == 89 ? 1536 : 2048) / round_up((size_t)threads, 32);
  const size_t by_smem = sm_smem(s.cc) / (smem + 1024);
  const size_t n = smem > allowed ? 0 : std::min<size_t>(std::min(by_threads, by_smem), 32);
  *blocks = (int)n;
  return cudaSuccess;
}

cudaError_t memset_async(void* p, int value, size_t n) {
  Session& s = session();
  if (s.sticky) return s.last_error;
  if (n == 0) return cudaSuccess;
  if (!in_buffer(p, n)) {
    record_failure("cudaMemsetAsync of " + describe_global(p, n));
    return cudaErrorInvalidValue;
  }
  memset(p, value, n);
  return cudaSuccess;
}

cudaError_t get_last_error() {
  Session& s = session();
  const cudaError_t e = s.last_error;
  if (!s.sticky) s.last_error = cudaSuccess;
  return e;
}

const char* error_name(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}

const char* error_string(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

void launch(const void* fn, const char* name, const char* where, dim3 grid, dim3 block, size_t smem,
            cudaStream_t stream, KernelBody body) {
  (void)stream;
  Session& s = session();
  if (s.sticky) return;
  const std::string label = kernel_label(name, where);
  const uint64_t threads = (uint64_t)block.x * block.y * block.z;
  const uint64_t blocks = (uint64_t)grid.x * grid.y * grid.z;
  auto bad_launch = [&](cudaError_t e, const std::string& why) {
    record_failure("launch of " + label + ": " + why);
    s.last_error = e;
  };
  if (threads == 0 || threads > 1024 || block.z > 64)
    return bad_launch(cudaErrorInvalidConfiguration, format("%llu threads per block", (unsigned long long)threads));
  if (blocks == 0 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535)
    return bad_launch(cudaErrorInvalidConfiguration,
                      format("a grid of %u x %u x %u blocks", grid.x, grid.y, grid.z));
  const size_t allowed = allowed_smem(s, fn);
  if (smem > allowed)
    return bad_launch(cudaErrorInvalidValue,
                      format("%zu bytes of dynamic shared memory, the kernel is allowed %zu (cudaFuncSetAttribute)",
                             smem, allowed));
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.log[label]++;
    s.blocks[label] += (long)blocks;
  }
  install_fault_handlers();
  Grid L;
  L.body = body;
  L.label = label;
  L.grid = grid;
  L.block = block;
  L.smem = smem;
  L.nthreads = (int)threads;
  L.serial = ++s.serial;
  const ab_cpu_pool* pool = s.pool;
  if (pool != nullptr && pool->num_threads > 1 && blocks > 1) {
    if (pool->parallel_for(0, (int64_t)blocks, 1, run_blocks_range, &L) != 0) {
      record_failure("launch of " + label + ": the thread pool failed");
      L.failed = true;
    }
  } else {
    run_blocks(&L, 0, (int64_t)blocks);
  }
  if (L.failed) {
    s.sticky = true;
    s.last_error = cudaErrorIllegalAddress;
  }
}


// ---- the session (emu_runtime.h) ------------------------------------------------------------------------

void session_begin(const ab_cpu_pool* pool) {
  Session& s = session();
  s.call.lock();
  s.pool = pool;
  s.last_error = cudaSuccess;
  s.sticky = false;
  s.failure.clear();
}

std::string session_failure() {
  Session& s = session();
  for (const Buffer& b : s.buffers) {
    for (size_t i = 0; i < b.lead_len; ++i)
      if (b.lead[i] != kCanary) {
        record_failure(format("a write %zu bytes before the start of '%s'", b.lead_len - i, b.name.c_str()));
        break;
      }
    for (size_t i = 0; i < b.tail_len; ++i)
      if (b.tail[i] != kCanary) {
        record_failure(format("a write %zu bytes past the end of '%s' (%zu bytes)", i + 1, b.name.c_str(), b.bytes));
        break;
      }
  }
  return s.failure;
}

void session_end() {
  Session& s = session();
  for (const Buffer& b : s.buffers) munmap(b.map, b.map_len);
  s.buffers.clear();
  s.pool = nullptr;
  // a fault is the call's (its context's), not the device's: the planner's queries between calls
  // (shared memory, compute capability) would otherwise fail after it and read as "not known"
  s.last_error = cudaSuccess;
  s.sticky = false;
  s.call.unlock();
}

unsigned char* device_alloc(const char* name, size_t bytes, size_t align_mod, size_t align_rem, bool poison,
                            size_t elsize) {
  if (bytes == 0) return nullptr;
  Session& s = session();
  // [guard page][lead canary | data | tail canary][guard page], data as close to the end as the
  // alignment allows
  const size_t body = round_up(bytes + align_mod, kPage);
  const size_t len = body + 2 * kPage;
  void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  unsigned char* map = static_cast<unsigned char*>(m);
  mprotect(map, kPage, PROT_NONE);
  mprotect(map + kPage + body, kPage, PROT_NONE);
  unsigned char* end = map + kPage + body;
  uintptr_t start = (uintptr_t)(end - bytes);
  start -= (start - align_rem) & (align_mod - 1);  // round down to the wanted residue
  unsigned char* data = reinterpret_cast<unsigned char*>(start);
  unsigned char* page0 = reinterpret_cast<unsigned char*>((uintptr_t)data & ~(uintptr_t)(kPage - 1));
  Buffer b{name, data, bytes, elsize, map, len, page0, data + bytes, (size_t)(data - page0),
           (size_t)(end - data - bytes)};
  memset(b.lead, kCanary, b.lead_len);
  memset(b.tail, kCanary, b.tail_len);
  memset(data, poison ? 0xff : 0, bytes);
  s.buffers.push_back(b);
  return data;
}

int device_cc() { return session().cc; }
void set_device_cc(int cc) { session().cc = cc; }
void set_seed(uint64_t seed) { session().seed = seed; }

// "label\tn" lines of one of the session's per-label counts (the launch log, the blocks launched)
static std::string count_lines(const std::map<std::string, long> Session::*counts) {
  Session& s = session();
  std::lock_guard<std::mutex> lock(s.mu);
  std::string out;
  for (const auto& kv : s.*counts) out += kv.first + "\t" + std::to_string(kv.second) + "\n";
  return out;
}

std::string launch_log() { return count_lines(&Session::log); }
std::string launch_blocks() { return count_lines(&Session::blocks); }

void reset_launch_log() {
  Session& s = session();
  std::lock_guard<std::mutex> lock(s.mu);
  s.log.clear();
  s.blocks.clear();
}

}  // namespace ab_emu
