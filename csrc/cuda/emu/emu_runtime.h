// emu_runtime.h -- the emulator's side for the launcher wrappers (emu_api.cpp): device memory, the
// session of one launcher call, the emulated device.  The kernels see include/cuda_runtime.h only.
#ifndef AB_EMU_RUNTIME_H
#define AB_EMU_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include <string>

#include "../../ab_core.h"

namespace ab_emu {

// One launcher call at a time: begin waits for the previous call's end, clears the error state and
// takes the pool the blocks may be spread over (NULL: the calling thread runs them all).
void session_begin(const ab_cpu_pool* pool);
// The first failure of the call (a launch's out-of-range access, a bad launch, a broken guard
// canary), "" if none.  Reading it checks the canaries of every buffer still allocated.
std::string session_failure();
// Frees the call's device memory and lets the next call begin.
void session_end();

// Device memory for one tensor or workspace: `bytes` bytes ending flush against a guard page
// (an access past the end faults and fails the call with the kernel, thread and offset), with the
// start at an address congruent to `align_rem` modulo `align_mod` (a power of two <= 4096), so that
// alignment checks see what they would on the caller's memory; the few bytes between the start of
// its page and the start (and after the end, when the alignment leaves any) hold a canary that
// session_failure checks.  poison: filled with 0xff bytes (NaN in every float type) instead of zeros,
// for outputs and workspaces a kernel must write before it reads.  NULL for bytes == 0.
unsigned char* device_alloc(const char* name, size_t bytes, size_t align_mod, size_t align_rem, bool poison,
                            size_t elsize = 1);

// The emulated device's compute capability (80 by default, ATTN_BACKENDS_CUDA_EMULATE_SM or
// set_device_cc): it sets the opt-in shared-memory limit the launchers check.
int device_cc();
void set_device_cc(int cc);
void set_seed(uint64_t seed);

// Every kernel variant launched since the last reset: "name\tcount\n" lines, sorted.
std::string launch_log();
// "label\tblocks" lines: the blocks of every launch of each kernel since the last reset_launch_log()
std::string launch_blocks();
void reset_launch_log();

}  // namespace ab_emu

#endif  // AB_EMU_RUNTIME_H
