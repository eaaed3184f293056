/* decode_tune.h -- the CPU decode kernel's prefetch requests chosen by timing (decode_tune.c).
 *
 * The kernel's prefetch switches (decode_cpu.c: keys_next, values_ahead, pages_ahead), the order of
 * one-token MHA's step 3 (pv_keys) and of step 1 with bfloat16 products (scores_by_head) change how fast a
 * call reads its cache from DRAM, never its bits.
 * Which set is fastest depends on the CPU and, on a shared machine, on the memory system's state of the
 * moment: on one AMD Zen 5 guest dense bfloat16 GQA decode ran 10-20% faster without the next-keys and
 * pages-ahead requests while the memory answered fast, and float32 GQA about 7% faster with the next keys
 * while it answered slowly (docs/benchmarks.md, "Prefetch requests chosen by timing").  So for calls whose
 * caches come from DRAM the kernel times the sets against each other, a few calls each, keeps the fastest
 * for the next calls of the same kind, then times them again.
 *
 * Owner: the CPU decode kernel (decode_cpu.c is the only caller).  Thread-safe. */
#ifndef AB_DECODE_TUNE_H
#define AB_DECODE_TUNE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The switches a set holds (bits of a uint32_t): the three prefetch requests, step 3 key by key in
 * one-token MHA (decode_cpu.c pv_keys) and step 1 head by head with bfloat16 products (scores_by_head), which
 * change the order the rows are read in, not the bits. */
enum {
  AB_TUNE_KEYS_NEXT = 1,
  AB_TUNE_VALUES_AHEAD = 2,
  AB_TUNE_PAGES_AHEAD = 4,
  AB_TUNE_PV_KEYS = 8,
  AB_TUNE_SCORES_BY_HEAD = 16,
  AB_TUNE_ALL = 31
};
enum { AB_TUNE_MAX_ARMS = 16 };
/* Calls of each set per round of timing, rounds per timing, calls between timings, and the margin a set
 * must beat the rule's own by (the median of its per-round ratios below 1 - margin). */
enum { AB_TUNE_ROUNDS = 4, AB_TUNE_KEEP_CALLS = 512 };
#define AB_TUNE_MARGIN 0.04

/* Calls of one kind share their timings: the same ISA path, cache dtype, products, block size (0: dense), the same
 * query heads per KV head, one query token or several. */
typedef struct ab_decode_tune_kind {
  int32_t isa, dtype, bf16_dot, block_size, group, one_token; /* bf16_dot 2: on tiles, 3: tiles of many rows; block_size 0: dense; group:
                                                                 query heads per KV head */
} ab_decode_tune_kind;

/* What a call was given, handed back with its time. */
typedef struct ab_decode_tune_ticket {
  int32_t slot;       /* -1: not timed */
  int32_t arm, round; /* round -1: a call of the kept set */
  uint64_t generation;
} ab_decode_tune_ticket;

/* The set of switches a call of `kind` runs with: `rule` is the kernel's own set, `free` the switches
 * that may differ from it (the others stay the rule's).  Arm a flips the free switches of a's bits
 * (arm 0 is the rule's set).  While a kind is being timed its calls go through every arm in turn,
 * AB_TUNE_ROUNDS times; then its calls take the chosen arm for AB_TUNE_KEEP_CALLS calls.  *t is
 * filled for ab_decode_tune_end. */
uint32_t ab_decode_tune_begin(const ab_decode_tune_kind* kind, uint32_t rule, uint32_t free, ab_decode_tune_ticket* t);
/* A call's time per byte of K and V it read. */
void ab_decode_tune_end(const ab_decode_tune_ticket* t, double seconds_per_byte);

/* The arm to keep from `rounds` rounds of `arms` arms' times (times[r * arms + a], > 0): the arm whose
 * median over the rounds of (its time / arm 0's time in the same round) is the lowest, if that median
 * is below 1 - margin; else 0.  Arms with a missing time (<= 0) in a round skip that round. */
int ab_decode_tune_choose(int arms, int rounds, const double* times, double margin);

/* Each kind's state, for tests and reports: fills up to `most` entries and returns how many kinds have
 * one.  chosen: the arm kept (-1 before the first timing ends), kept: its set (the rule's before then);
 * timings: timings finished. */
typedef struct ab_decode_tune_report {
  ab_decode_tune_kind kind;
  uint32_t rule, free, kept;
  int32_t arms, chosen, timing; /* timing: 1 while the arms are being timed */
  int64_t calls, timings, arm_calls[AB_TUNE_MAX_ARMS];
} ab_decode_tune_report;
int ab_decode_tune_state(ab_decode_tune_report* out, int most);
/* Forgets every kind (tests). */
void ab_decode_tune_reset(void);

#ifdef __cplusplus
}
#endif

#endif /* AB_DECODE_TUNE_H */
