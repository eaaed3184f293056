// emu_block.cpp -- the CUDA emulator's threads of a block (emu_device.cpp is the device): the
// emulator runs the unchanged kernels of csrc/cuda on the host.
//
// A launch runs its grid block by block (spread over the caller's thread pool when it has one).
// Each thread of a block is a fiber with its own stack; it runs until it reaches a warp collective
// (shuffle, vote, ldmatrix, mma), a __syncthreads or its end, and parks.  When every lane of a warp
// is parked at a collective, the collective is performed on all 32 lanes' operands at once, with
// the PTX ISA's fragment layouts (flash_common.cuh); when every thread is at the barrier, it opens.
// Between barriers the warps run in a seeded random order, interleaved at each collective, and the
// lanes of a warp in a random direction, so that a missing __syncthreads shows up as a wrong result.
//
// cp.async copies are queued per thread; each committed group lands either at the thread's next
// stop or only when cp.async.wait_group retires it (drawn at the commit), so both a copy issued too
// early and a read before the wait show up.  The block's dynamic shared memory ends flush against a
// guard page (device memory likewise, emu_device.cpp); explicit checks cover cp.async, ldmatrix and
// atomics exactly, and a fault (a guard page; the trap of a misaligned typed access) is caught by a
// handler on an alternate stack, named (kernel, block, thread, buffer, offset) and unwound out of
// the block, failing the call.  docs/cuda.md says what this proves and what it cannot.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

#include "emu_internal.h"

thread_local unsigned char (*ab_emu_dyn_smem)[] = nullptr;

namespace ab_emu {

thread_local const uint3* tls_thread_idx = nullptr;
thread_local uint3 tls_block_idx = {0, 0, 0};
thread_local dim3 tls_block_dim, tls_grid_dim;

namespace detail {

// ---- fibers -------------------------------------------------------------------------------------

#ifdef AB_EMU_X86_SWITCH
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save and
// resumes the fiber whose stack pointer is `to`: a function call's cost, no system call.
extern "C" void ab_emu_switch(void** save, void* to);
extern "C" void ab_emu_fiber_start();
asm(R"(
  .text
  .p2align 4
  .type ab_emu_switch,@function
ab_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ab_emu_switch, .-ab_emu_switch
  .p2align 4
  .type ab_emu_fiber_start,@function
ab_emu_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size ab_emu_fiber_start, .-ab_emu_fiber_start
)");
#endif

const char* op_name(Op op) {
  switch (op) {
    case Op::kShfl: return "__shfl_xor_sync";
    case Op::kAny: return "__any_sync";
    case Op::kLdmatrix: return "ldmatrix";
    case Op::kMma: return "mma.sync m16n8k16";
    default: return "mma.sync m16n8k32 s8";
  }
}

thread_local Worker* tls_worker = nullptr;
thread_local Fiber* tls_fiber = nullptr;

Worker& worker() {
  if (tls_worker == nullptr) tls_worker = new Worker();  // kept for the life of the thread
  return *tls_worker;
}

[[noreturn]] void abandon_block();

// From a fiber back to the scheduler (the fiber resumes here when the scheduler switches back).
void to_scheduler(Worker& w, Fiber* f) {
#ifdef AB_EMU_X86_SWITCH
  ab_emu_switch(&f->sp, w.sched_sp);
#else
  swapcontext(&f->uc, &w.sched_uc);
#endif
}

// The fiber ends (returned, or its block is abandoned): it is never resumed.
[[noreturn]] void end_fiber(Worker& w, Fiber* f) {
  f->st = St::kDone;
  to_scheduler(w, f);
  abort();
}

// Fails the call from inside a block: names the kernel, the block and (in a fiber) the thread.
void fail_in_block(const Fiber* f, const std::string& what) {
  Worker& w = worker();
  std::string who = format("block %u", tls_block_idx.x);
  if (f != nullptr) who += format(", thread %u (warp %d, lane %d)", f->tid.x, f->lin / kWarpSize, f->lin % kWarpSize);
  record_failure("emulated CUDA kernel " + (w.L ? w.L->label : std::string("?")) + ", " + who + ": " + what);
  w.failed = true;
}

[[noreturn]] void fail_here(const std::string& what) {
  fail_in_block(tls_fiber, what);
  abandon_block();
}

// Back to the scheduler for good: the block is abandoned (its fibers are re-made for the next one).
void abandon_block() {
  Worker& w = worker();
  Fiber* f = tls_fiber;
  if (f == nullptr) siglongjmp(w.jmp, 1);  // scheduler context
  end_fiber(w, f);
}

void retire_groups(Worker& w, Fiber* f, size_t k);

void park(St st) {
  Fiber* f = tls_fiber;
  if (f == nullptr) {
    fputs("attn_backends CUDA emulator: a device function was called outside a kernel\n", stderr);
    abort();
  }
  Worker& w = *tls_worker;
  // A committed group may land any time before its wait retires it.  Each is drawn at its commit
  // to land early (here, at the thread's first stop after it, so that a copy issued while other
  // warps still read the buffer clobbers what they read: a missing __syncthreads before the issue)
  // or late (at the wait, so that a read before the wait sees stale memory).  Groups land in order.
  while (!f->groups.empty() && f->groups.front().early) retire_groups(w, f, 1);
  f->st = st;
  to_scheduler(w, f);
}

void resume(Worker& w, Fiber* f) {
  tls_fiber = f;
  tls_thread_idx = &f->tid;
#ifdef AB_EMU_X86_SWITCH
  ab_emu_switch(&w.sched_sp, f->sp);
#else
  swapcontext(&w.sched_uc, &f->uc);
#endif
  tls_fiber = nullptr;
}

void perform_copies(Worker& w, Fiber* f, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const Copy& c = f->copies[i];
    if (c.valid)
      memcpy(w.smem + c.dst, c.src, (size_t)c.bytes);
    else
      memset(w.smem + c.dst, 0, (size_t)c.bytes);
  }
  f->copies.erase(f->copies.begin(), f->copies.begin() + (ptrdiff_t)n);
}

// The oldest k committed groups land.
void retire_groups(Worker& w, Fiber* f, size_t k) {
  const size_t upto = f->groups[k - 1].end;
  perform_copies(w, f, upto);
  f->groups.erase(f->groups.begin(), f->groups.begin() + (ptrdiff_t)k);
  for (Fiber::Group& g : f->groups) g.end -= upto;
}

void fiber_main(void* arg) {
  Fiber* f = static_cast<Fiber*>(arg);
  Worker& w = *tls_worker;
  w.L->body.run(w.L->body.ctx);
  // the thread is done; copies it never waited for still land in shared memory
  perform_copies(w, f, f->copies.size());
  f->groups.clear();
  end_fiber(w, f);
}

#ifndef AB_EMU_X86_SWITCH
void fiber_main_uc(unsigned lo, unsigned hi) {
  fiber_main(reinterpret_cast<void*>(((uintptr_t)hi << 32) | (uintptr_t)lo));
}
#endif

unsigned char* map_guarded(size_t bytes) {  // bytes (page multiple) above one guard page
  void* m = mmap(nullptr, bytes + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  mprotect(m, kPage, PROT_NONE);
  return static_cast<unsigned char*>(m) + kPage;
}

void start_fiber(Worker& w, Fiber& f) {
  if (f.stack == nullptr) {
    f.stack = map_guarded(kStackBytes);
    if (f.stack == nullptr) {
      fputs("attn_backends CUDA emulator: out of memory for thread stacks\n", stderr);
      abort();
    }
  }
#ifdef AB_EMU_X86_SWITCH
  uintptr_t top = ((uintptr_t)(f.stack + kStackBytes) & ~(uintptr_t)15) - 16;
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = reinterpret_cast<uint64_t>(&ab_emu_fiber_start);  // ret of ab_emu_switch
  *--sp = 0;                                                // rbp
  *--sp = 0;                                                // rbx
  *--sp = reinterpret_cast<uint64_t>(&f);                   // r12: the argument
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);          // r13: the function
  *--sp = 0;                                                // r14
  *--sp = 0;                                                // r15
  f.sp = sp;
#else
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack;
  f.uc.uc_stack.ss_size = kStackBytes;
  f.uc.uc_link = nullptr;
  const uintptr_t a = reinterpret_cast<uintptr_t>(&f);
  makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiber_main_uc), 2, (unsigned)(a & 0xffffffffu),
              (unsigned)(a >> 32));
#endif
  (void)w;
  f.st = St::kReady;
  f.copies.clear();
  f.groups.clear();
}

uint64_t next_random(uint64_t& s) {  // splitmix64
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// ---- the collectives, on all lanes of a warp -------------------------------------------------------

// mma.sync m16n8kK on the 32 lanes' fragments: A 16 x K (row), B K x 8 (col), C/D 16 x 8.  A 32-bit
// register holds kPer = K / 8 consecutive k elements (two 16-bit or four 8-bit, the lowest k in the
// low bits): a[r] = A[g + 8 (r & 1)][kPer t .. + (r >> 1) K / 2], b[r] = B[kPer t .. + r K / 2][g];
// C/D: c[e] = C[g + 8 (e >> 1)][2 t + (e & 1)] (flash_common.cuh, sage_fwd_kernel.cuh).
// K = 16: float16/bfloat16 in, fp32 out, the 16 exact products summed in double and rounded once.
// K = 32: int8 in, s32 out, wrapping.
template <int K, typename Conv> void mma_warp(Fiber* lanes, Conv conv) {
  using E = decltype(conv(0u));
  constexpr int kPer = K / 8, kBits = 32 / kPer;
  E A[16][K], B[K][8];
  for (int l = 0; l < kWarpSize; ++l) {
    const int g = l >> 2, t = l & 3;
    const uint32_t b[2] = {lanes[l].b0, lanes[l].b1};
    for (int e = 0; e < kPer; ++e) {
      for (int r = 0; r < 4; ++r)
        A[g + 8 * (r & 1)][kPer * t + e + (r >> 1) * K / 2] = conv(lanes[l].a[r] >> (kBits * e));
      for (int r = 0; r < 2; ++r) B[kPer * t + e + r * K / 2][g] = conv(b[r] >> (kBits * e));
    }
  }
  for (int l = 0; l < kWarpSize; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
      if constexpr (K == 16) {
        double acc = lanes[l].cf[e];
        for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];
        lanes[l].cf[e] = (float)acc;
      } else {
        uint32_t acc = (uint32_t)lanes[l].ci[e];
        for (int k = 0; k < K; ++k) acc += (uint32_t)(A[row][k] * B[k][col]);
        lanes[l].ci[e] = (int)acc;
      }
    }
  }
}

bool check_smem(const Fiber& f, uint32_t addr, uint32_t n, uint32_t align, const char* what) {
  Worker& w = *tls_worker;
  if (addr % align == 0 && (size_t)addr + n <= w.smem_size) return true;
  fail_in_block(&f, format("%s reads %u bytes at shared-memory offset %u: %s (the block has %zu bytes)", what, n,
                           addr, addr % align ? "misaligned" : "out of range", w.smem_size));
  return false;
}

bool run_collective(Worker& w, Fiber* lanes, int n) {
  const Op op = lanes[0].op;
  for (int l = 1; l < n; ++l)
    if (lanes[l].op != op) {
      fail_in_block(&lanes[l], format("lanes of one warp reached different collectives (%s and %s)",
                                      op_name(op), op_name(lanes[l].op)));
      return false;
    }
  if (n != kWarpSize) {
    fail_in_block(&lanes[0], format("%s with a partial warp of %d threads", op_name(op), n));
    return false;
  }
  switch (op) {
    case Op::kShfl: {
      uint64_t v[kWarpSize];
      for (int l = 0; l < kWarpSize; ++l) {
        if (lanes[l].mask != 0xffffffffu || lanes[l].width != kWarpSize || lanes[l].lane_mask < 0 ||
            lanes[l].lane_mask >= kWarpSize || lanes[l].size != lanes[0].size) {
          fail_in_block(&lanes[l], "__shfl_xor_sync: the emulator takes full-warp masks, width 32, one type");
          return false;
        }
        v[l] = lanes[l].val;
      }
      for (int l = 0; l < kWarpSize; ++l) lanes[l].val = v[l ^ lanes[l].lane_mask];
      break;
    }
    case Op::kAny: {
      int any = 0;
      for (int l = 0; l < kWarpSize; ++l) {
        if (lanes[l].mask != 0xffffffffu) {
          fail_in_block(&lanes[l], "__any_sync: the emulator takes full-warp masks");
          return false;
        }
        any |= lanes[l].pred != 0;
      }
      for (int l = 0; l < kWarpSize; ++l) lanes[l].pred = any;
      break;
    }
    case Op::kLdmatrix: {
      // lanes 8i .. 8i+7 address rows 0..7 of matrix i (16 bytes each); lane 4g + t receives
      // plain: M_i[g][2t, 2t+1];  .trans: M_i[2t][g], M_i[2t+1][g]
      for (int l = 0; l < kWarpSize; ++l) {
        if (lanes[l].trans != lanes[0].trans) {
          fail_in_block(&lanes[l], "ldmatrix: lanes disagree on .trans");
          return false;
        }
        if (!check_smem(lanes[l], lanes[l].addr, 16, 16, "ldmatrix")) return false;
      }
      const unsigned char* s = w.smem;
      for (int l = 0; l < kWarpSize; ++l) {
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; ++i) {
          uint32_t r;
          if (!lanes[0].trans) {
            memcpy(&r, s + lanes[8 * i + g].addr + 4 * t, 4);
          } else {
            uint16_t lo, hi;
            memcpy(&lo, s + lanes[8 * i + 2 * t].addr + 2 * g, 2);
            memcpy(&hi, s + lanes[8 * i + 2 * t + 1].addr + 2 * g, 2);
            r = (uint32_t)lo | (uint32_t)hi << 16;
          }
          lanes[l].rout[i] = r;
        }
      }
      break;
    }
    case Op::kMma:
      if (lanes[0].bf16)
        mma_warp<16>(lanes, [](uint32_t x) { return (double)ab_bf16_to_f32((uint16_t)x); });
      else
        mma_warp<16>(lanes, [](uint32_t x) { return (double)ab_f16_to_f32((uint16_t)x); });
      break;
    case Op::kMmaS8:
      mma_warp<32>(lanes, [](uint32_t x) { return (int32_t)(int8_t)x; });
      break;
  }
  for (int l = 0; l < kWarpSize; ++l) lanes[l].st = St::kReady;
  return true;
}

// Runs the ready lanes of warp wi until each parks; performs the collective they meet.
// Returns false when the block failed.
bool run_warp(Worker& w, int wi, int nthreads) {
  Fiber* lanes = w.fibers.data() + wi * kWarpSize;
  const int n = std::min(kWarpSize, nthreads - wi * kWarpSize);
  const bool reverse = next_random(w.rng) & 1;
  for (int k = 0; k < n; ++k) {
    Fiber* f = &lanes[reverse ? n - 1 - k : k];
    if (f->st != St::kReady) continue;
    resume(w, f);
    if (w.failed) return false;
  }
  int at_op = 0, at_bar = 0, done = 0;
  for (int l = 0; l < n; ++l) {
    at_op += lanes[l].st == St::kCollective;
    at_bar += lanes[l].st == St::kBarrier;
    done += lanes[l].st == St::kDone;
  }
  if (at_op > 0) {
    if (at_op != n) {
      for (int l = 0; l < n; ++l)
        if (lanes[l].st == St::kCollective) {
          fail_in_block(&lanes[l], format("%s reached by %d of the warp's %d lanes (the others %s)",
                                          op_name(lanes[l].op), at_op, n,
                                          at_bar ? "wait at __syncthreads" : "have returned"));
          break;
        }
      return false;
    }
    if (!run_collective(w, lanes, n)) return false;
    w.warp_state[wi] = 0;
  } else {
    w.warp_state[wi] = at_bar > 0 ? 1 : 2;
    if (at_bar > 0 && done > 0) {
      fail_in_block(&lanes[0], "__syncthreads reached by part of a warp while its other lanes returned");
      return false;
    }
  }
  return true;
}

void set_smem_window(Worker& w, size_t bytes) {
  if (w.smem_map == nullptr) {
    w.smem_map_len = round_up(kMaxSmem, kPage) + 2 * kPage;
    void* m = mmap(nullptr, w.smem_map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
      fputs("attn_backends CUDA emulator: out of memory for shared memory\n", stderr);
      abort();
    }
    w.smem_map = static_cast<unsigned char*>(m);
    w.smem_end = w.smem_map + w.smem_map_len - kPage;
    w.smem_open = w.smem_end;
  }
  // the buffer ends flush against the trailing guard page; the pages below its first are closed
  unsigned char* base = w.smem_end - round_up(bytes, 16);
  unsigned char* open = reinterpret_cast<unsigned char*>((uintptr_t)base & ~(uintptr_t)(kPage - 1));
  if (open != w.smem_open) {
    if (open < w.smem_open)
      mprotect(open, (size_t)(w.smem_open - open), PROT_READ | PROT_WRITE);
    else
      mprotect(w.smem_open, (size_t)(open - w.smem_open), PROT_NONE);
    w.smem_open = open;
  }
  w.smem = base;
  w.smem_size = bytes;
}

void run_block(Worker& w, Grid& L, unsigned bid) {
  tls_block_idx = uint3{bid % L.grid.x, (bid / L.grid.x) % L.grid.y, bid / (L.grid.x * L.grid.y)};
  tls_block_dim = L.block;
  tls_grid_dim = L.grid;
  // shared memory starts as garbage on a device: 0xff bytes (NaN) here; canaries around it
  memset(w.smem_open, kCanary, (size_t)(w.smem - w.smem_open));
  memset(w.smem, 0xff, L.smem);
  memset(w.smem + L.smem, kCanary, (size_t)(w.smem_end - w.smem - L.smem));
  ab_emu_dyn_smem = reinterpret_cast<unsigned char(*)[]>(w.smem);

  const int n = L.nthreads, nw = (n + kWarpSize - 1) / kWarpSize;
  if ((int)w.fibers.size() < nw * kWarpSize) w.fibers.resize((size_t)nw * kWarpSize);
  for (int i = 0; i < n; ++i) {
    Fiber& f = w.fibers[(size_t)i];
    f.lin = i;
    f.tid = uint3{i % L.block.x, (i / L.block.x) % L.block.y, i / (L.block.x * L.block.y)};
    start_fiber(w, f);
  }
  w.rng = session().seed ^ (L.serial * 0x100000001b3ull) ^ ((uint64_t)bid << 32);
  w.warp_state.assign((size_t)nw, 0);
  for (;;) {
    w.runnable.clear();
    for (int i = 0; i < nw; ++i)
      if (w.warp_state[(size_t)i] == 0) w.runnable.push_back(i);
    if (!w.runnable.empty()) {
      const int wi = w.runnable[next_random(w.rng) % w.runnable.size()];
      if (!run_warp(w, wi, n)) return;
      continue;
    }
    int at_bar = 0, done = 0;
    for (int i = 0; i < nw; ++i) (w.warp_state[(size_t)i] == 1 ? at_bar : done)++;
    if (at_bar == 0) break;  // every thread has returned
    if (done > 0) {
      fail_in_block(nullptr, format("__syncthreads reached by %d warps while %d others returned", at_bar, done));
      return;
    }
    for (int i = 0; i < n; ++i) w.fibers[(size_t)i].st = St::kReady;  // the barrier opens
    std::fill(w.warp_state.begin(), w.warp_state.end(), (uint8_t)0);
  }
  // a write just outside the shared memory (within the slack the alignment leaves) hits a canary
  for (unsigned char* p = w.smem_open; p < w.smem; ++p)
    if (*p != kCanary) {
      fail_in_block(nullptr, format("a write %lld bytes before the start of shared memory", (long long)(w.smem - p)));
      return;
    }
  for (unsigned char* p = w.smem + L.smem; p < w.smem_end; ++p)
    if (*p != kCanary) {
      fail_in_block(nullptr, format("a write at shared-memory offset %lld, past its %zu bytes",
                                    (long long)(p - w.smem), L.smem));
      return;
    }
}

// ---- faults -----------------------------------------------------------------------------------------

// SIGSEGV/SIGBUS: a guard page; SIGILL: the trap g++'s -fsanitize=alignment puts on a misaligned
// typed access in the kernels (setup.py), which a GPU refuses as a misaligned address
constexpr int kFaultSignals[] = {SIGSEGV, SIGBUS, SIGILL};
struct sigaction g_old_action[3];

struct sigaction* old_action(int sig) {
  for (int i = 0; i < 3; ++i)
    if (kFaultSignals[i] == sig) return &g_old_action[i];
  return nullptr;
}
std::mutex g_handler_mu;

std::string describe_fault(Worker& w, const void* addr) {
  const unsigned char* a = static_cast<const unsigned char*>(addr);
  if (w.smem_map && a >= w.smem_map && a < w.smem_map + w.smem_map_len)
    return format("shared memory access at offset %lld (the block has %zu bytes)", (long long)(a - w.smem),
                  w.smem_size);
  for (const Fiber& f : w.fibers)
    if (f.stack && a >= f.stack - kPage && a < f.stack) return "stack overflow of an emulated thread";
  return "out-of-range access at " + describe_global(addr, 1);
}

void on_fault(int sig, siginfo_t* si, void* uc) {
  Worker* w = tls_worker;
  if (w == nullptr || !w->in_block) {  // not ours: the previous handler (or the default) takes it
    sigaction(sig, old_action(sig), nullptr);
    (void)uc;
    return;
  }
  fail_in_block(tls_fiber, sig == SIGILL ? "misaligned access: a load or store of a type whose alignment its "
                                           "address does not have (a GPU faults: misaligned address)"
                                         : describe_fault(*w, si->si_addr));
  siglongjmp(w->jmp, 1);
}

void install_fault_handlers() {
  std::lock_guard<std::mutex> lock(g_handler_mu);
  for (int sig : kFaultSignals) {
    struct sigaction cur;
    sigaction(sig, nullptr, &cur);
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == &on_fault) continue;
    struct sigaction act;
    memset(&act, 0, sizeof act);
    act.sa_sigaction = &on_fault;
    act.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&act.sa_mask);
    sigaction(sig, &act, old_action(sig));
  }
}

// Runs blocks [b0, b1) of the launch on this thread.
void run_blocks(Grid* L, int64_t b0, int64_t b1) {
  Worker& w = worker();
  if (w.altstack.empty()) w.altstack.resize(64 * 1024);
  stack_t alt, old;
  alt.ss_sp = w.altstack.data();
  alt.ss_size = w.altstack.size();
  alt.ss_flags = 0;
  sigaltstack(&alt, &old);
  w.L = L;
  set_smem_window(w, L->smem);
  for (volatile int64_t b = b0; b < b1 && !L->failed.load(std::memory_order_relaxed); b = b + 1) {
    w.failed = false;
    if (sigsetjmp(w.jmp, 1) == 0) {
      w.in_block = 1;
      run_block(w, *L, (unsigned)b);
    }
    w.in_block = 0;
    tls_fiber = nullptr;
    if (w.failed) {
      L->failed = true;
      break;
    }
  }
  w.L = nullptr;
  sigaltstack(&old, nullptr);
}

void run_blocks_range(int64_t begin, int64_t end, void* ctx) { run_blocks(static_cast<Grid*>(ctx), begin, end); }

}  // namespace detail

using namespace detail;

// ---- device-side entry points (called from inside a fiber) -------------------------------------------

uint64_t shfl_xor(unsigned mask, uint64_t bits, int size, int lane_mask, int width) {
  Fiber* f = tls_fiber;
  f->op = Op::kShfl;
  f->mask = mask;
  f->val = bits;
  f->size = size;
  f->lane_mask = lane_mask;
  f->width = width;
  park(St::kCollective);
  return f->val;
}

int any_sync(unsigned mask, int pred) {
  Fiber* f = tls_fiber;
  f->op = Op::kAny;
  f->mask = mask;
  f->pred = pred;
  park(St::kCollective);
  return f->pred;
}

void syncthreads() { park(St::kBarrier); }

float atomic_add(float* p, float v) {
  if (!in_buffer(p, 4) || (uintptr_t)p % 4) fail_here("atomicAdd on " + describe_global(p, 4));
  uint32_t* u = reinterpret_cast<uint32_t*>(p);
  uint32_t old = __atomic_load_n(u, __ATOMIC_RELAXED);
  for (;;) {
    float f;
    memcpy(&f, &old, 4);
    const float nf = f + v;
    uint32_t nu;
    memcpy(&nu, &nf, 4);
    if (__atomic_compare_exchange_n(u, &old, nu, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return f;
  }
}

uint32_t cvta_shared(const void* p) {
  Worker& w = worker();
  const unsigned char* a = static_cast<const unsigned char*>(p);
  if (a < w.smem || a > w.smem + w.smem_size)
    fail_here(format("__cvta_generic_to_shared of %p, outside the block's %zu bytes of shared memory", p, w.smem_size));
  return (uint32_t)(a - w.smem);
}

void ldmatrix_x4(uint32_t r[4], uint32_t addr, bool trans) {
  Fiber* f = tls_fiber;
  f->op = Op::kLdmatrix;
  f->addr = addr;
  f->trans = trans;
  f->rout = r;
  park(St::kCollective);
}

void cp_async(uint32_t dst, const void* src, int bytes, bool valid) {
  Fiber* f = tls_fiber;
  Worker& w = *tls_worker;
  if (dst % (uint32_t)bytes || (size_t)dst + (size_t)bytes > w.smem_size)
    fail_here(format("cp.async of %d bytes to shared-memory offset %u: %s (the block has %zu bytes)", bytes, dst,
                     dst % (uint32_t)bytes ? "misaligned" : "out of range", w.smem_size));
  if (valid && (!in_buffer(src, (size_t)bytes) || (uintptr_t)src % (uintptr_t)bytes))
    fail_here("cp.async reads " + describe_global(src, (size_t)bytes) +
              ((uintptr_t)src % (uintptr_t)bytes ? " (misaligned)" : ""));
  f->copies.push_back(Copy{dst, src, bytes, valid});
}

void cp_async_commit() {
  Fiber* f = tls_fiber;
  f->groups.push_back(Fiber::Group{f->copies.size(), (next_random(tls_worker->rng) & 1) != 0});
}

void cp_async_wait(int n) {
  Fiber* f = tls_fiber;
  if ((int)f->groups.size() > n) retire_groups(*tls_worker, f, f->groups.size() - (size_t)n);
}

namespace {
void park_at_mma(Op op, float* cf, int* ci, const uint32_t* a, uint32_t b0, uint32_t b1, bool bf16) {
  Fiber* f = tls_fiber;
  f->op = op;
  f->cf = cf;
  f->ci = ci;
  f->a = a;
  f->b0 = b0;
  f->b1 = b1;
  f->bf16 = bf16;
  park(St::kCollective);
}
}  // namespace

void mma_m16n8k16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, bool bf16) {
  park_at_mma(Op::kMma, c, nullptr, a, b0, b1, bf16);
}

void mma_m16n8k32_s8(int c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  park_at_mma(Op::kMmaS8, nullptr, c, a, b0, b1, false);
}

float ex2_approx(float x) { return exp2f(x); }
float rcp_approx(float x) { return 1.0f / x; }

}  // namespace ab_emu
