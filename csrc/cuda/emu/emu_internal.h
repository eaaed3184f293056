// emu_internal.h -- what the emulator's two halves share: emu_block.cpp (the threads of a block:
// fibers, the scheduler, the collectives, faults) and emu_device.cpp (the device: its memory, the
// session of a launcher call, the runtime API, launches).  The kernels see include/cuda_runtime.h.
#ifndef AB_EMU_INTERNAL_H
#define AB_EMU_INTERNAL_H

#include <setjmp.h>
#include <signal.h>
#include <stdint.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_runtime.h"
#include "emu_runtime.h"

#if defined(__x86_64__) && !defined(AB_EMU_UCONTEXT)
#define AB_EMU_X86_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace ab_emu {
namespace detail {

constexpr int kWarpSize = 32;
constexpr size_t kPage = 4096;
constexpr size_t kStackBytes = 128 * 1024;   // per emulated thread
constexpr size_t kMaxSmem = 232448;          // sm_90's opt-in limit, the largest emulated
constexpr size_t kDefaultSmem = 48 * 1024;   // without cudaFuncSetAttribute
constexpr unsigned char kCanary = 0xa5;

inline size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

enum class St : uint8_t { kReady, kCollective, kBarrier, kDone };
enum class Op : uint8_t { kShfl, kAny, kLdmatrix, kMma, kMmaS8 };

struct Copy {  // one queued cp.async
  uint32_t dst;
  const void* src;
  int bytes;
  bool valid;
};

struct Fiber {
  void* sp = nullptr;
  uint3 tid = {0, 0, 0};
  int lin = 0;
  St st = St::kDone;
  // the collective this fiber is parked at: its operands, and where the result goes
  Op op = Op::kShfl;
  unsigned mask = 0;
  uint64_t val = 0;
  int size = 0, lane_mask = 0, width = 0, pred = 0;
  uint32_t addr = 0;
  bool trans = false, bf16 = false;
  uint32_t* rout = nullptr;
  float* cf = nullptr;
  int* ci = nullptr;
  const uint32_t* a = nullptr;
  uint32_t b0 = 0, b1 = 0;
  // cp.async: queued copies; groups[i].end = copies committed up to and including group i
  std::vector<Copy> copies;
  struct Group {
    size_t end;
    bool early;
  };
  std::vector<Group> groups;
  unsigned char* stack = nullptr;  // kStackBytes above a guard page
#ifndef AB_EMU_X86_SWITCH
  ucontext_t uc;
#endif
};

struct Grid;

// What one OS thread needs to run blocks: fibers and their stacks, the shared-memory window, the
// alternate signal stack and the jump back out of a faulting block.
struct Worker {
  std::vector<Fiber> fibers;
  unsigned char* smem_map = nullptr;  // guard page, kMaxSmem rounded to pages, guard page
  size_t smem_map_len = 0;
  unsigned char* smem_end = nullptr;  // the trailing guard page
  unsigned char* smem_open = nullptr; // pages from here to smem_end are accessible
  unsigned char* smem = nullptr;      // the running block's dynamic shared memory
  size_t smem_size = 0;
  void* sched_sp = nullptr;
#ifndef AB_EMU_X86_SWITCH
  ucontext_t sched_uc;
#endif
  std::vector<unsigned char> altstack;
  sigjmp_buf jmp;
  volatile sig_atomic_t in_block = 0;
  Grid* L = nullptr;
  bool failed = false;
  uint64_t rng = 0;
  std::vector<int> runnable;
  std::vector<uint8_t> warp_state;  // 0 runnable, 1 at the barrier, 2 done
};

extern thread_local Worker* tls_worker;  // the OS thread's
extern thread_local Fiber* tls_fiber;    // the running emulated thread, NULL in the scheduler

Worker& worker();

// ---- the session: device memory, errors, the emulated device -------------------------------------

struct Buffer {
  std::string name;
  unsigned char* data;
  size_t bytes, elsize;
  unsigned char* map;
  size_t map_len;
  unsigned char *lead, *tail;  // canary ranges before the start and after the end
  size_t lead_len, tail_len;
};

struct KernelAttr {
  int max_dynamic_smem = 0;
};

struct Session {
  std::mutex call;  // held from session_begin to session_end
  std::mutex mu;    // guards failure and the launch log (blocks run on several threads)
  std::vector<Buffer> buffers;
  const ab_cpu_pool* pool = nullptr;
  cudaError_t last_error = cudaSuccess;
  bool sticky = false;  // a kernel fault: every later launch and query fails, as on a device
  std::string failure;
  std::map<const void*, KernelAttr> attrs;
  std::map<std::string, long> log;     // launches per kernel label
  std::map<std::string, long> blocks;  // blocks launched per kernel label
  int cc = 0;
  uint64_t seed = 0x5eed;
  uint64_t serial = 0;
};

Session& session();
size_t optin_smem(int cc);
void record_failure(const std::string& msg);
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// Whether [p, p + n) lies inside one buffer of the call: the fast path of the explicit checks.
bool in_buffer(const void* p, size_t n);
// Where a host address falls: inside a buffer, or before or past one.
std::string describe_global(const void* p, size_t n);

// ---- the running launch ----------------------------------------------------------------------------

struct Grid {
  KernelBody body;
  std::string label;
  dim3 grid, block;
  size_t smem;
  int nthreads;
  uint64_t serial;
  std::atomic<bool> failed{false};
};

// "fwd_launch_config<T = __half, int kD = 64, ...>: kernel", from the launcher and the kernel expression
std::string kernel_label(const char* name, const char* where);
// Runs blocks [b0, b1) of the launch on this thread (for the pool: run_blocks_range).
void run_blocks(Grid* L, int64_t b0, int64_t b1);
void run_blocks_range(int64_t begin, int64_t end, void* ctx);
void install_fault_handlers();

}  // namespace detail
}  // namespace ab_emu

#endif  // AB_EMU_INTERNAL_H
