/* decode_cpu.c -- the KV-cache attention entry point (decode_cpu.h): checks every argument and
 * value, writes the new keys and values into the cache (rotated when asked), prepares the queries,
 * runs the per-ISA kernel over (batch, KV head, split) items and merges the splits.
 *
 * Order matters for the caller's cache: nothing is written until every check has passed.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ab_cpu.h"
#include "ab_vec.h"
#include "cpu_kernels.h"
#include "decode_cpu.h"
#include "decode_tune.h"

#define MAX_SPLITS 256
/* Splits chosen by the heuristic keep at least this many keys each: below it the merge and the
 * per-item setup cost more than the parallelism gains. */
#define MIN_SPLIT_KEYS 256
/* Query rows (tokens x query heads) one work item streams its keys for: the kernel keeps up to 64
 * rows' softmax state and accumulators per tile. */
#define MAX_ITEM_ROWS 64

int ab_env_switch(const char* name) {
  const char* env = getenv(name);
  return env && (strcmp(env, "0") == 0 || strcmp(env, "1") == 0) ? env[0] == '1' : -1;
}

static int64_t call_rows(const ab_kvcache_params* p);
static int64_t capacity(const ab_kvcache_params* p);
static int amx_rows_wanted(const ab_kvcache_params* p);

/* The amx path's decode kernel where the avx512 path may borrow it (a CPU whose AMX tiles are usable), else NULL. */
static const ab_decode_cpu_table* borrowed_amx(void) {
  if (ab_cpu_isa_get() != AB_ISA_AVX512 || !ab_cpu_isa_supported(AB_ISA_AMX)) return NULL;
  const ab_decode_cpu_table* t = ab_cpu_kernels_for(AB_ISA_AMX)->decode;
  return t && t->attend ? t : NULL;
}

/* The decode kernel of the running path for the call p, from its table (cpu_<isa>.c).  The AMX paths' kernels
 * are their vector one (AVX-512 for amx, generic for amx_emu) with steps 1 and 3 on tiles for the calls
 * amx_tiles admits, and both products of every tile on tiles for those amx_rows admits.  The avx512 path of a CPU
 * whose AMX tiles are usable decodes with the amx path's kernel the calls amx_rows_wanted admits (many query
 * rows per KV head), and every call with ATTN_BACKENDS_DECODE_AMX=1 (read at every call): not by default for
 * one-token decode, since the tiles are faster there only where the caches fit the L3, and their sums are not
 * the vector products' (docs/decode.md, "Tiles").  p NULL: the path's own (q_bf16, the same bits in each). */
static const ab_decode_cpu_table* decode_table(const ab_kvcache_params* p) {
  const ab_cpu_kernels* k = ab_cpu_kernels_get();
  const ab_decode_cpu_table* amx = borrowed_amx();
  if (amx && (ab_env_switch("ATTN_BACKENDS_DECODE_AMX") == 1 || (p && amx_rows_wanted(p)))) return amx;
  return k->decode;
}

/* A switch's 0 or 1 when it is set to one, else the rule's. */
static int forced_or(const char* name, int rule) {
  const int forced = ab_env_switch(name);
  return forced >= 0 ? forced : rule;
}

/* Query rows per KV head (Sq x Hq / Hkv) up to which Intel's AVX-512 path multiplies a bfloat16 cache in bfloat16. */
#define INTEL_BF16_ROWS 2

/* Whether the bfloat16 products of decode_cpu_impl.h run for a call of `rows` query rows per KV head: a bfloat16
 * cache, the AVX-512 path (or AMX, which runs it) and a CPU with AVX512_BF16; on an Intel CPU only up to
 * INTEL_BF16_ROWS rows.  There `vdpbf16ps` issues at a quarter of a float32 FMA's rate (an Intel Xeon with AMX,
 * 0.60 ns against 0.15, `benchmarks/dpbf16_rate.c`), so it does half the multiply-adds per second, and the
 * float32 products, which convert each key and value row once for all the rows, win as soon as there are a
 * few (the same Xeon, 2 threads, 2026-12-07, docs/benchmarks.md "The bfloat16 products on Intel by rows";
 * `bench_decode.py --switch BF16_DOT`, calls drawn at random, on / off from DRAM): 1 row (MHA) 0.97-0.99x the
 * time, 2 rows (G = 2, or 2 tokens of MHA) 0.94-1.00x; one token of G = 4, 8, 16: 1.01-1.07x (1.10-1.12x with
 * the cache in the L3); several tokens of GQA or MHA, 4 to 64 rows: 1.02-1.06x at 8 rows, 1.12-1.28x at 4 and
 * 16, 1.50-1.81x at 16 tokens (the float32 products take 16 rows and more on the tiled products, and flash no
 * longer takes the longest queries).  Not measured by rows on other CPUs (AMD's Zen 4 and Zen 5 keep them for
 * every call, as measured before: docs/decode.md "bfloat16 products").  ATTN_BACKENDS_DECODE_BF16_DOT=1 turns
 * them on for every call that can take them, =0 off (the float32 products then run, as on CPUs without the
 * instructions); read at every call. */
int ab_kvcache_cpu_bf16_products(ab_dtype kv_dtype, int64_t rows) {
  if (kv_dtype != AB_DTYPE_BF16 || !ab_cpu_features_get()->avx512_bf16) return 0;
  const ab_cpu_isa isa = ab_cpu_isa_get();
  if (isa != AB_ISA_AVX512 && isa != AB_ISA_AMX) return 0;
  return forced_or("ATTN_BACKENDS_DECODE_BF16_DOT",
                   rows <= INTEL_BF16_ROWS || ab_cpu_vendor_detect() != AB_VENDOR_INTEL);
}

/* A call's query rows per KV head (Sq x G). */
static int64_t call_rows(const ab_kvcache_params* p) { return p->Hkv > 0 ? p->Sq * (p->Hq / p->Hkv) : 0; }

/* Query rows per KV head (Sq x G) from which a bfloat16 cache's tiles go through the tiled products on AMX tiles
 * whatever the cache's size (amx_rows_wanted). */
#define AMX_ROWS 16
/* Fewer rows per KV head take them where a cache row holds AMX_FEW_POSITIONS positions or more: from AMX_FEW_ROWS
 * rows in GQA, from AMX_FEW_ROWS_MHA in MHA. */
#define AMX_FEW_ROWS 4
#define AMX_FEW_ROWS_MHA 8
#define AMX_FEW_POSITIONS 128

/* What both kinds of tiles ask of a call: a bfloat16 cache, D a multiple of 32 up to 256, and neither
 * ATTN_BACKENDS_DECODE_AMX=0 (no tiles in decode) nor ATTN_BACKENDS_DECODE_BF16_DOT=0 (no bfloat16 products at
 * all; both read at every call). */
static int tile_shape(const ab_kvcache_params* p) {
  return p->k_cache.dtype == AB_DTYPE_BF16 && p->Hkv > 0 && p->D % 32 == 0 && p->D <= 256 &&
         ab_env_switch("ATTN_BACKENDS_DECODE_AMX") != 0 && ab_env_switch("ATTN_BACKENDS_DECODE_BF16_DOT") != 0;
}

/* Whether the call p would take every tile through the tiled products with both products on tiles
 * (decode_cpu_impl.h, "tiles of many rows") on a kernel that has tiles: tile_shape, several query tokens and at
 * least AMX_ROWS query rows per KV head, or fewer (AMX_FEW_ROWS in GQA, AMX_FEW_ROWS_MHA in MHA) where a cache row
 * holds AMX_FEW_POSITIONS positions or more (one-token decode keeps its own products: from DRAM it waits on its
 * reads, not on its arithmetic).  Below 16 rows a tile is partly padding.  On an Intel Xeon with AMX (2 threads,
 * 2026-12-07, docs/benchmarks.md "Tiles of few rows"; B = 1, Hq = 32, D = 128, causal) the tiles took, against the
 * vector products' time: in GQA (G = 2, 4; 4 to 12 rows) 0.49-0.87x over 1024 and 4096 keys, 0.95-1.24x over 64;
 * in MHA 0.51-0.88x at 8 and 12 rows over 1024 and 4096 keys, but at 4 rows 0.77x over 1024 and 1.27x over 4096
 * (a cache from beyond the L2, where the vector kernel reads faster), and at 2 rows 1.33-1.57x at every length.
 * By the cache's capacity, not by the keys its rows hold: that is a shape, read before the index values are (and
 * before the workspace, which the tiles change, is asked for); a larger cache holding few keys costs at most the
 * 64-key figures above, on calls of tens of microseconds.  ATTN_BACKENDS_DECODE_AMX_ROWS=1 for every row count,
 * =0 for none (read at every call). */
static int amx_rows_wanted(const ab_kvcache_params* p) {
  const int64_t rows = call_rows(p), few = p->Hq == p->Hkv ? AMX_FEW_ROWS_MHA : AMX_FEW_ROWS;
  return tile_shape(p) &&
         forced_or("ATTN_BACKENDS_DECODE_AMX_ROWS",
                   p->Sq >= 2 && (rows >= AMX_ROWS || (rows >= few && capacity(p) >= AMX_FEW_POSITIONS)));
}

/* Whether p takes tiles of many rows on the kernel t (decode_table(p)): amx_rows_wanted on a kernel with tiles
 * (an AMX path's, or the one the avx512 path borrows). */
static int amx_rows(const ab_decode_cpu_table* t, const ab_kvcache_params* p) {
  return t->tiles && amx_rows_wanted(p);
}

/* Whether steps 1 and 3 of p go on tiles (decode_cpu_impl.h, "Tiles") on the kernel t (decode_table(p)): a
 * kernel with tiles, tile_shape, one query token, 2 to 16 query heads per KV head (a tile's G columns; MHA reads
 * at the bandwidth with the vector products already), where amx_rows does not take it. */
static int amx_tiles(const ab_decode_cpu_table* t, const ab_kvcache_params* p) {
  if (!t->tiles || !tile_shape(p) || amx_rows_wanted(p)) return 0;
  const int64_t G = p->Hq / p->Hkv;
  return p->Sq == 1 && G >= 2 && G <= 16;
}

/* bfloat16 q and P, on vdpbf16ps (ab_kvcache_cpu_bf16_products) or on tiles (amx_tiles, amx_rows) */
static int bf16_dot(const ab_kvcache_params* p) {
  const ab_decode_cpu_table* t = decode_table(p);
  return ab_kvcache_cpu_bf16_products(p->k_cache.dtype, call_rows(p)) || amx_tiles(t, p) || amx_rows(t, p);
}

/* The AVX-512 path of an AMD CPU (Zen 4), where the prefetch rules below were measured. */
static int amd_avx512(void) { return ab_cpu_isa_get() == AB_ISA_AVX512 && ab_cpu_vendor_detect() == AB_VENDOR_AMD; }

/* That path on a Zen 4 (before family 26), the only AMD CPU the rules that name it were measured on. */
static int amd_zen4_avx512(void) { return amd_avx512() && ab_cpu_features_get()->family < AB_AMD_FAMILY_ZEN5; }


/* Decode's own working set: the caches (by K's address) that the last RECENT_CALLS calls read, and
 * how many K and V bytes each call read from its cache.  A model reads a cache per layer per token,
 * so one layer's cache may fit the L3 while the layers' caches together do not: each then comes
 * from DRAM.  Recorded on every CPU (a lock and two short scans per call); from_dram reads it.  A
 * cache made anew at every step (torch.cat in a growing cache, then flash's route) counts again at
 * its new address until the old one leaves the window, so the estimate may reach twice the real
 * one: the request then comes on from a quarter of the L3, where it measured within 3% either way
 * (docs/benchmarks.md, "a model's decode step"). */
enum { RECENT_CALLS = 64 };
typedef struct recent_cache {
  const void* cache;
  int64_t bytes;
  uint64_t call; /* 0: an empty slot */
} recent_cache;
static recent_cache g_recent[RECENT_CALLS];
static uint64_t g_calls;
static pthread_mutex_t g_recent_lock = PTHREAD_MUTEX_INITIALIZER;

static int64_t recent_bytes_locked(void) {
  int64_t total = 0;
  for (int i = 0; i < RECENT_CALLS; ++i)
    if (g_recent[i].call && g_calls - g_recent[i].call < RECENT_CALLS) total += g_recent[i].bytes;
  return total;
}

/* Records one call reading `bytes` of `cache`, and returns the working set with it. */
static int64_t note_call(const void* cache, int64_t bytes) {
  pthread_mutex_lock(&g_recent_lock);
  const uint64_t now = ++g_calls;
  int slot = 0;
  for (int i = 0; i < RECENT_CALLS; ++i) {
    if (g_recent[i].call && g_recent[i].cache == cache) {
      slot = i;
      break;
    }
    if (g_recent[i].call < g_recent[slot].call) slot = i; /* else the least recently read */
  }
  g_recent[slot] = (recent_cache){cache, bytes, now};
  const int64_t total = recent_bytes_locked();
  pthread_mutex_unlock(&g_recent_lock);
  return total;
}

int64_t ab_kvcache_cpu_working_set(void) {
  pthread_mutex_lock(&g_recent_lock);
  const int64_t total = recent_bytes_locked();
  pthread_mutex_unlock(&g_recent_lock);
  return total;
}

/* The K and V bytes a call reads: `keys` keys of every KV head. */
static double kv_bytes(const ab_kvcache_params* p, int64_t keys) {
  return 2.0 * (double)keys * (double)(p->Hkv * p->D) * (double)ab_dtype_size(p->k_cache.dtype);
}

/* Whether decode's caches come from DRAM: its working set (note_call, this call included) is more than half
 * the L3. */
static int from_dram(int64_t working_set) {
  const int64_t l3 = ab_cpu_features_get()->l3_bytes;
  return 2 * working_set > (l3 > 0 ? l3 : (int64_t)32 << 20);
}

/* Whether step 3 of the kernel asks for the next chunk's key rows for every cache, not only for MHA
 * over a 2-byte one (decode_cpu_impl.h, k_next): on the AVX-512 path of an AMD CPU (Zen 4), when
 * decode's working set (note_call) is more than half the L3, so that its caches come from DRAM
 * (from_dram).
 * There one call took 0.85-0.90x the time with it (dense GQA, float32 MHA) and a model's layers
 * 0.81-0.87x, and paged caches of 16-key blocks came to 1.01-1.13x dense (1.07-1.20x without); but a
 * cache of half the L3 read again and again ran 1.03-1.10x slower with it, and the AMD Zen 3 (avx2
 * path) and Intel AVX-512 CPUs measured 2-7% slower with it from DRAM (docs/benchmarks.md, "Decode
 * on an AVX-512 AMD CPU").  ATTN_BACKENDS_DECODE_KEYS_NEXT=1 makes the request in every call and =0
 * in none beyond MHA over a 2-byte cache, which always has it (read at every call; the bits are the
 * same either way). */
static int keys_next(int dram) { return forced_or("ATTN_BACKENDS_DECODE_KEYS_NEXT", amd_avx512() && dram); }

/* Whether step 1 asks for the chunk's value rows whatever the cache, MHA over a float32 one included,
 * which the kernel otherwise leaves to the hardware prefetchers (decode_cpu_impl.h, v_ahead): on the
 * AVX-512 path of an AMD CPU (Zen 4), where float32 MHA decode took 0.78-0.85x the time with the
 * request from DRAM and 0.87-0.95x with a cache the L3 holds (docs/benchmarks.md, "Decode on an
 * AVX-512 AMD CPU"); elsewhere the request measured slower.  ATTN_BACKENDS_DECODE_VALUES_AHEAD=1
 * makes it in every call, =0 only where the general rule does (read at every call; the same bits
 * either way). */
static int values_ahead(void) { return forced_or("ATTN_BACKENDS_DECODE_VALUES_AHEAD", amd_avx512()); }

/* Whether the kernel asks for one line of each 4 KiB page of the chunk after next, K and V, at the
 * start of each chunk (decode_cpu_impl.h, DC(touch_pages)): the page walk and the DRAM page of a
 * chunk's rows then start two chunks before the rows are asked for.  On the AVX-512 path of an AMD
 * CPU (Zen 4), when the caches come from DRAM (from_dram): paged caches of 16-key blocks, whose pages
 * a shuffled block_table scatters, took 0.90-1.03x the time with it in GQA (0.94 the median; MHA
 * 0.98-1.00), dense ones 0.92-1.03x; a cache the L3 holds (where from_dram leaves it off) 0.98-1.03x
 * (docs/benchmarks.md, "Pages ahead").  Not measured on other CPUs.
 * ATTN_BACKENDS_DECODE_PAGES_AHEAD=1 makes the request in every call, =0 in none (read at every call;
 * the same bits either way). */
static int pages_ahead(int dram) { return forced_or("ATTN_BACKENDS_DECODE_PAGES_AHEAD", amd_avx512() && dram); }

/* Whether the prefetch requests (keys_next, values_ahead, pages_ahead), step 3's order in one-token MHA
 * (pv_keys, below) and step 1's with bfloat16 products (scores_by_head) are chosen by timing them against each
 * other (decode_tune.h) instead of by their rules: when the caches come from DRAM (from_dram),
 * on every CPU.  The rules were each measured on one CPU in one state of its memory; on an AMD Zen 5
 * guest whose memory moved between two states the best set moved with it (docs/benchmarks.md,
 * "Prefetch requests chosen by timing").  The rules' own set is one of the sets timed, and a set
 * is kept only when it was faster in most rounds by AB_TUNE_MARGIN.  A switch forced by its variable is
 * not timed.  ATTN_BACKENDS_DECODE_TUNE=1 times them in every call, =0 in none (read at every call; the
 * same bits either way). */
static int tune(int dram) { return forced_or("ATTN_BACKENDS_DECODE_TUNE", dram); }

static int pv_pairs(void);

/* Whether step 3 takes a bfloat16 cache's value columns by pairs (decode_cpu_impl.h eo: the avx2 path, D a
 * multiple of 16, pv_pairs), which step 3 key by key does not. */
static int eo_pairs(const ab_kvcache_params* p) {
  return ab_cpu_isa_get() == AB_ISA_AVX2 && p->k_cache.dtype == AB_DTYPE_BF16 && p->D % 16 == 0 && pv_pairs();
}

/* The switches decode_tune times that change what a call of p does (hg KV heads per work item), less those forced
 * by their variable (decode_cpu_impl.h: k_next, v_ahead, touch): the next chunk's keys and the pages of the
 * chunk after next only where some tile takes the row path (with bfloat16 products, or fewer than
 * AB_DECODE_TILED_ROWS rows per KV head: the tiled products ask for both whatever the switches say, and for
 * no pages), the next keys not in MHA over a 2-byte cache (always asked for there); the chunk's values only
 * in MHA of one token over a float32 cache (always asked for elsewhere); step 3 key by key (pv_keys) in
 * MHA of one token, but where step 3 takes value columns by pairs (eo_pairs); and step 1 head by head
 * (scores_by_head) where the kernel can take it: bfloat16 products, G a multiple of four, D <= 128. */
static uint32_t tunable(const ab_kvcache_params* p, int bf, int am, int64_t hg) {
  const int64_t G = p->Hq / p->Hkv, HG = hg * G;
  const int64_t tt = ab_decode_tile_tokens(HG, AB_DECODE_TILE_ROWS); /* tunable is not asked for tiles of many rows */
  const int64_t first = p->Sq < tt ? p->Sq : tt, last = p->Sq % tt ? p->Sq % tt : first;
  const int rows_path = bf || first * G < AB_DECODE_TILED_ROWS || last * G < AB_DECODE_TILED_ROWS;
  uint32_t free = 0;
  if (am) /* on tiles only the pages ahead change what a call does */
    return ab_env_switch("ATTN_BACKENDS_DECODE_PAGES_AHEAD") < 0 ? AB_TUNE_PAGES_AHEAD : 0;
  if (rows_path && !(G == 1 && p->k_cache.dtype != AB_DTYPE_F32) &&
      ab_env_switch("ATTN_BACKENDS_DECODE_KEYS_NEXT") < 0)
    free |= AB_TUNE_KEYS_NEXT;
  if (G == 1 && p->Sq == 1 && p->k_cache.dtype == AB_DTYPE_F32 &&
      ab_env_switch("ATTN_BACKENDS_DECODE_VALUES_AHEAD") < 0)
    free |= AB_TUNE_VALUES_AHEAD;
  if (rows_path && ab_env_switch("ATTN_BACKENDS_DECODE_PAGES_AHEAD") < 0) free |= AB_TUNE_PAGES_AHEAD;
  if (G == 1 && p->Sq == 1 && !eo_pairs(p) && ab_env_switch("ATTN_BACKENDS_DECODE_PV_KEYS") < 0)
    free |= AB_TUNE_PV_KEYS;
  if (bf && G % 4 == 0 && p->D <= 128 && ab_env_switch("ATTN_BACKENDS_DECODE_SCORES_BY_HEAD") < 0)
    free |= AB_TUNE_SCORES_BY_HEAD;
  return free;
}

static double seconds_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Whether step 1 with bfloat16 products goes head by head, each head's query rows kept in registers
 * while its key rows stream past, instead of key by key over all the item's heads, which reloads the
 * query rows at every key (decode_cpu_impl.h, DC(head_scores_bf); GQA with G a multiple of four and
 * D <= 128): on the AVX-512 path of an AMD CPU (Zen 4), where bfloat16 GQA decode took 0.80-0.90x the
 * time with a cache the L3 holds and, from DRAM, 0.79-1.03x dense (mostly 0.91-0.98) and 0.93-1.05x
 * over 16-key blocks in five runs (docs/benchmarks.md, "Step 1 head by head").
 * The key rows are then read a head at a time, a stride the hardware prefetchers follow poorly, which
 * the next chunk's keys asked for in step 3 (keys_next) cover from DRAM there.  On a Zen 5 (family 26,
 * 2 threads, 2026-12-04, five runs of `bench_decode.py --switch SCORES_BY_HEAD`): 0.89-0.92x the time
 * from the L3, but from DRAM 1.05-1.18x dense and 1.09-1.22x over 16-key blocks (B=8 once 0.99 dense), so
 * from DRAM it is off there and on later families, not measured (docs/benchmarks.md, "Decode on a Zen
 * 5").  Nor from DRAM over a paged cache whose blocks hold fewer keys than a chunk (AB_DECODE_CHUNK), so
 * that a chunk's rows jump to another block in its middle: on the Zen 4, blocks of 16 under a shuffled
 * block_table, head by head took 1.03-1.08x the time of key by key while the memory answered slowly (11 of
 * 12 comparisons), but 0.94-1.00x while it answered fast, where dense caches took 0.87-0.92x with it
 * (docs/benchmarks.md, "Step 1's order over small blocks, chosen by timing").  So from DRAM this rule is only
 * the first guess: the order is one of the switches decode_tune times (tunable).
 * On other CPUs (Intel's AVX-512 ones with AVX512_BF16) not measured, so off by rule, and timed from DRAM.
 * ATTN_BACKENDS_DECODE_SCORES_BY_HEAD=1 makes it in every call with bfloat16 products, =0 in none (then not
 * timed; read at every call; the same bits either way). */
static int scores_by_head(int dram, int64_t block_size) {
  const int small_blocks = block_size > 0 && block_size < AB_DECODE_CHUNK;
  return forced_or("ATTN_BACKENDS_DECODE_SCORES_BY_HEAD",
                   amd_avx512() && !(dram && (ab_cpu_features_get()->family >= AB_AMD_FAMILY_ZEN5 || small_blocks)));
}

/* Whether step 1 without bfloat16 products (float32 and float16 caches, and bfloat16 ones on CPUs without
 * AVX512_BF16) takes several keys at a time, GQA with G a multiple of four and MHA (decode_cpu_impl.h,
 * DC(key_group_scores)): four on the AVX-512 path (sixteen sums in registers), two on the AVX2 path (eight).
 * Each query vector is then loaded once for the keys, where key by key loads five vectors per four FMAs.
 * On an AMD Zen 4 (2 threads, docs/benchmarks.md, "Step 1 four keys at a time"), AVX-512 path: 0.81-0.94x
 * the time with a cache the L3 holds; GQA from DRAM 0.92-0.96x in float16, 0.94-1.02x in float32, 0.86-0.92x
 * in bfloat16 without its products; MHA from DRAM 0.97-1.07x (the noise), from the L3 0.78-0.94x.  Those runs
 * timed it against key by key inlined into DC(item), which reloaded its query rows' pointers from the stack
 * at every FMA (DC(key_scores_out) since): against that, not measured on the AVX-512 path.
 * On the AVX2 path, against key by key out of line (an AMD Zen 3, 2 threads, docs/benchmarks.md, "Decode on
 * an AVX2 CPU, 2026-12-02"): GQA from DRAM 1.01-1.10x the time in float32 and 1.04-1.26x in bfloat16 and
 * float16; GQA with the cache in the L2 or the L3 (64 to 4096 keys, the same cache every call, alternating
 * in one process) 0.88-0.97x in every dtype; MHA 0.93-1.03x.  So there GQA takes the keys together only
 * when decode's caches fit the L3 (from_dram), MHA always.
 * On the AVX-512 path against key by key out of line (an AMD Zen 5, family 26, 2 threads, 2026-12-04,
 * docs/benchmarks.md, "Decode on a Zen 5"): from DRAM, GQA 1.07-1.15x the time in float32 and float16,
 * 0.97-1.11x in bfloat16 without its products, MHA 1.01-1.03x in float32 and 1.04-1.14x in the 2-byte
 * types; from the L3 0.75-0.92x.  So there it takes the keys together only when the caches fit the L3,
 * GQA and MHA.  On an Intel Xeon (AVX-512 with BF16, FP16 and AMX, 2 threads, 2026-12-06, docs/benchmarks.md,
 * "Decode on an Intel Xeon with AMX"; `bench_decode.py --switch FOUR_KEYS`): from DRAM 0.89-0.98x the time in
 * float32 (GQA and MHA, dense and paged), but float16 GQA 1.01-1.09x (MHA 0.97-0.98x); from the L3 float32
 * 1.01x, float16 0.93x.  So on Intel's AVX-512 path (and the amx path, which runs its kernel) a float32 cache
 * takes the keys together from DRAM too.  Not measured on Zen 4 against key by key out of line.
 * ATTN_BACKENDS_DECODE_FOUR_KEYS=1 takes the keys together in every call, =0 in none (read at every call;
 * the same bits either way). */
static int four_keys(const ab_kvcache_params* p, int dram) {
  const ab_cpu_isa isa = ab_cpu_isa_get();
  const int intel_f32 = (isa == AB_ISA_AVX512 || isa == AB_ISA_AMX) && ab_cpu_vendor_detect() == AB_VENDOR_INTEL &&
                        p->k_cache.dtype == AB_DTYPE_F32;
  const int rule = !dram || (isa == AB_ISA_AVX2 && p->Hq == p->Hkv) || intel_f32;
  return forced_or("ATTN_BACKENDS_DECODE_FOUR_KEYS", rule);
}

/* Whether step 3 without bfloat16 products holds four vectors of D per query row (D a multiple of 64) instead
 * of two, for groups of four rows, on the AVX-512 path (decode_cpu_impl.h, DC(pv)): the value rows stream
 * past twice per chunk instead of four times at D = 128, with half the loads of P.  On an AMD Zen 4 (2
 * threads, docs/benchmarks.md, "Step 1 four keys at a time"): float16 GQA 0.92-0.96x the time, float32 and
 * bfloat16 without its products 0.94-1.04x (even); MHA of one token (not taken) 0.97-1.02.
 * ATTN_BACKENDS_DECODE_PV_WIDE=0 keeps two vectors (read at every call; the same bits either way). */
static int pv_wide(void) { return forced_or("ATTN_BACKENDS_DECODE_PV_WIDE", 1); }

/* Whether step 3 over a bfloat16 cache on the AVX2 path reads sixteen columns per load as their even and
 * odd halves (a shift and a mask, decode_cpu_impl.h DC(ld_pair)) instead of eight per widening load and
 * shift, the accumulators kept by pairs until the row is done (D a multiple of 16): half the conversion
 * instructions, each column's sum the same.  ATTN_BACKENDS_DECODE_PV_PAIRS=0 keeps eight columns per load
 * (read at every call; the same bits either way). */
static int pv_pairs(void) { return forced_or("ATTN_BACKENDS_DECODE_PV_PAIRS", 1); }

/* Whether step 3 of one-token MHA goes key by key over the item's heads, the value rows in the cache's order,
 * instead of head by head (decode_cpu_impl.h, DC(pv_keys), DC(pv_keys_bf); not where it takes value columns by
 * pairs, eo_pairs); the same bits.  On an AMD Zen 5 (2 threads, B=4 Hq=Hkv=32 Sk=2048 D=128, from DRAM with the
 * prefetch rules' set, 2026-12-05, docs/benchmarks.md "Step 3 key by key"): 0.87-0.92x the time in float32,
 * 0.90-0.92x in float16, 0.89-0.96x in bfloat16 with its products, dense and over 16-key blocks; from the L3
 * even.  So on by rule, and from DRAM one of the switches decode_tune times.  ATTN_BACKENDS_DECODE_PV_KEYS=1/0
 * forces it (read at every call). */
static int pv_keys(void) { return forced_or("ATTN_BACKENDS_DECODE_PV_KEYS", 1); }

/* Whether the softmax (step 2) asks for the next chunk's key rows of the work item's first heads (3 of 8), which
 * step 3 then leaves out: with bfloat16 products, in GQA, where the next keys are asked for at all (keys_next;
 * decode_cpu_impl.h DC(softmax)).  Between step 1's requests (the chunk's values) and step 3's (the next keys)
 * the softmax asked for nothing, and the memory waited on it: from DRAM, the softmax left out took 0.88-0.90x
 * the time, where steps 1 and 3 replaced by register loops over the same rows took 0.98-1.01x.  On an AMD Zen 4
 * (family 25, AVX-512 path, 2026-12-06, docs/benchmarks.md "The softmax's wait from DRAM"), bfloat16 GQA decode
 * from DRAM (Hq=32 Hkv=8 D=128, B=1 Sk=16384 and B=8 Sk=2048) took 0.96-0.97x the time with it on two threads
 * and 0.97x on one, dense, 0.95-0.98x over 256-key blocks and 0.97-0.98x over 16-key blocks (step 1 key by key
 * there); a cache the L3 holds makes no next-key requests (forced on, 1.01-1.02x the time).  Without bfloat16
 * products (float32 GQA) 1.00-1.01x: not there.  Not measured on other CPUs, so off there.
 * ATTN_BACKENDS_DECODE_SOFTMAX_KEYS=1 makes it in every call with bfloat16 products where the next keys are
 * asked for, =0 in none (read at every call; the same bits either way). */
static int softmax_keys(void) {
  return forced_or("ATTN_BACKENDS_DECODE_SOFTMAX_KEYS", amd_zen4_avx512());
}

/* Whether step 1 asks for the key row two keys ahead into L1 (decode_cpu_impl.h, DC(head_scores_bf) and
 * DC_KEY_PF).  From DRAM it pays: forced off, bfloat16 GQA took 1.02x the time dense and 1.15-1.16x over 16-key
 * blocks, float32 GQA 0.99-1.08x (a Zen 4).  With a cache the L3 holds (from_dram), where the hardware's own
 * prefetchers find the rows in time, the request only takes load slots: on an AMD Zen 4 (family 25, AVX-512
 * path, 2026-12-06, docs/benchmarks.md, "Step 1's key requests from the L3"), decode from the L3 ran 1.04-1.08x
 * as fast without it in bfloat16 (GQA and MHA) and 1.04-1.11x in float32, on two threads and one.  Not
 * measured on other CPUs, so on there.  ATTN_BACKENDS_DECODE_KEYS_AHEAD=1 makes it in every call, =0 in none
 * (read at every call; the same bits either way). */
static int keys_ahead(int dram) {
  return forced_or("ATTN_BACKENDS_DECODE_KEYS_AHEAD", dram || !amd_zen4_avx512());
}

/* The K and V elements a one-token MHA call reads up to which it goes in runs of keys (mha_runs): 4 MiB of a 2-byte
 * cache, 8 MiB of a float32 one (2**19 before 2026-12-07 13:40 UTC; why it moved: mha_runs). */
#define MHA_RUNS_CALL_ELEMENTS ((int64_t)1 << 21)

/* Whether one-token MHA goes head by head over runs of up to 128 keys, each head's accumulators in registers
 * (decode_cpu_impl.h, "one-token MHA in runs of keys"), instead of chunk by chunk over the work item's heads: on a
 * kernel that has them (the AVX-512 ones), without a mask, D <= 128, not on tiles, for the calls that read at most
 * MHA_RUNS_CALL_ELEMENTS elements of K and V (2 x `keys`, the call's own key count, x Hkv x D).  A head's key rows
 * are read a head at a time, which from the caches costs nothing and from DRAM more than the chunks' arithmetic
 * saves (float32 B=4 Hq=Hkv=32 Sk=2048 D=128: 12.35 ms against the chunks' 9.73, 0.91x torch SDPA against 1.09x).
 * On an Intel Xeon with AMX (2 threads, 2026-12-07, docs/benchmarks.md "One-token MHA in runs of keys on the AMX
 * Xeon" and "Reading the runs key by key, and the runs' call limit at 2**21 elements"):
 *   - with a cache the caches hold, 0.62-1.01x the chunks' time (bench_decode.py --small, every dtype); bfloat16
 *     calls of 3-4 MiB 0.92-1.07x torch on the runs, 0.75-0.83x on the chunks;
 *   - from DRAM (--switch MHA_RUNS) 1.25-1.77x the chunks' time in bfloat16 and float16, 0.92-1.06x in float32;
 *     bfloat16 calls of 3-4 MiB 1.17-1.47x, 0.74-0.93x torch over contiguous copies and 0.91-1.24x torch over the
 *     cache's own memory, where the chunks are 1.04-1.13x and 1.32-1.45x (float32 of 6-8 MiB: runs 0.94-1.04x and
 *     1.10-1.32x; benchmarks/mha_runs_dram.py, docs/benchmarks.md "mha_runs_dram.py corrected");
 *   - a model's layers (--small-layers) in float32 0.91-0.98x the chunks' time at every size (12 MiB to 1 GiB), in
 *     bfloat16 0.91-0.94x where they come to 6-9 MiB, 1.04-1.36x from 32 MiB (layers of 3-16 MiB).
 * So the limit puts "auto is never slower than torch" first: up to it the runs' worst case is no further from torch
 * than the chunks' (bfloat16 D = 64 of 3 MiB 0.74-0.77x from DRAM against the chunks' 0.77-0.80x from the caches;
 * D = 128 of 4 MiB 0.91-0.93x against 0.79x; float32 0.93x against 0.77x).  Reading the rows key by key over the
 * heads in the runs (the same sums: a rule of the working set could pick it) did not close the gap from DRAM
 * (1.14-1.23x the chunks' time in bfloat16, 1.03-1.21x in float32; not kept).
 * By the call alone, not by decode's working set (note_call), which would pick the path better for a model whose
 * layers outgrow the caches: the runs add in another order than the chunks, so a rule of the working set would
 * give the same call other bits after other calls.  ATTN_BACKENDS_DECODE_MHA_RUNS=1 takes them in every call that
 * can, =0 in none (read at every call; not the chunks' bits). */
static int mha_runs(const ab_decode_cpu_table* t, const ab_kvcache_params* p, int am, int amr, int64_t keys) {
  const int can = t->runs && !am && !amr && p->Hq == p->Hkv && p->Sq == 1 && p->mask.ndim == 0 && p->D <= 128;
  const double elements = 2.0 * (double)keys * (double)(p->Hkv * p->D);
  return can && forced_or("ATTN_BACKENDS_DECODE_MHA_RUNS", elements <= (double)MHA_RUNS_CALL_ELEMENTS);
}

int ab_kvcache_cpu_q_bf16(const float* row, uint16_t* rb, int64_t n, int qexp) {
  return decode_table(NULL)->q_bf16(row, rb, n, qexp);
}

int64_t ab_kvcache_cpu_max_rows(ab_dtype dt, int in_place, int64_t positions) {
  if (!ab_kvcache_cpu_bf16_products(dt, INT64_MAX)) return INT64_MAX; /* the tiled products serve long queries */
  if (!in_place || positions < 2048) return 64;
  return 48;
}

static int64_t index_at(const ab_tensor* t, int64_t i, int64_t j) {
  const int64_t off = i * t->strides[0] + (t->ndim > 1 ? j * t->strides[1] : 0);
  return t->dtype == AB_DTYPE_I64 ? ((const int64_t*)t->data)[off] : ((const int32_t*)t->data)[off];
}

static int paged(const ab_kvcache_params* p) { return p->block_table.ndim > 0; }

/* positions a cache row holds */
static int64_t capacity(const ab_kvcache_params* p) {
  return paged(p) ? p->block_table.sizes[1] * p->k_cache.sizes[1] : p->k_cache.sizes[1];
}

static int64_t new_tokens(const ab_kvcache_params* p) { return p->k_new.ndim ? p->k_new.sizes[1] : 0; }

static int64_t seqlen_of(const ab_kvcache_params* p, int64_t b) {
  if (p->cache_seqlens.ndim) return index_at(&p->cache_seqlens, b, 0);
  return p->cache_seqlen >= 0 ? p->cache_seqlen : capacity(p);
}

#define TRY(expr)               \
  do {                          \
    ab_status s_ = (expr);      \
    if (s_ != AB_OK) return s_; \
  } while (0)

/* Shapes, dtypes, devices and options: everything but the values of the index tensors. */
static ab_status check_call(const ab_kvcache_params* p, ab_error* err) {
  TRY(ab_kvcache_params_check(p, AB_DEVICE_CPU, err));
  if (ab_cpu_isa_error()) return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s", ab_cpu_isa_error());
  return AB_OK;
}

/* Whether q rotates at one position per token (flash-attn: causal or a window shorter than the
 * cache) or at cache_seqlens for every token. */
static int q_rotates_per_token(const ab_kvcache_params* p) {
  const int64_t cap = capacity(p);
  return p->causal || (p->window_left >= 0 && p->window_left < cap) || (p->window_right >= 0 && p->window_right < cap);
}

/* The values: sequence lengths inside the cache, leftpad inside them, cache rows and blocks that
 * exist, rotary tables long enough.  Runs before anything is written. */
static ab_status check_values(const ab_kvcache_params* p, ab_error* err) {
  const int64_t cap = capacity(p), snew = new_tokens(p);
  const int64_t qspan = q_rotates_per_token(p) ? p->Sq : (p->Sq > 0);
  for (int64_t b = 0; b < p->B; ++b) {
    const int64_t len = seqlen_of(p, b);
    if (len < 0 || len > cap - snew) { /* not len + snew > cap: a length near 2**63 would wrap */
      if (p->cache_seqlens.ndim)
        return ab_error_set(err, AB_ERR_INVALID,
                            "cache_seqlens[%lld] = %lld is outside the cache: with %lld new tokens it must be in "
                            "[0, %lld] (the cache holds %lld positions per row)",
                            (long long)b, (long long)len, (long long)snew, (long long)(cap - snew), (long long)cap);
      return ab_error_set(err, AB_ERR_INVALID,
                          "cache_seqlens = %lld is outside the cache: with %lld new tokens it must be in [0, %lld]",
                          (long long)len, (long long)snew, (long long)(cap - snew));
    }
    const int64_t lo = p->cache_leftpad.ndim ? index_at(&p->cache_leftpad, b, 0) : 0;
    if (lo < 0 || lo > len)
      return ab_error_set(err, AB_ERR_INVALID, "cache_leftpad[%lld] = %lld must be in [0, cache_seqlens[%lld] = %lld]",
                          (long long)b, (long long)lo, (long long)b, (long long)len);
    if (p->cache_batch_idx.ndim) {
      const int64_t row = index_at(&p->cache_batch_idx, b, 0);
      if (row < 0 || row >= p->k_cache.sizes[0])
        return ab_error_set(err, AB_ERR_INVALID, "cache_batch_idx[%lld] = %lld is not a row of k_cache (it has %lld)",
                            (long long)b, (long long)row, (long long)p->k_cache.sizes[0]);
    }
    if (paged(p)) {
      const int64_t bs = p->k_cache.sizes[1], nblocks = p->k_cache.sizes[0];
      for (int64_t i = lo / bs; i * bs < len + snew; ++i) {
        const int64_t blk = index_at(&p->block_table, b, i);
        if (blk < 0 || blk >= nblocks)
          return ab_error_set(err, AB_ERR_INVALID,
                              "block_table[%lld][%lld] = %lld is not a block of k_cache (it has %lld), and row %lld "
                              "reads or writes positions up to %lld",
                              (long long)b, (long long)i, (long long)blk, (long long)nblocks, (long long)b,
                              (long long)(len + snew - 1));
      }
    }
    if (p->rotary_cos.ndim) {
      const int64_t need = len + (snew > qspan ? snew : qspan);
      if (need > p->rotary_cos.sizes[0])
        return ab_error_set(err, AB_ERR_INVALID,
                            "rotary_cos has %lld positions, but row %lld rotates up to position %lld "
                            "(cache_seqlens[%lld] + %lld)",
                            (long long)p->rotary_cos.sizes[0], (long long)b, (long long)(need - 1), (long long)b,
                            (long long)(need - len - 1));
    }
  }
  return AB_OK;
}

/* x[0, rotary_dim) rotated by the table's row pos, in float32 as flash-attn does: interleaved pairs
 * (2i, 2i + 1), or the GPT-NeoX halves (i, i + rotary_dim / 2). */
static void rotate(const ab_kvcache_params* p, int64_t pos, float* x) {
  const ab_tensor *c = &p->rotary_cos, *s = &p->rotary_sin;
  const int64_t half = c->sizes[1];
  for (int64_t i = 0; i < half; ++i) {
    const float cs = (float)ab_load_scalar(c->data, c->dtype, pos * c->strides[0] + i * c->strides[1]);
    const float sn = (float)ab_load_scalar(s->data, s->dtype, pos * s->strides[0] + i * s->strides[1]);
    const int64_t i0 = p->rotary_interleaved ? 2 * i : i, i1 = p->rotary_interleaved ? 2 * i + 1 : i + half;
    const float x0 = x[i0], x1 = x[i1];
    x[i0] = x0 * cs - x1 * sn;
    x[i1] = x0 * sn + x1 * cs;
  }
}

/* Element offset of (b, pos, h, 0) in a cache: through block_table when paged. */
static int64_t cache_off(const ab_kvcache_params* p, const ab_tensor* c, int64_t b, int64_t pos, int64_t h) {
  if (paged(p)) {
    const int64_t bs = c->sizes[1];
    return index_at(&p->block_table, b, pos / bs) * c->strides[0] + (pos % bs) * c->strides[1] + h * c->strides[2];
  }
  const int64_t row = p->cache_batch_idx.ndim ? index_at(&p->cache_batch_idx, b, 0) : b;
  return row * c->strides[0] + pos * c->strides[1] + h * c->strides[2];
}

/* n elements of es bytes from src (element stride st) to the contiguous dst, bit for bit: one memcpy
 * for a contiguous row (the usual case: a per-element memcpy call cost a decode step microseconds). */
static void copy_row(char* dst, const char* src, int64_t n, int64_t st, size_t es) {
  if (st == 1 || n <= 1) {
    memmove(dst, src, (size_t)n * es); /* a new row may be a view of the cache itself */
    return;
  }
  for (int64_t d = 0; d < n; ++d) memcpy(dst + (size_t)d * es, src + (size_t)(d * st) * es, es);
}

/* The bytes a view spans, [*lo, *hi); 0 for a view without elements. */
static int byte_span(const ab_tensor* t, const char** lo, const char** hi) {
  int64_t far = 0;
  for (int d = 0; d < t->ndim; ++d) {
    if (t->sizes[d] == 0) return 0;
    far += t->strides[d] * (t->sizes[d] - 1);
  }
  *lo = (const char*)t->data;
  *hi = *lo + (size_t)(far + 1) * ab_dtype_size(t->dtype);
  return 1;
}

static int spans_meet(const ab_tensor* a, const ab_tensor* b) {
  const char *a0, *a1, *b0, *b1;
  return byte_span(a, &a0, &a1) && byte_span(b, &b0, &b1) && a0 < b1 && b0 < a1;
}

/* Whether the new k or v shares bytes with a cache (a view of it). */
static int new_rows_meet_caches(const ab_kvcache_params* p) {
  return spans_meet(&p->k_new, &p->k_cache) || spans_meet(&p->k_new, &p->v_cache) ||
         spans_meet(&p->v_new, &p->k_cache) || spans_meet(&p->v_new, &p->v_cache);
}

/* *out as *p with the new k and v copied to one malloc'd block (contiguous, bit for bit); returns the
 * block for the caller to free, NULL when out of memory. */
static void* stage_new_rows(const ab_kvcache_params* p, ab_kvcache_params* out) {
  *out = *p;
  const size_t es = ab_dtype_size(p->k_new.dtype);
  const int64_t n = p->k_new.sizes[0] * p->k_new.sizes[1] * p->k_new.sizes[2] * p->k_new.sizes[3];
  char* block = (char*)malloc((size_t)(2 * n > 0 ? 2 * n : 1) * es);
  if (!block) return NULL;
  ab_tensor* dst[2] = {&out->k_new, &out->v_new};
  for (int i = 0; i < 2; ++i) {
    const ab_tensor src = *dst[i];
    char* base = block + (size_t)(i * n) * es;
    const int64_t* sz = src.sizes;
    int64_t at = 0;
    for (int64_t b = 0; b < sz[0]; ++b)
      for (int64_t t = 0; t < sz[1]; ++t)
        for (int64_t h = 0; h < sz[2]; ++h, at += sz[3])
          copy_row(base + (size_t)at * es, (const char*)src.data + (size_t)ab_off4(&src, b, t, h, 0) * es, sz[3],
                   src.strides[3], es);
    dst[i]->data = base;
    dst[i]->strides[3] = 1;
    dst[i]->strides[2] = sz[3];
    dst[i]->strides[1] = sz[2] * sz[3];
    dst[i]->strides[0] = sz[1] * sz[2] * sz[3];
  }
  return block;
}

/* The new keys (rotated) and values into the cache, at cache_seqlens[b] + t.  Values and unrotated
 * keys are copied bit for bit. */
static void append(const ab_kvcache_params* p, float* row) {
  const int64_t snew = new_tokens(p);
  const size_t es = ab_dtype_size(p->q.dtype);
  const ab_tensor *kn = &p->k_new, *vn = &p->v_new;
  for (int64_t b = 0; b < p->B; ++b) {
    const int64_t len = seqlen_of(p, b);
    for (int64_t t = 0; t < snew; ++t)
      for (int64_t h = 0; h < p->Hkv; ++h) {
        const int64_t ko = cache_off(p, &p->k_cache, b, len + t, h), vo = cache_off(p, &p->v_cache, b, len + t, h);
        const int64_t ks = ab_off4(kn, b, t, h, 0), vs = ab_off4(vn, b, t, h, 0);
        if (p->rotary_cos.ndim) {
          ab_vec_load_row(kn->data, kn->dtype, ks, p->D, kn->strides[3], row);
          rotate(p, len + t, row);
          ab_vec_store_row(p->k_cache.data, p->k_cache.dtype, ko, p->D, 1, row);
        } else {
          copy_row((char*)p->k_cache.data + (size_t)ko * es, (const char*)kn->data + (size_t)ks * es, p->D,
                   kn->strides[3], es);
        }
        copy_row((char*)p->v_cache.data + (size_t)vo * es, (const char*)vn->data + (size_t)vs * es, p->D,
                 vn->strides[3], es);
      }
  }
}

/* q as float32 (B, Sq, Hq, dpad): rotated at its positions, times scale, pad lanes 0; with qb, also
 * as bfloat16 rotated and times 2**qexp (ab_bf16_scale_exp), rounded to nearest even once: the bfloat16
 * products.  Returns whether that bfloat16 q lost an element: one that is not 0 but whose bfloat16 value
 * is subnormal or 0 (vdpbf16ps takes bfloat16 subnormals as 0), so that the caller runs the float32
 * products instead (a q near 1e-37, or near 1 under a scale near 1e-38, against keys near 1e37: scores of
 * order 1 that the bfloat16 products made 0).  kernel: the call's decode kernel (decode_table), whose q_bf16
 * rounds. */
static int prepare_q(const ab_kvcache_params* p, const ab_decode_cpu_table* kernel, float* qf, uint16_t* qb,
                     int64_t dpad, int qexp) {
  const int per_token = q_rotates_per_token(p);
  int lost = 0;
  for (int64_t b = 0; b < p->B; ++b)
    for (int64_t t = 0; t < p->Sq; ++t)
      for (int64_t h = 0; h < p->Hq; ++h) {
        float* row = qf + ((b * p->Sq + t) * p->Hq + h) * dpad;
        memset(row, 0, (size_t)dpad * sizeof(float));
        ab_vec_load_row(p->q.data, p->q.dtype, ab_off4(&p->q, b, t, h, 0), p->D, p->q.strides[3], row);
        if (p->rotary_cos.ndim) rotate(p, seqlen_of(p, b) + (per_token ? t : 0), row);
        if (qb) lost |= kernel->q_bf16(row, qb + ((b * p->Sq + t) * p->Hq + h) * dpad, dpad, qexp);
        for (int64_t d = 0; d < p->D; ++d) row[d] *= (float)p->scale;
      }
  return lost;
}

/* The most splits of each row's key range the cache allows (each keeps MIN_SPLIT_KEYS keys), at least 1. */
static int64_t splits_allowed(const ab_kvcache_params* p) {
  const int64_t most = capacity(p) / MIN_SPLIT_KEYS;
  return most > 1 ? most : 1;
}

/* KV heads per work item: as many as keep the item's query rows (Sq x heads x G) within a tile of
 * the kernel, so that a key's rows for the group are one contiguous read; fewer where that leaves
 * threads idle and the cache is too short to split (every split keeps MIN_SPLIT_KEYS keys): one
 * item of 8 MHA heads over 128 keys ran on one of two threads, 1.6x torch SDPA's time. */
static int64_t heads_per_item(const ab_kvcache_params* p, int num_threads) {
  const int64_t G = p->Hkv > 0 ? p->Hq / p->Hkv : 1, Sq = p->Sq > 0 ? p->Sq : 1;
  int64_t hg = 1;
  for (int64_t h = 1; h <= p->Hkv; ++h)
    if (p->Hkv % h == 0 && h * G * Sq <= MAX_ITEM_ROWS) hg = h;
  if (p->num_splits > 0 || num_threads <= 1) return hg;
  while (hg > 1 && p->B * (p->Hkv / hg) * splits_allowed(p) < num_threads) {
    int64_t h = hg - 1;
    while (p->Hkv % h) --h; /* the next divisor of Hkv down (1 at the latest) */
    hg = h;
  }
  return hg;
}

int64_t ab_kvcache_cpu_splits(const ab_kvcache_params* p, int num_threads) {
  if (p->num_splits > 0) return p->num_splits < MAX_SPLITS ? p->num_splits : MAX_SPLITS;
  const int64_t items = p->B * (p->Hkv / heads_per_item(p, num_threads));
  if (items <= 0 || num_threads <= 1 || items >= num_threads) return 1;
  int64_t n = (num_threads + items - 1) / items;
  if (n > splits_allowed(p)) n = splits_allowed(p);
  return n > MAX_SPLITS ? MAX_SPLITS : n;
}

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

static int64_t dpad_of(const ab_kvcache_params* p, int bf) {
  const int64_t m = bf ? 2 * AB_DECODE_DPAD : AB_DECODE_DPAD;
  return (p->D + m - 1) / m * m;
}

/* Index values a call reads: cache_seqlens, cache_leftpad and cache_batch_idx (B each) and the block
 * table (B x max_blocks). */
static int64_t index_values(const ab_kvcache_params* p) {
  return p->B * (3 + (paged(p) ? p->block_table.sizes[1] : 0));
}

/* Workspace: q (B, Sq, Hq, dpad) float32 (and bfloat16 with bf), the split partials, per-row key
 * ranges and cache rows, a row of scratch, each head's sink, then the call's index values. */
static size_t workspace_layout(const ab_kvcache_params* p, int64_t nsplit, int bf, size_t* part_at, size_t* idx_at,
                               size_t* values_at) {
  const int64_t dpad = dpad_of(p, bf);
  size_t n = align64((size_t)(p->B * p->Sq * p->Hq * dpad) * sizeof(float));
  if (bf) n += align64((size_t)(p->B * p->Sq * p->Hq * dpad) * sizeof(uint16_t));
  *part_at = n;
  if (nsplit > 1) n += align64((size_t)(p->B * p->Sq * p->Hq * nsplit * (dpad + 16)) * sizeof(float));
  *idx_at = n;
  n += align64(align64((size_t)(3 * p->B) * sizeof(int64_t)) + (size_t)(dpad + p->Hq) * sizeof(float));
  *values_at = n;
  return n + (size_t)index_values(p) * sizeof(int64_t);
}

/* t's values (1-D, or 2-D for the block table) copied to dst as int64, and t made a contiguous view of
 * the copy; past the copy's end.  An absent t is left as it is. */
static int64_t* keep_values(ab_tensor* t, int64_t* dst) {
  if (!t->ndim) return dst;
  const int64_t rows = t->sizes[0], cols = t->ndim > 1 ? t->sizes[1] : 1;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[i * cols + j] = index_at(t, i, j);
  t->data = dst;
  t->dtype = AB_DTYPE_I64;
  t->strides[0] = cols;
  if (t->ndim > 1) t->strides[1] = 1;
  return dst + rows * cols;
}

size_t ab_kvcache_cpu_workspace_size(const ab_kvcache_params* p, int num_threads) {
  ab_error ignored;
  if (check_call(p, &ignored) != AB_OK) return 0;
  size_t part_at, idx_at, values_at;
  return workspace_layout(p, ab_kvcache_cpu_splits(p, num_threads), bf16_dot(p), &part_at, &idx_at, &values_at);
}

/* The splits of each output row merged as ab.merge_attention_states does: weights exp(lse_s - max),
 * a row no split saw stays out 0, lse -inf.  Items are (batch row, query head). */
static void merge(int64_t begin, int64_t end, void* ctx) {
  const ab_decode_run* run = (const ab_decode_run*)ctx;
  const ab_kvcache_params* p = run->p;
  const int64_t dpad = run->dpad, ns = run->nsplit, stride = dpad + 16;
  float* acc = (float*)ab_scratch_alloc((size_t)dpad * sizeof(float));
  if (!acc) {
    ab_par_fail(run->st, AB_ERR_NOMEM, "out of memory while merging the decode splits");
    return;
  }
  for (int64_t bh = begin; bh < end; ++bh) {
    const int64_t b = bh / p->Hq, hq = bh % p->Hq;
    for (int64_t t = 0; t < p->Sq; ++t) {
      /* split s of this row */
#define PART(s) (run->part + (((b * ns + (s)) * p->Sq + t) * p->Hq + hq) * stride)
      /* split s wrote its lse at [dpad], its running max m_s at [dpad + 1] and its sum l_s at [dpad + 2]
       * (DC(item)): the weights are l_s exp(m_s - m), not exp(lse_s - max lse), whose float32 lse carries
       * a rounding error of |lse| 2**-24 into every weight (with scores near 3000, 3e-6 on the output
       * where one split gives 1e-7) */
      float m = -INFINITY;
      int nan = 0; /* a split that saw a NaN score makes the row NaN */
      for (int64_t s = 0; s < ns; ++s) {
        if (PART(s)[dpad + 2] > 0.0f) m = PART(s)[dpad + 1] > m ? PART(s)[dpad + 1] : m;
        nan |= PART(s)[dpad] != PART(s)[dpad];
      }
      if (nan) {
        for (int64_t d = 0; d < p->D; ++d) acc[d] = __builtin_nanf("");
        const ab_tensor* out = &p->out;
        ab_vec_store_row(out->data, out->dtype, ab_off4(out, b, t, hq, 0), p->D, out->strides[3], acc);
        ((float*)p->lse.data)[ab_off3(&p->lse, b, hq, t)] = __builtin_nanf("");
        continue;
      }
      float total = 0.0f;
      for (int64_t s = 0; s < ns; ++s)
        total += PART(s)[dpad + 2] > 0.0f ? PART(s)[dpad + 2] * expf(PART(s)[dpad + 1] - m) : 0.0f;
      memset(acc, 0, (size_t)dpad * sizeof(float));
      if (total > 0.0f)
        for (int64_t s = 0; s < ns; ++s) {
          const float* o = PART(s);
          if (!(o[dpad + 2] > 0.0f)) continue;
          const float w = o[dpad + 2] * expf(o[dpad + 1] - m) / total;
          for (int64_t d = 0; d < p->D; ++d) acc[d] += w * o[d];
        }
#undef PART
      float factor;
      const float lse = ab_decode_add_sink(total > 0.0f ? m + logf(total) : -INFINITY, run->sink[hq], &factor);
      if (factor != 1.0f)
        for (int64_t d = 0; d < p->D; ++d) acc[d] *= factor;
      const ab_tensor* out = &p->out;
      ab_vec_store_row(out->data, out->dtype, ab_off4(out, b, t, hq, 0), p->D, out->strides[3], acc);
      ((float*)p->lse.data)[ab_off3(&p->lse, b, hq, t)] = lse;
    }
  }
  ab_scratch_free(acc);
}

ab_status ab_kvcache_cpu_fwd(const ab_kvcache_params* call, void* workspace, size_t workspace_bytes,
                             const ab_cpu_pool* pool, ab_error* err) {
  TRY(check_call(call, err));
  const int threads = pool ? pool->num_threads : 1;
  const int64_t nsplit = ab_kvcache_cpu_splits(call, threads);
  size_t part_at, idx_at, values_at;
  /* read once: bf, am and amr below follow them */
  const ab_decode_cpu_table* table = decode_table(call);
  const int tiles = amx_tiles(table, call), rows_tiles = amx_rows(table, call);
  int bf = ab_kvcache_cpu_bf16_products(call->k_cache.dtype, call_rows(call)) || tiles || rows_tiles; /* bf16_dot */
  const size_t need = workspace_layout(call, nsplit, bf, &part_at, &idx_at, &values_at);
  if (!workspace || workspace_bytes < need)
    return ab_error_set(err, AB_ERR_INVALID, "the decode kernel needs %zu bytes of workspace, got %zu", need,
                        workspace_bytes);
  char* ws = (char*)workspace;
  /* The index values are read once, here, and the call runs on that copy: checked values are the values
   * used, also when an index tensor shares memory with a cache the call writes into, or another thread
   * changes it while this one runs without the GIL. */
  ab_kvcache_params kept = *call;
  const ab_kvcache_params* p = &kept;
  int64_t* values = (int64_t*)(ws + values_at);
  values = keep_values(&kept.cache_seqlens, values);
  values = keep_values(&kept.cache_leftpad, values);
  values = keep_values(&kept.cache_batch_idx, values);
  keep_values(&kept.block_table, values);
  /* a window side of the cache's capacity or more hides no key: unbounded (-1), as flash-attn makes it
   * and before any position is added to it (a side near 2**63 would wrap) */
  const int64_t cap = capacity(p);
  if (kept.window_left >= cap) kept.window_left = -1;
  if (kept.window_right >= cap) kept.window_right = -1;
  TRY(check_values(p, err));
  if (ab_cpu_isa_error()) return ab_error_set(err, AB_ERR_UNSUPPORTED, "%s", ab_cpu_isa_error());
  const int64_t dpad = dpad_of(p, bf);
  uint16_t* qb = bf ? (uint16_t*)(ws + align64((size_t)(p->B * p->Sq * p->Hq * dpad) * sizeof(float))) : NULL;
  int64_t* lo = (int64_t*)(ws + idx_at);
  int64_t *end = lo + p->B, *row = end + p->B;
  float* scratch_row = (float*)(ws + idx_at + align64((size_t)(3 * p->B) * sizeof(int64_t)));
  float* sink = scratch_row + dpad;
  for (int64_t h = 0; h < p->Hq; ++h)
    sink[h] = p->sinks.ndim ? (float)ab_load_scalar(p->sinks.data, p->sinks.dtype, h * p->sinks.strides[0])
                            : -INFINITY;

  /* new rows that are a view of a cache (tokens moved within it: a speculative rollback) are read before
   * any is written, as if copied first: row by row, a write landed on a row still to be read */
  ab_kvcache_params staged_p;
  void* staged = NULL;
  if (p->k_new.ndim && new_rows_meet_caches(p)) {
    staged = stage_new_rows(p, &staged_p);
    if (!staged) return ab_error_set(err, AB_ERR_NOMEM, "out of memory while copying the new k and v");
  }
  /* checks passed: from here on the cache changes */
  append(staged ? &staged_p : p, scratch_row);
  free(staged);
  if (p->B == 0 || p->Sq == 0 || p->Hq == 0) return AB_OK;
  const int qexp = bf ? ab_bf16_scale_exp(p->scale) : 0;
  /* a q the bfloat16 products would lose part of goes to the float32 products (same workspace: its dpad,
   * a multiple of 32, is one of 16 too) */
  if (prepare_q(p, table, (float*)ws, qb, dpad, qexp)) bf = 0;
  int64_t keys = 0;
  for (int64_t b = 0; b < p->B; ++b) {
    lo[b] = p->cache_leftpad.ndim ? index_at(&p->cache_leftpad, b, 0) : 0;
    end[b] = seqlen_of(p, b) + new_tokens(p);
    row[b] = p->cache_batch_idx.ndim ? index_at(&p->cache_batch_idx, b, 0) : b;
    keys += end[b] - lo[b];
  }
  ab_par_status st = {AB_OK, err};
  const double bytes = kv_bytes(p, keys);
  const int dram = from_dram(note_call(p->k_cache.data, (int64_t)bytes));
  /* tiles for every call they serve on a path whose kernel has them (not by a rule of the working set, as the
   * prefetch rules go: the tiles change the bits); not where prepare_q sent the call to the float32 products */
  const int am = bf && tiles, amr = bf && rows_tiles;
  const int64_t hg = heads_per_item(p, threads);
  const int64_t G = p->Hq / p->Hkv, block_size = paged(p) ? p->k_cache.sizes[1] : 0;
  const uint32_t rule = (keys_next(dram) ? AB_TUNE_KEYS_NEXT : 0) | (values_ahead() ? AB_TUNE_VALUES_AHEAD : 0) |
                        (pages_ahead(dram) ? AB_TUNE_PAGES_AHEAD : 0) | (pv_keys() ? AB_TUNE_PV_KEYS : 0) |
                        (bf && !am && scores_by_head(dram, block_size) ? AB_TUNE_SCORES_BY_HEAD : 0);
  const ab_decode_tune_kind kind = {(int32_t)ab_cpu_isa_get(), (int32_t)p->k_cache.dtype, bf + am + 2 * amr,
                                    (int32_t)block_size,
                                    (int32_t)G, p->Sq == 1};
  ab_decode_tune_ticket ticket;
  const uint32_t set = ab_decode_tune_begin(&kind, rule, tune(dram) && keys > 0 && !amr ? tunable(p, bf, am, hg) : 0,
                                              &ticket);
  ab_decode_run run = {p, (const float*)ws, qb, nsplit > 1 ? (float*)(ws + part_at) : NULL, lo, end, row, dpad,
                       G, hg, nsplit, block_size, (int32_t)p->k_cache.dtype,
                       bf, sink, &st, !!(set & AB_TUNE_KEYS_NEXT), !!(set & AB_TUNE_VALUES_AHEAD),
                       !!(set & AB_TUNE_PAGES_AHEAD), bf && !!(set & AB_TUNE_SCORES_BY_HEAD), !bf && four_keys(p, dram),
                       !bf && pv_wide(), !bf && pv_pairs(), !!(set & AB_TUNE_PV_KEYS), bf && !am && softmax_keys(),
                       keys_ahead(dram),
                       (float)ldexp(p->scale, -qexp), am, amr, mha_runs(table, p, am, amr, keys)};
  const double work = 2.0 * (double)keys * (double)p->Hq * (double)p->Sq * (double)p->D;
  const double t0 = ticket.round >= 0 ? seconds_now() : 0.0;
  TRY(ab_par_run(pool, p->B * (p->Hkv / hg) * nsplit, 1, work, table->attend, &run, &st));
  if (ticket.round >= 0) ab_decode_tune_end(&ticket, (seconds_now() - t0) / (bytes > 0.0 ? bytes : 1.0));
  if (nsplit > 1) TRY(ab_par_run(pool, p->B * p->Hq, 1, work, merge, &run, &st));
  return AB_OK;
}
