/* decode_tune.c -- the CPU decode kernel's prefetch requests chosen by timing (decode_tune.h).
 *
 * Each kind of call (decode_tune.h) has a slot: while it is being timed, its calls take the arms in turn
 * (arm = call % arms, AB_TUNE_ROUNDS rounds), each call's time per byte stored by round and arm; when
 * every one of them has ended, ab_decode_tune_choose picks the arm to keep, and the next
 * AB_TUNE_KEEP_CALLS calls take it; then the arms are timed again (the memory system's state moves).
 * Comparing arms within a round, calls next to each other, keeps a state change between rounds from
 * deciding; the median over rounds keeps one disturbed call from deciding.  A call that ends after its
 * timing was replaced (another thread, a new generation) is not counted. */
#include "decode_tune.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

enum { SLOTS = 32, MAX_ARMS = AB_TUNE_MAX_ARMS };

typedef struct slot {
  ab_decode_tune_kind kind;
  uint32_t rule, free;
  int arms;
  int used;           /* 0: empty */
  uint64_t last_use;  /* for replacing the least recently used slot */
  uint64_t generation;
  int timing;         /* 1: the arms are being timed */
  int64_t given;      /* calls given out in this timing (timing) or since the arm was kept */
  int64_t ended;      /* timed calls ended in this timing */
  int chosen;         /* -1 before the first timing ends */
  double times[AB_TUNE_ROUNDS * MAX_ARMS];
  int64_t calls, timings, arm_calls[MAX_ARMS];
} slot;

static slot g_slots[SLOTS];
static uint64_t g_uses;
/* one count for every slot's timings: a ticket of a slot since given to another kind never matches */
static uint64_t g_generations;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static int same_kind(const slot* s, const ab_decode_tune_kind* k, uint32_t rule, uint32_t free) {
  return s->used && s->rule == rule && s->free == free && memcmp(&s->kind, k, sizeof *k) == 0;
}

/* The set of arm a: the rule's, with the free switches of a's bits flipped (a's bits spread over
 * the free ones, lowest first). */
static uint32_t arm_set(uint32_t rule, uint32_t free, int a) {
  uint32_t flip = 0;
  for (uint32_t bit = 1, i = 0; bit <= AB_TUNE_ALL; bit <<= 1)
    if (free & bit) flip |= ((uint32_t)a >> i++ & 1u) ? bit : 0;
  return rule ^ flip;
}

static void start_timing(slot* s) {
  s->timing = 1;
  s->given = 0;
  s->ended = 0;
  s->generation = ++g_generations;
  for (int i = 0; i < AB_TUNE_ROUNDS * MAX_ARMS; ++i) s->times[i] = 0.0;
}

uint32_t ab_decode_tune_begin(const ab_decode_tune_kind* kind, uint32_t rule, uint32_t free, ab_decode_tune_ticket* t) {
  free &= AB_TUNE_ALL;
  while (1 << __builtin_popcount(free) > MAX_ARMS) free &= free - 1; /* never more arms than a slot holds */
  t->slot = -1;
  t->arm = 0;
  t->round = -1;
  t->generation = 0;
  if (!free) return rule;
  pthread_mutex_lock(&g_lock);
  int at = -1, oldest = 0;
  for (int i = 0; i < SLOTS; ++i) {
    if (same_kind(&g_slots[i], kind, rule, free)) {
      at = i;
      break;
    }
    if (!g_slots[i].used || (g_slots[oldest].used && g_slots[i].last_use < g_slots[oldest].last_use)) oldest = i;
  }
  if (at < 0) {
    at = oldest;
    slot* s = &g_slots[at];
    memset(s, 0, sizeof *s);
    s->kind = *kind;
    s->rule = rule;
    s->free = free;
    s->used = 1;
    s->chosen = -1;
    s->arms = 1 << __builtin_popcount(free);
    start_timing(s);
  }
  slot* s = &g_slots[at];
  s->last_use = ++g_uses;
  s->calls++;
  int arm;
  if (s->timing && s->given < (int64_t)s->arms * AB_TUNE_ROUNDS) {
    arm = (int)(s->given % s->arms);
    t->round = (int32_t)(s->given / s->arms);
    s->given++;
  } else if (s->timing) {
    /* every timed call given out, not all ended yet (calls on other threads; a failed call never
     * ends: after as many calls again, the timing starts over) */
    arm = s->chosen > 0 ? s->chosen : 0;
    if (++s->given >= 2 * (int64_t)s->arms * AB_TUNE_ROUNDS) start_timing(s);
  } else {
    arm = s->chosen;
    if (++s->given >= AB_TUNE_KEEP_CALLS) start_timing(s);
  }
  s->arm_calls[arm]++;
  t->slot = at;
  t->arm = arm;
  t->generation = s->generation;
  const uint32_t set = arm_set(rule, free, arm);
  pthread_mutex_unlock(&g_lock);
  return set;
}

void ab_decode_tune_end(const ab_decode_tune_ticket* t, double seconds_per_byte) {
  if (t->slot < 0 || t->round < 0) return;
  pthread_mutex_lock(&g_lock);
  slot* s = &g_slots[t->slot];
  if (s->used && s->timing && s->generation == t->generation) {
    s->times[t->round * s->arms + t->arm] = seconds_per_byte; /* not a positive number: ab_decode_tune_choose skips it */
    if (++s->ended == (int64_t)s->arms * AB_TUNE_ROUNDS) {
      s->chosen = ab_decode_tune_choose(s->arms, AB_TUNE_ROUNDS, s->times, AB_TUNE_MARGIN);
      s->timing = 0;
      s->given = 0;
      s->timings++;
    }
  }
  pthread_mutex_unlock(&g_lock);
}

static int by_value(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

int ab_decode_tune_choose(int arms, int rounds, const double* times, double margin) {
  if (arms <= 1 || rounds <= 0 || arms > MAX_ARMS || rounds > 64) return 0;
  int best = 0;
  double best_ratio = 1.0 - margin;
  for (int a = 1; a < arms; ++a) {
    double ratios[64];
    int n = 0;
    for (int r = 0; r < rounds; ++r) {
      const double base = times[r * arms], mine = times[r * arms + a];
      if (base > 0.0 && mine > 0.0 && base < 1e300 && mine < 1e300) ratios[n++] = mine / base;
    }
    if (!n) continue;
    qsort(ratios, (size_t)n, sizeof *ratios, by_value);
    const double median = n % 2 ? ratios[n / 2] : 0.5 * (ratios[n / 2 - 1] + ratios[n / 2]);
    if (median < best_ratio) {
      best_ratio = median;
      best = a;
    }
  }
  return best;
}

int ab_decode_tune_state(ab_decode_tune_report* out, int most) {
  pthread_mutex_lock(&g_lock);
  int n = 0;
  for (int i = 0; i < SLOTS; ++i) {
    const slot* s = &g_slots[i];
    if (!s->used) continue;
    if (n < most) {
      ab_decode_tune_report* r = &out[n];
      memset(r, 0, sizeof *r);
      r->kind = s->kind;
      r->rule = s->rule;
      r->free = s->free;
      r->kept = arm_set(s->rule, s->free, s->chosen >= 0 ? s->chosen : 0);
      r->arms = s->arms;
      r->chosen = s->chosen;
      r->timing = s->timing;
      r->calls = s->calls;
      r->timings = s->timings;
      for (int a = 0; a < MAX_ARMS; ++a) r->arm_calls[a] = s->arm_calls[a];
    }
    n++;
  }
  pthread_mutex_unlock(&g_lock);
  return n;
}

void ab_decode_tune_reset(void) {
  pthread_mutex_lock(&g_lock);
  memset(g_slots, 0, sizeof g_slots);
  pthread_mutex_unlock(&g_lock);
}
