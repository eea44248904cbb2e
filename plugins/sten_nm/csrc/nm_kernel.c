/* sten_nm driver: ISA selection, threading (OpenMP, else pthreads), packing, conversions. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE   /* dladdr */
#endif
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nm_isa.h"
#include "nm_transpose.h"

/* ---------------------------------------------------------------- ISA ---- */
static const nm_isa_table *g_table = NULL;

static const nm_isa_table *pick_table(void)
{
    const char *env = getenv("STEN_NM_ISA");
    if (env && *env && nm_set_isa(env) == 0) return g_table;
#ifdef STEN_NM_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return &nm_table_avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &nm_table_avx2;
#endif
    return &nm_table_generic;
}

static const nm_isa_table *table(void)
{
    if (!g_table) g_table = pick_table();
    return g_table;
}

const char *nm_isa(void) { return table()->name; }

int nm_set_isa(const char *name)
{
    if (strcmp(name, "generic") == 0) { g_table = &nm_table_generic; return 0; }
#ifdef STEN_NM_X86
    __builtin_cpu_init();
    if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        g_table = &nm_table_avx2; return 0;
    }
    if (strcmp(name, "avx512") == 0 && __builtin_cpu_supports("avx512f")) {
        g_table = &nm_table_avx512; return 0;
    }
#endif
    return -1;
}

int nm_index_bits(int32_t m)
{
    int b = 1;
    while ((1 << b) < m) b++;
    return b;
}

int nm_index_per_word(int32_t m) { return 32 / nm_index_bits(m); }

/* ------------------------------------------------------------ threads ---- */
typedef void (*task_fn)(void *arg, int tid, int nth);

/* Threads of our own (the fallback): created per call, joined at its end. */
typedef struct { task_fn fn; void *arg; int tid, nth; } task_t;

static void *task_main(void *p)
{
    task_t *t = (task_t *)p;
    t->fn(t->arg, t->tid, t->nth);
    return NULL;
}

static void run_pthreads(int nth, task_fn fn, void *arg)
{
    pthread_t th[256];
    task_t tasks[256];
    int started[256];
    if (nth > 256) nth = 256;
    for (int i = 1; i < nth; i++) {
        tasks[i].fn = fn; tasks[i].arg = arg; tasks[i].tid = i; tasks[i].nth = nth;
        started[i] = pthread_create(&th[i], NULL, task_main, &tasks[i]) == 0;
        if (!started[i]) fn(arg, i, nth);   /* could not start: run it here */
    }
    fn(arg, 0, nth);
    for (int i = 1; i < nth; i++)
        if (started[i]) pthread_join(th[i], NULL);
}

/* Run fn(arg, tid, nth) for tid in [0, nth). With OpenMP (the normal build), in the
 * process's OpenMP pool: PyTorch's CPU builds load libgomp, and an extension that needs
 * libgomp.so.1 shares that copy, so the kernels run on PyTorch's own worker threads
 * instead of competing with them while they spin after an operator. Where the process has
 * a second OpenMP runtime (a torch wheel with a renamed libgomp), the Python side switches
 * to threads of our own (nm_set_threading("pthreads")): no second pool spinning. */
#ifdef _OPENMP
#include <dlfcn.h>
#include <omp.h>
static int g_use_omp = 1;

static void run_parallel(int nth, task_fn fn, void *arg)
{
    if (nth <= 1) { fn(arg, 0, 1); return; }
    if (!g_use_omp) { run_pthreads(nth, fn, arg); return; }
#pragma omp parallel num_threads(nth)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        for (int i = t; i < nth; i += T) fn(arg, i, nth);   /* all tasks, however many threads */
    }
}

const char *nm_openmp_library(void)
{
    Dl_info info;
    if (dladdr((void *)&omp_get_thread_num, &info) && info.dli_fname) return info.dli_fname;
    return "";
}
#else
static const int g_use_omp = 0;

static void run_parallel(int nth, task_fn fn, void *arg)
{
    if (nth <= 1) { fn(arg, 0, 1); return; }
    run_pthreads(nth, fn, arg);
}

const char *nm_openmp_library(void) { return NULL; }
#endif

const char *nm_threading(void) { return g_use_omp ? "openmp" : "pthreads"; }

int nm_set_threading(const char *name)
{
    if (strcmp(name, "pthreads") == 0) {
#ifdef _OPENMP
        g_use_omp = 0;
#endif
        return 0;
    }
    if (strcmp(name, "openmp") == 0) {
#ifdef _OPENMP
        g_use_omp = 1;
        return 0;
#endif
    }
    return -1;
}

static void split(int64_t total, int tid, int nth, int64_t *a, int64_t *b)
{
    int64_t q = total / nth, rem = total % nth;
    *a = tid * q + (tid < rem ? tid : rem);
    *b = *a + q + (tid < rem ? 1 : 0);
}

/* Dynamic scheduling: the next unit of work from a counter shared by the call's threads.
 * On a loaded machine a thread that is descheduled takes fewer units instead of holding
 * the whole call up (a static split waits for its slowest thread). */
static inline int64_t next_unit(int64_t *counter)
{
    return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
}

static int clamp_threads(int nthreads, double flops, int64_t units)
{
    int nth = nthreads < 1 ? 1 : nthreads;
    int64_t by_work = (int64_t)(flops / 2.0e5) + 1;   /* ~0.1 ms of work per thread at least */
    if (nth > by_work) nth = (int)by_work;
    if (nth > units) nth = (int)(units < 1 ? 1 : units);
    return nth;
}

static void *alloc64(size_t bytes)
{
    bytes = (bytes + 63) & ~(size_t)63;
    if (bytes == 0) bytes = 64;
    return aligned_alloc(64, bytes);
}

/* A large scratch buffer kept between calls (the packed x panel: 12 MB for x[1024, 3072]).
 * A fresh one costs a page fault per 4 KiB page on every call (~1/4 of the paper format's
 * forward at 1:10); the one cached buffer is taken by one call at a time (an atomic
 * exchange: concurrent calls allocate their own) and the larger one is kept on return. */
typedef struct { size_t cap; char pad[56]; } scratch_head;
static scratch_head *scratch_slot;

static void *scratch_take(size_t bytes)
{
    scratch_head *h = __atomic_exchange_n(&scratch_slot, NULL, __ATOMIC_ACQ_REL);
    if (h && h->cap >= bytes) return h + 1;
    free(h);
    h = (scratch_head *)alloc64(sizeof(scratch_head) + bytes);
    if (!h) return NULL;
    h->cap = bytes;
    return h + 1;
}

static void scratch_give(void *p)
{
    if (!p) return;
    scratch_head *h = (scratch_head *)p - 1;
    scratch_head *old = __atomic_exchange_n(&scratch_slot, h, __ATOMIC_ACQ_REL);
    if (!old) return;
    if (old->cap > h->cap) {   /* keep the larger of the two */
        scratch_head *back = __atomic_exchange_n(&scratch_slot, old, __ATOMIC_ACQ_REL);
        old = back;
    }
    free(old);
}

/* --------------------------------------------------------------- panels -- */
/* Pack X[B][C] (row stride ldx) into [nbc][Cpad][bch], transposed, zero padded. */
typedef struct {
    const float *X; int64_t ldx, B, C, Cpad, nbc, bch; float *xp; int64_t next;
    const uint16_t *X16; int err;   /* X16: X is bfloat16 bits, widened while packing */
} pack_args;

/* 4-float vectors (SSE2 on x86-64, NEON on arm64), 4-byte aligned: any float offset. */
typedef float v4u __attribute__((vector_size(16), aligned(4)));
typedef float v4 __attribute__((vector_size(16)));
/* two-vector shuffle: clang and GCC >= 12 have __builtin_shufflevector, older GCC __builtin_shuffle */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define NM_SHUF4(a, b, i, j, k, l) __builtin_shufflevector(a, b, i, j, k, l)
#else
typedef int32_t v4i __attribute__((vector_size(16)));
#define NM_SHUF4(a, b, i, j, k, l) __builtin_shuffle(a, b, (v4i){i, j, k, l})
#endif

/* d[k * ldd + i] = x[i * ldx + k] for i, k < 4. */
static inline void transpose4(const float *x, int64_t ldx, float *d, int64_t ldd)
{
    const v4 a = *(const v4u *)x, b = *(const v4u *)(x + ldx);
    const v4 c = *(const v4u *)(x + 2 * ldx), e = *(const v4u *)(x + 3 * ldx);
    const v4 t0 = NM_SHUF4(a, b, 0, 4, 1, 5), t1 = NM_SHUF4(a, b, 2, 6, 3, 7);
    const v4 t2 = NM_SHUF4(c, e, 0, 4, 1, 5), t3 = NM_SHUF4(c, e, 2, 6, 3, 7);
    *(v4u *)d = NM_SHUF4(t0, t2, 0, 1, 4, 5);
    *(v4u *)(d + ldd) = NM_SHUF4(t0, t2, 2, 3, 6, 7);
    *(v4u *)(d + 2 * ldd) = NM_SHUF4(t1, t3, 0, 1, 4, 5);
    *(v4u *)(d + 3 * ldd) = NM_SHUF4(t1, t3, 2, 3, 6, 7);
}

#ifdef STEN_NM_X86
#include <immintrin.h>
/* pack_panel's whole-chunk case with AVX 8 x 8 transposes (bch % 8 == 0; only where the
 * AVX2 or AVX-512 table runs): blocks of 16 columns from c0 while they fit below cend;
 * returns the first column left (for the 4 x 4 / scalar code). Three shuffle stages per 64
 * floats instead of two per 16: packing 768x3072's x for 1:10 took 14 % of the paper-format
 * forward with 4 x 4 transposes (1.25-1.42 ms per call, pack and store, 1 thread), 0.88-1.17 ms
 * with these; a plain copy of the same bytes takes 0.6. */
__attribute__((target("avx2"))) static int64_t pack_panel_avx8(const float *X, int64_t ldx, int64_t b0,
                                                                int64_t bch, int64_t c0, int64_t cend,
                                                                float *dst)
{
    int64_t c = c0;
    for (; c + 16 <= cend; c += 16)
        for (int64_t bi = 0; bi < bch; bi += 8) {
            const float *x = X + (b0 + bi) * ldx + c;
            if (c + 48 <= cend)
                for (int r = 0; r < 8; r++) __builtin_prefetch(x + r * ldx + 32);
            for (int h = 0; h < 16; h += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(x + i * ldx + h);
                store_transposed8(r, dst + (c + h - c0) * bch + bi, bch, NULL);
            }
        }
    return c;
}

/* pack_panel_avx8 on bfloat16 bits (nm_bf16_pack.h), each row's 8 columns widened in
 * registers (zero-extend, shift into the high half: exact) on their way into the transpose:
 * one pass that reads half the bytes, instead of widening into a tile and transposing that
 * (the exact forward with bf16 x at 768x3072 1:10 ran 0.90x its float32 time with the tile). */
__attribute__((target("avx2"))) static int64_t pack_panel_bf16_avx8(const uint16_t *X, int64_t ldx, int64_t b0,
                                                                     int64_t bch, int64_t c0, int64_t cend,
                                                                     int64_t C, float *dst)
{
    int64_t c = c0;
    for (; c + 16 <= cend; c += 16)
        for (int64_t bi = 0; bi < bch; bi += 8) {
            const uint16_t *x = X + (b0 + bi) * ldx + c;
            if (c + 80 <= C)   /* two lines ahead in the row (past a caller's column range too) */
                for (int r = 0; r < 8; r++) __builtin_prefetch(x + r * ldx + 64);
            for (int h = 0; h < 16; h += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) {
                    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(x + i * ldx + h));
                    r[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
                }
                store_transposed8(r, dst + (c + h - c0) * bch + bi, bch, NULL);
            }
        }
    return c;
}
#endif

/* dst[c - c0][bi] = X[b0 + bi][c] for bi < bch, c in [c0, c1) (0 past B or C). */
static void pack_panel(const float *X, int64_t ldx, int64_t B, int64_t C, int64_t b0, int64_t bch,
                       int64_t c0, int64_t c1, float *dst)
{
    const int64_t cend = c1 < C ? c1 : C;
    if (b0 + bch <= B && bch % 4 == 0) {          /* whole chunk: 4 x 4 tile transposes */
        int64_t c = c0;
#ifdef STEN_NM_X86
        if (bch % 8 == 0 && table()->vw >= 8) c = pack_panel_avx8(X, ldx, b0, bch, c0, cend, dst);
#endif
        /* blocks of 16 columns (one cache line of each row, read whole while it is in L1;
         * the destination block, 16 x bch floats, stays in L1), each row's next lines
         * fetched ahead: the bch rows are too many streams for the hardware prefetcher */
        for (; c + 16 <= cend; c += 16)
            for (int64_t bi = 0; bi < bch; bi += 4) {
                const float *x = X + (b0 + bi) * ldx + c;
                if (c + 48 <= cend)
                    for (int r = 0; r < 4; r++) __builtin_prefetch(x + r * ldx + 32);
                for (int64_t cc = 0; cc < 16; cc += 4)
                    transpose4(x + cc, ldx, dst + (c + cc - c0) * bch + bi, bch);
            }
        for (; c + 4 <= cend; c += 4)
            for (int64_t bi = 0; bi < bch; bi += 4) {
                const float *x = X + (b0 + bi) * ldx + c;
                transpose4(x, ldx, dst + (c - c0) * bch + bi, bch);
            }
        for (; c < cend; c++)
            for (int64_t bi = 0; bi < bch; bi++) dst[(c - c0) * bch + bi] = X[(b0 + bi) * ldx + c];
    } else if (b0 + bch <= B && bch == NM_MB) {          /* full 6-row panel (grouped kernel) */
        const float *x = X + b0 * ldx;
        for (int64_t c = c0; c < cend; c++) {
            float *o = dst + (c - c0) * NM_MB;
            o[0] = x[c]; o[1] = x[ldx + c]; o[2] = x[2 * ldx + c];
            o[3] = x[3 * ldx + c]; o[4] = x[4 * ldx + c]; o[5] = x[5 * ldx + c];
        }
    } else {
        for (int64_t c = c0; c < cend; c++)
            for (int64_t bi = 0; bi < bch; bi++)
                dst[(c - c0) * bch + bi] = b0 + bi < B ? X[(b0 + bi) * ldx + c] : 0.0f;
    }
    for (int64_t c = cend > c0 ? cend : c0; c < c1; c++)
        for (int64_t bi = 0; bi < bch; bi++) dst[(c - c0) * bch + bi] = 0.0f;
}

#include "nm_bf16_pack.h"

/* Element i of an operand given as float32 (x16 NULL) or as bfloat16 bits (x16), widened exactly. */
static inline float ld_f32_or_bf16(const float *x, const uint16_t *x16, int64_t i)
{
    if (!x16) return x[i];
    const uint32_t u = (uint32_t)x16[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void pack_task(void *p, int tid, int nth)
{
    pack_args *a = (pack_args *)p;
    (void)tid; (void)nth;
    float *tile = NULL;   /* bf16 X: the rows' widened segments */
    /* units of 64 columns (dynamic): the rows' segments stay in L1 while a panel is written */
    for (int64_t u; (u = next_unit(&a->next)) * 64 < a->Cpad;) {
        const int64_t c0 = u * 64, c1 = c0 + 64 < a->Cpad ? c0 + 64 : a->Cpad;
        if (a->X16 && !tile && !(tile = (float *)alloc64((size_t)(NM_BF16_PC * a->bch) * sizeof(float)))) {
            a->err = -3;
            return;
        }
        for (int64_t bc = 0; bc < a->nbc; bc++) {
            float *dst = a->xp + (bc * a->Cpad + c0) * a->bch;
            if (a->X16)
                pack_panel_bf16(a->X16, a->ldx, a->B, a->C, bc * a->bch, a->bch, c0, c1, tile, dst);
            else
                pack_panel(a->X, a->ldx, a->B, a->C, bc * a->bch, a->bch, c0, c1, dst);
        }
    }
    free(tile);
}

static int choose_nv(int64_t B, int vw, int *nvi)
{
    /* vectors per batch chunk: as few as needed for small batches, else 8 (4 for 16-wide). */
    int maxnv = vw >= 16 ? 4 : 8;
    int nv = 1, i = 0;
    while (nv < maxnv && (int64_t)nv * vw < B) { nv *= 2; i++; }
    *nvi = i;
    return nv;
}

/* The float32 panel of X (float32, or bfloat16 bits when x16: widened while packing) in a
 * fresh buffer (scratch 0: the caller frees it) or the cached scratch one (scratch_give). */
static float *make_panel_x(const void *X, int x16, int64_t ldx, int64_t B, int64_t C, int64_t Cpad,
                           int64_t bch, int64_t *nbc_out, int nth, int scratch)
{
    const int64_t nbc = (B + bch - 1) / bch;
    const size_t bytes = (size_t)(nbc * Cpad * bch) * sizeof(float);
    float *xp = (float *)(scratch ? scratch_take(bytes) : alloc64(bytes));
    if (!xp) return NULL;
    pack_args pa = {x16 ? NULL : (const float *)X, ldx, B, C, Cpad, nbc, bch, xp, 0,
                    x16 ? (const uint16_t *)X : NULL, 0};
    int pth = nth;
    if ((Cpad + 63) / 64 < pth) pth = (int)((Cpad + 63) / 64);
    run_parallel(pth, pack_task, &pa);
    if (pa.err) {
        if (scratch) scratch_give(xp); else free(xp);
        return NULL;
    }
    *nbc_out = nbc;
    return xp;
}

static float *make_panel_in(const float *X, int64_t ldx, int64_t B, int64_t C, int64_t Cpad,
                            int64_t bch, int64_t *nbc_out, int nth, int scratch)
{
    return make_panel_x(X, 0, ldx, B, C, Cpad, bch, nbc_out, nth, scratch);
}

/* the panel in a fresh buffer (the caller frees it) */
static float *make_panel(const float *X, int64_t ldx, int64_t B, int64_t C, int64_t Cpad,
                         int64_t bch, int64_t *nbc_out, int nth)
{
    return make_panel_in(X, ldx, B, C, Cpad, bch, nbc_out, nth, 0);
}

static int64_t env_int(const char *name, int64_t dflt)
{
    const char *s = getenv(name);
    if (!s || !*s) return dflt;
    long v = strtol(s, NULL, 10);
    return v > 0 ? v : dflt;
}

/* groups per column block: keep the panel block (block columns x bch floats) within ~L1. */
static int64_t block_groups(const nm_mat *A, int64_t bch)
{
    int64_t cols = env_int("STEN_NM_BLOCK_BYTES", 16 * 1024) / (bch * 4);
    int64_t g = cols / A->m;
    if (g < 1) g = 1;
    /* keep at least ~32 kept values per block so the per-row overhead is amortised */
    int64_t gmin = (32 + A->n - 1) / A->n;
    if (g < gmin) g = gmin;
    return g;
}

/* An empty contraction: every output row is the bias (or 0). Y is [B, R], leading dimension ldy. */
static void fill_with_bias(float *Y, int64_t B, int64_t R, int64_t ldy, const float *bias)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < R; r++) Y[b * ldy + r] = bias ? bias[r] : 0.0f;
}

static int check_mat(const nm_mat *A)
{
    if (!A || A->n < 1 || A->m < 2 || A->n >= A->m || A->m > 32 || A->R < 0 || A->C < 0) return -1;
    if (A->bits != nm_index_bits(A->m) || A->per != nm_index_per_word(A->m)) return -1;
    if (A->G != (A->C + A->m - 1) / A->m || A->iw != (A->G * A->n + A->per - 1) / A->per) return -1;
    return 0;
}

/* ---------------------------------------------------------------- gather -- */
typedef struct {
    const nm_mat *A; const float *xp; int64_t Cpad, nbc, B; float *Y; int64_t ldy;
    const float *bias; int64_t kbg, bch; nm_gather_fn fn; int err; int64_t next; int64_t rows;
    uint16_t *Y16;   /* bf16 output (Y NULL then): each unit rounded while in cache (nm_bf16.h) */
} gather_args;

static void gather_task(void *p, int tid, int nth)
{
    gather_args *a = (gather_args *)p;
    (void)tid; (void)nth;
    float *ytmp = NULL;
    int32_t *offs = NULL;
    /* units of a->rows rows, taken dynamically */
    const int64_t rows = a->rows;
    for (int64_t u; (u = next_unit(&a->next)) * rows < a->A->R;) {
        if (!ytmp) {
            ytmp = (float *)alloc64((size_t)(NM_ROWS * a->bch) * sizeof(float));
            offs = (int32_t *)alloc64((size_t)(rows * a->A->G * a->A->n) * sizeof(int32_t));
            if (!ytmp || !offs) { free(ytmp); free(offs); a->err = -3; return; }
        }
        const int64_t r0 = u * rows, r1 = r0 + rows < a->A->R ? r0 + rows : a->A->R;
        a->fn(a->A, a->xp, a->Cpad, a->nbc, a->B, a->Y, a->ldy, a->bias, r0, r1, ytmp, offs, a->kbg);
    }
    free(ytmp); free(offs);
}

/* The L2 cache's size (per core), read at run time; 512 KiB where the system does not say. */
static long l2_bytes(void)
{
    long l2 = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return l2 < 128 * 1024 || l2 > 64L * 1024 * 1024 ? 512 * 1024 : l2;
}

/* Rows per unit of the exact forward (a multiple of NM_ROWS): their kept values and
 * decoded offsets (8 bytes per kept value) beside one batch chunk's panel in the L2 cache
 * (size read at run time), so every block of NM_ROWS rows of the unit reads the panel from
 * L2 instead of the whole panel (all batch chunks) streaming from L3 once per 32 rows;
 * at least 4 units per thread (a panel that crowds L2: below). STEN_NM_GATHER_ROWS overrides (experiments). */
static int64_t gather_rows(const nm_mat *A, int64_t Cpad, int64_t bch, int nth)
{
    const long l2 = l2_bytes();
    const int64_t per_row = A->G * A->n * 8, panel = Cpad * bch * 4;
    int64_t rows = ((int64_t)l2 * 7 / 8 - panel) / (per_row > 0 ? per_row : 1);
    /* a panel that crowds L2 (large K: 768x3072 makes it 770 KiB) leaves room for few rows,
     * and then the panel streams from L3 once per unit: take as many rows as balance that
     * against the rows' values streaming from L3 once per batch chunk (1:10 at 768x3072:
     * 96 rows instead of 32 measured 1.4x) */
    if (rows * per_row < panel && per_row > 0) rows = panel / per_row;
    rows = rows / NM_ROWS * NM_ROWS;
    while (rows > NM_ROWS && (A->R + rows - 1) / rows < 4 * (int64_t)nth) rows -= NM_ROWS;
    if (getenv("STEN_NM_GATHER_ROWS")) rows = (env_int("STEN_NM_GATHER_ROWS", NM_ROWS) + NM_ROWS - 1) / NM_ROWS * NM_ROWS;
    return rows < NM_ROWS ? NM_ROWS : rows;
}

/* nm_gather_f32 on X float32 or bfloat16 bits (x16: widened while packing the panel) */
/* The exact forward's driver: x (float32, or bf16 when x16) packed into the cached scratch panel,
 * then `task` over units of gather_rows rows on at most `max_threads` threads (gather_task for
 * float32 values, bf16_gather_task for bf16 ones). */
static int gather_driver(const nm_mat *A, int64_t B, const void *X, int x16, int64_t ldx, float *Y, uint16_t *Y16,
                         int64_t ldy, const float *bias, int nthreads, task_fn task, int64_t max_threads)
{
    if (check_mat(A) || B < 0) return -1;
    if (B == 0 || A->R == 0) return 0;
    if (A->C == 0) {
        fill_with_bias(Y, B, A->R, ldy, bias);
        return 0;
    }
    const nm_isa_table *T = table();
    int nvi; const int64_t bch = (int64_t)choose_nv(B, T->vw, &nvi) * T->vw;
    const int64_t Cpad = A->G * A->m;
    int nth = clamp_threads(nthreads, 2.0 * B * A->R * A->G * A->n, max_threads);
    int64_t nbc;
    float *xp = make_panel_x(X, x16, ldx, B, A->C, Cpad, bch, &nbc, nth, 1);   /* scratch_give */
    if (!xp) return -3;
    gather_args ga = {A, xp, Cpad, nbc, B, Y, ldy, bias, block_groups(A, bch), bch, T->gather[nvi], 0, 0,
                      gather_rows(A, Cpad, bch, nth), Y16};
    run_parallel(nth, task, &ga);
    scratch_give(xp);
    return ga.err;
}

int nm_gather_f32(const nm_mat *A, int64_t B, const float *X, int64_t ldx, float *Y, int64_t ldy,
                  const float *bias, int nthreads)
{
    return gather_driver(A, B, X, 0, ldx, Y, NULL, ldy, bias, nthreads, gather_task, A->R);
}

int nm_gather_bf16x(const nm_mat *A, int64_t B, const uint16_t *X, int64_t ldx, float *Y, int64_t ldy,
                    const float *bias, int nthreads)
{
    return gather_driver(A, B, X, 1, ldx, Y, NULL, ldy, bias, nthreads, gather_task, A->R);
}

/* ------------------------------------------------- transposed (CSR) gather -- */
typedef struct {
    const int64_t *rowptr; const int32_t *toff; const float *tv; const float *yp; int64_t R, C, nbc, B;
    float *X; int64_t ldx; const float *bias; int64_t bch, kbr; nm_cgather_fn fn; int err;
} cgather_args;

static void cgather_task(void *p, int tid, int nth)
{
    cgather_args *a = (cgather_args *)p;
    int64_t c0, c1;
    split(a->C, tid, nth, &c0, &c1);
    if (c1 <= c0) return;
    float *ytmp = (float *)alloc64((size_t)(NM_ROWS * a->bch) * sizeof(float));
    int64_t *cur = (int64_t *)alloc64((size_t)NM_ROWS * sizeof(int64_t));
    if (!ytmp || !cur) { free(ytmp); free(cur); a->err = -3; return; }
    a->fn(a->rowptr, a->toff, a->tv, c0, c1, a->yp, a->R, a->nbc, a->B, a->X, a->ldx, a->bias,
          ytmp, cur, a->kbr);
    free(ytmp); free(cur);
}

/* X[b][c] = sum_r A[r][c] Y[b][r] (+ bias[c]) through the transpose of A (CSR, built here):
 * register accumulation like the forward, instead of read-modify-write of X. */
/* nm_tgather_f32 on Y float32 or bfloat16 bits (y16: widened while packing its panel). */
static int tgather_driver(const nm_mat *A, int64_t B, const void *Y, int y16, int64_t ldy, float *X, int64_t ldx,
                          const float *bias, int nthreads)
{
    if (check_mat(A) || B < 0) return -1;
    if (B == 0 || A->C == 0) return 0;
    if (A->R == 0 || A->G * A->n == 0) {   /* empty contraction: X = bias (or 0) */
        fill_with_bias(X, B, A->C, ldx, bias);
        return 0;
    }
    const int64_t R = A->R, C = A->C, gn = A->G * A->n;
    const nm_isa_table *T = table();
    int nvi; const int64_t bch = (int64_t)choose_nv(B, T->vw, &nvi) * T->vw;
    int64_t *rowptr = (int64_t *)calloc((size_t)C + 1, sizeof(int64_t));
    int32_t *cols = (int32_t *)alloc64((size_t)(R * gn > 0 ? R * gn : 1) * sizeof(int32_t));
    int32_t *toff = (int32_t *)alloc64((size_t)(R * gn > 0 ? R * gn : 1) * sizeof(int32_t));
    float *tv = (float *)alloc64((size_t)(R * gn > 0 ? R * gn : 1) * sizeof(float));
    if (!rowptr || !cols || !toff || !tv) { free(rowptr); free(cols); free(toff); free(tv); return -3; }
    nm_decode(A, 0, R, 0, A->G, 1, cols);                 /* column of every slot */
    for (int64_t i = 0; i < R * gn; i++)
        if (cols[i] < C) rowptr[cols[i] + 1]++;
    for (int64_t c = 0; c < C; c++) rowptr[c + 1] += rowptr[c];
    {
        int64_t *fill = (int64_t *)malloc((size_t)(C > 0 ? C : 1) * sizeof(int64_t));
        if (!fill) { free(rowptr); free(cols); free(toff); free(tv); return -3; }
        memcpy(fill, rowptr, (size_t)C * sizeof(int64_t));
        for (int64_t r = 0; r < R; r++)                   /* rows in order: sorted by src */
            for (int64_t j = 0; j < gn; j++) {
                const int32_t c = cols[r * gn + j];
                if (c >= C) continue;
                const int64_t p = fill[c]++;
                toff[p] = (int32_t)(r * bch);
                tv[p] = A->vals[r * gn + j];
            }
        free(fill);
    }
    free(cols);
    int nth = clamp_threads(nthreads, 2.0 * B * R * gn, C);
    int64_t nbc;
    float *yp = make_panel_x(Y, y16, ldy, B, R, R, bch, &nbc, nth, 0);
    if (!yp) { free(rowptr); free(toff); free(tv); return -3; }
    int64_t kbr = env_int("STEN_NM_BLOCK_BYTES", 16 * 1024) / (bch * 4);
    if (kbr < 1) kbr = 1;
    cgather_args ca = {rowptr, toff, tv, yp, R, C, nbc, B, X, ldx, bias, bch, kbr, T->cgather[nvi], 0};
    run_parallel(nth, cgather_task, &ca);
    free(yp); free(rowptr); free(toff); free(tv);
    return ca.err;
}

int nm_tgather_f32(const nm_mat *A, int64_t B, const float *Y, int64_t ldy, float *X, int64_t ldx,
                   const float *bias, int nthreads)
{
    return tgather_driver(A, B, Y, 0, ldy, X, ldx, bias, nthreads);
}

/* --------------------------------------------------------------- scatter -- */
typedef struct {
    const nm_mat *A; const float *yp; int64_t nbc, B; float *X; int64_t ldx;
    const float *bias; int64_t kbg, bch; nm_scatter_fn fn; int err;
} scatter_args;

static void scatter_task(void *p, int tid, int nth)
{
    scatter_args *a = (scatter_args *)p;
    int64_t g0, g1;
    split(a->A->G, tid, nth, &g0, &g1);
    if (g1 <= g0) return;
    float *acc = (float *)alloc64((size_t)(a->kbg * a->A->m * a->bch) * sizeof(float));
    int32_t *offs = (int32_t *)alloc64((size_t)(a->A->R * a->kbg * a->A->n) * sizeof(int32_t));
    if (!acc || !offs) { free(acc); free(offs); a->err = -3; return; }
    a->fn(a->A, a->yp, a->nbc, a->B, a->X, a->ldx, a->bias, g0, g1, acc, offs, a->kbg);
    free(acc); free(offs);
}

int nm_scatter_f32(const nm_mat *A, int64_t B, const float *Y, int64_t ldy, float *X, int64_t ldx,
                   const float *bias, int nthreads)
{
    if (check_mat(A) || B < 0) return -1;
    if (B == 0 || A->C == 0) return 0;
    if (A->R == 0) {
        fill_with_bias(X, B, A->C, ldx, bias);
        return 0;
    }
    const nm_isa_table *T = table();
    int nvi; const int64_t bch = (int64_t)choose_nv(B, T->vw, &nvi) * T->vw;
    int nth = clamp_threads(nthreads, 2.0 * B * A->R * A->G * A->n, A->G);
    int64_t nbc;
    float *yp = make_panel(Y, ldy, B, A->R, A->R, bch, &nbc, nth);
    if (!yp) return -3;
    scatter_args sa = {A, yp, nbc, B, X, ldx, bias, block_groups(A, bch), bch, T->scatter[nvi], 0};
    run_parallel(nth, scatter_task, &sa);
    free(yp);
    return sa.err;
}

/* ----------------------------------------------------------------- sddmm -- */
typedef struct {
    const nm_mat *A; const float *xp; int64_t Cpad; const float *yp; int64_t nbc;
    float *out; int64_t kbg; nm_sddmm_fn fn; int err; int64_t vw;
} sddmm_args;

static void sddmm_task(void *p, int tid, int nth)
{
    sddmm_args *a = (sddmm_args *)p;
    int64_t r0, r1;
    split(a->A->R, tid, nth, &r0, &r1);
    if (r1 <= r0) return;
    int32_t *offs = (int32_t *)alloc64((size_t)(NM_ROWS * a->A->G * a->A->n) * sizeof(int32_t));
    float *vacc = (float *)alloc64((size_t)(NM_ROWS * a->kbg * a->A->n * a->vw) * sizeof(float));
    if (!offs || !vacc) { free(offs); free(vacc); a->err = -3; return; }
    a->fn(a->A, a->xp, a->Cpad, a->yp, a->nbc, a->out, r0, r1, offs, a->kbg, vacc);
    free(offs); free(vacc);
}

/* nm_sddmm_f32 on Y and X each float32 or bfloat16 bits (y16, x16: widened while packing). */
static int sddmm_driver(const nm_mat *A, int64_t B, const void *Y, int y16, int64_t ldy, const void *X, int x16,
                        int64_t ldx, float *out, int nthreads)
{
    if (check_mat(A) || B < 0) return -1;
    const int64_t gn = A->G * A->n;
    if (A->R == 0 || gn == 0) return 0;
    if (B == 0) { memset(out, 0, (size_t)(A->R * gn) * sizeof(float)); return 0; }
    const nm_isa_table *T = table();
    int nvi; const int64_t bch = (int64_t)choose_nv(B, T->vw, &nvi) * T->vw;
    const int64_t Cpad = A->G * A->m;
    int nth = clamp_threads(nthreads, 2.0 * B * A->R * gn, A->R);
    int64_t nbc, nbc2;
    float *xp = make_panel_x(X, x16, ldx, B, A->C, Cpad, bch, &nbc, nth, 0);
    float *yp = make_panel_x(Y, y16, ldy, B, A->R, A->R, bch, &nbc2, nth, 0);
    if (!xp || !yp) { free(xp); free(yp); return -3; }
    sddmm_args sa = {A, xp, Cpad, yp, nbc, out, block_groups(A, bch), T->sddmm[nvi], 0, T->vw};
    run_parallel(nth, sddmm_task, &sa);
    free(xp); free(yp);
    return sa.err;
}

int nm_sddmm_f32(const nm_mat *A, int64_t B, const float *Y, int64_t ldy, const float *X,
                 int64_t ldx, float *out, int nthreads)
{
    return sddmm_driver(A, B, Y, 0, ldy, X, 0, ldx, out, nthreads);
}

/* --------------------------------------------------------------- grouped -- */
/* The kernel writes 6 x 16 tiles into T (a batch block's rows, columns in the grouped
 * order) with whole-vector stores; unpermute() then writes Y's rows in order. Writing
 * the permuted columns of Y straight from the registers costs one scattered store per
 * output (and cache-line ping-pong between threads); this way Y is written
 * sequentially. */
typedef struct {
    const nm_grouped *W; const int32_t *offs; const int32_t *inv;
    const float *X; int64_t ldx; const float *xp;
    int64_t Kpad, B, npan, kc, mcp; float *Y; int64_t ldy; const float *bias;
    float *T; int64_t ldt; nm_ggather_fn fn; int err;
    const uint16_t *X16;   /* bf16 x (X is NULL then): widened while packing */
    uint16_t *Y16;         /* bf16 output (Y is NULL then): rows rounded as they are written */
} ggather_args;

static void round_span(const float *y, uint16_t *y16, int64_t n);   /* nm_bf16.h */

/* Micro-panel b6 of x (rows b6 * 6 .. + 6), columns [c0, c1) into dst ([c - c0][6]); bf16 x
 * widened on the way through tile (NM_MB * NM_BF16_PC floats), NM_BF16_PC columns at a time. */
static void gpack(const ggather_args *a, int64_t b6, int64_t c0, int64_t c1, float *tile, float *dst)
{
    if (!a->X16) {
        pack_panel(a->X, a->ldx, a->B, a->W->K, b6 * NM_MB, NM_MB, c0, c1, dst);
        return;
    }
    pack_panel_bf16(a->X16, a->ldx, a->B, a->W->K, b6 * NM_MB, NM_MB, c0, c1, tile, dst);
}

/* The per-thread tile gpack needs (NULL for float32 x; *err = -3 when out of memory). */
static float *gpack_tile(const ggather_args *a, int *err)
{
    if (!a->X16) return NULL;
    float *t = (float *)alloc64((size_t)(NM_MB * NM_BF16_PC) * sizeof(float));
    if (!t) *err = -3;
    return t;
}

/* Y[b][r] = T[b - b0][inv[r]] (+ bias[r]) for rows b in [b0, b1). */
static void unpermute(ggather_args *a, const float *T, int64_t b0, int64_t b1)
{
    const nm_unperm_fn fn = table()->unperm;
    if (!a->Y16) {
        for (int64_t b = b0; b < b1; b++) fn(T + (b - b0) * a->ldt, a->inv, a->bias, a->W->N, a->Y + b * a->ldy);
        return;
    }
    /* bf16 output: each row put in order into an L1 buffer, then rounded into Y16 */
    float *row = (float *)alloc64((size_t)(a->W->N > 0 ? a->W->N : 1) * sizeof(float));
    if (!row) { a->err = -3; return; }
    for (int64_t b = b0; b < b1; b++) {
        fn(T + (b - b0) * a->ldt, a->inv, a->bias, a->W->N, row);
        round_span(row, a->Y16 + b * a->ldy, a->W->N);
    }
    free(row);
}

/* Many batch rows: each thread takes a range of micro-panels, block by block (mcp
 * panels), and chunk by chunk of kept slots (kc, whole groups of m columns): it packs
 * the block's x columns of the chunk (they stay in L2; the chunk's weights of one row
 * group stay in L1), runs all row groups into its own T, then writes the block's rows. */
static void ggather_rows_task(void *p, int tid, int nth)
{
    ggather_args *a = (ggather_args *)p;
    const nm_grouped *W = a->W;
    const int64_t gn = (W->K + W->m - 1) / W->m * W->n, ccols = a->kc / W->n * W->m;
    int64_t pa, pb;
    split(a->npan, tid, nth, &pa, &pb);
    if (pb <= pa) return;
    float *T = (float *)alloc64((size_t)(a->mcp * NM_MB * a->ldt) * sizeof(float));
    float *xb = (float *)alloc64((size_t)(a->mcp * NM_MB * ccols) * sizeof(float));
    int err = 0;
    float *tile = gpack_tile(a, &err);
    if (!T || !xb || err) { free(T); free(xb); free(tile); a->err = -3; return; }
    for (int64_t p0 = pa; p0 < pb; p0 += a->mcp) {
        const int64_t np = p0 + a->mcp < pb ? a->mcp : pb - p0;
        for (int64_t e0 = 0; e0 < gn; e0 += a->kc) {
            const int64_t e1 = e0 + a->kc < gn ? e0 + a->kc : gn;
            const int64_t c0 = e0 / W->n * W->m, c1 = e1 / W->n * W->m;
            for (int64_t i = 0; i < np; i++) gpack(a, p0 + i, c0, c1, tile, xb + i * NM_MB * (c1 - c0));
            a->fn(W, a->offs, xb, NM_MB * (c1 - c0), c0, np, e0, e1, 0, W->Q, T, a->ldt, e0 == 0);
        }
        const int64_t b1 = (p0 + np) * NM_MB < a->B ? (p0 + np) * NM_MB : a->B;
        unpermute(a, T, p0 * NM_MB, b1);
    }
    free(T); free(xb); free(tile);
}

/* Few batch rows: threads split the row groups; x packed whole, one shared T. */
static void ggather_groups_task(void *p, int tid, int nth)
{
    ggather_args *a = (ggather_args *)p;
    const int64_t gn = (a->W->K + a->W->m - 1) / a->W->m * a->W->n;
    int64_t q0, q1;
    split(a->W->Q, tid, nth, &q0, &q1);
    for (int64_t e0 = 0; q1 > q0 && e0 < gn; e0 += a->kc) {
        const int64_t e1 = e0 + a->kc < gn ? e0 + a->kc : gn;
        a->fn(a->W, a->offs, a->xp, a->Kpad * NM_MB, 0, a->npan, e0, e1, q0, q1, a->T, a->ldt,
              e0 == 0);
    }
}

static void unpermute_task(void *p, int tid, int nth)
{
    ggather_args *a = (ggather_args *)p;
    int64_t b0, b1;
    split(a->B, tid, nth, &b0, &b1);
    if (b1 > b0) unpermute(a, a->T + b0 * a->ldt, b0, b1);
}

static int check_grouped(const nm_grouped *W)
{
    if (!W || W->n < 1 || W->m < 2 || W->n >= W->m || W->m > 32 || W->N < 0 || W->K < 0) return -1;
    if (W->bits != nm_index_bits(W->m) || W->per != nm_index_per_word(W->m)) return -1;
    const int64_t gn = (W->K + W->m - 1) / W->m * W->n;
    if (W->Q != (W->N + NM_GR - 1) / NM_GR || W->iw != (gn + W->per - 1) / W->per) return -1;
    return 0;
}

/* Column (times scale) of every kept slot of every row group, [Q][G*n]; NULL when out of
 * memory. */
static int32_t *grouped_slot_columns(const nm_grouped *W, int64_t scale)
{
    const int64_t G = (W->K + W->m - 1) / W->m;
    int32_t *cols = (int32_t *)alloc64((size_t)(W->Q * G * W->n) * sizeof(int32_t));
    if (!cols) return NULL;
    const nm_mat pat = {W->Q, G * W->m, W->n, W->m, W->bits, W->per, G, W->iw, NULL, W->idx};
    nm_decode(&pat, 0, W->Q, 0, G, scale, cols);
    return cols;
}

/* Kept slots per chunk: at most `groups` whole groups of m columns (at least one), the G
 * groups cut into chunks of equal size. */
static int64_t equal_chunk_slots(int64_t G, int64_t groups, int n)
{
    if (groups < 1) groups = 1;
    const int64_t nchunks = (G + groups - 1) / groups;
    return (G + nchunks - 1) / nchunks * n;
}

/* The grouped forward driver around one kernel (fn: float32 values, or bf16 ones widened
 * in registers). */
/* What the grouped forward driver runs: the per-slot kernel, the tasks of its two schedules
 * (whole rows of panels per thread, or row groups over shared packed panels) and the default
 * packed-x bytes per block of panels (STEN_NM_GROUPED_PANEL_BYTES). The float32 and the bf16
 * scratch-buffer forwards differ only in these. */
typedef struct {
    nm_ggather_fn fn;
    void (*rows_task)(void *, int, int);
    void (*groups_task)(void *, int, int);
    int panel_bytes;
} grouped_schedule;

static int grouped_drive(const nm_grouped *W, int64_t B, const void *X, int x16, int64_t ldx,
                         float *Y, uint16_t *Y16, int64_t ldy, const float *bias, int nthreads,
                         const grouped_schedule *s)
{
    if (check_grouped(W) || B < 0) return -1;
    const int64_t G = (W->K + W->m - 1) / W->m, gn = G * W->n;
    if (B == 0 || W->N == 0) return 0;
    if (W->K == 0) {
        fill_with_bias(Y, B, W->N, ldy, bias);
        return 0;
    }
    const int64_t Q = W->Q, Kpad = G * W->m;
    /* offsets of every group's kept slots, and the grouped column of every row */
    int32_t *offs = grouped_slot_columns(W, NM_MB);
    int32_t *inv = (int32_t *)alloc64((size_t)W->N * sizeof(int32_t));
    if (!offs || !inv) { free(offs); free(inv); return -3; }
    for (int64_t r = 0; r < W->N; r++) inv[r] = -1;
    for (int64_t j = 0; j < Q * NM_GR; j++)
        if (W->perm[j] >= 0 && W->perm[j] < W->N) inv[W->perm[j]] = (int32_t)j;
    for (int64_t r = 0; r < W->N; r++)
        if (inv[r] < 0) { free(offs); free(inv); return -1; }   /* perm is not a permutation */
    const int nth = clamp_threads(nthreads, 2.0 * B * W->N * gn, Q * B);
    const int64_t npan = (B + NM_MB - 1) / NM_MB;
    ggather_args a = {W, offs, inv, x16 ? NULL : (const float *)X, ldx, NULL, Kpad, B, npan, 0, 0, Y, ldy,
                      bias, NULL, 0, s->fn, 0, x16 ? (const uint16_t *)X : NULL, Y16};
    /* chunks of kept slots: whole groups of m columns, about STEN_NM_GROUPED_KC slots,
     * equal sizes */
    a.kc = equal_chunk_slots(G, env_int("STEN_NM_GROUPED_KC", 512) / W->n, W->n);
    a.ldt = Q * NM_GR + NM_GR;   /* + one group: rows of T do not alias in L1 */
    /* panels per block: their packed x chunk (mcp * 6 * chunk columns) stays in L2 */
    a.mcp = env_int("STEN_NM_GROUPED_PANEL_BYTES", s->panel_bytes) / (a.kc / W->n * W->m * NM_MB * 4);
    if (a.mcp < 1) a.mcp = 1;
    if (npan >= 2 * (int64_t)nth || nth == 1) {
        run_parallel(nth, s->rows_task, &a);
    } else {
        int64_t np;
        float *xp = make_panel_x(X, x16, ldx, B, W->K, Kpad, NM_MB, &np, nth, 0);
        a.T = (float *)alloc64((size_t)(npan * NM_MB * a.ldt) * sizeof(float));
        a.xp = xp;
        if (!xp || !a.T) { a.err = -3; } else {
            run_parallel(nth, s->groups_task, &a);
            run_parallel(nth, unpermute_task, &a);
        }
        free(xp); free(a.T);
    }
    free(offs); free(inv);
    return a.err;
}

/* The float32 grouped forward around a per-slot kernel (table()->ggather, or ggather16 for
 * bf16 values widened in registers). */
static int grouped_gather_with(const nm_grouped *W, int64_t B, const void *X, int x16, int64_t ldx,
                               float *Y, uint16_t *Y16, int64_t ldy, const float *bias, int nthreads,
                               nm_ggather_fn fn)
{
    const grouped_schedule s = {fn, ggather_rows_task, ggather_groups_task, 128 * 1024};
    return grouped_drive(W, B, X, x16, ldx, Y, Y16, ldy, bias, nthreads, &s);
}

int nm_grouped_gather_f32(const nm_grouped *W, int64_t B, const float *X, int64_t ldx,
                          float *Y, int64_t ldy, const float *bias, int nthreads)
{
    return grouped_gather_with(W, B, X, 0, ldx, Y, NULL, ldy, bias, nthreads, table()->ggather);
}

int nm_grouped_gather_bf16x(const nm_grouped *W, int64_t B, const uint16_t *X, int64_t ldx,
                            float *Y, int64_t ldy, const float *bias, int nthreads)
{
    return grouped_gather_with(W, B, X, 1, ldx, Y, NULL, ldy, bias, nthreads, table()->ggather);
}

/* ------------------------------------------------ grouped weight gradient -- */
typedef struct {
    const nm_grouped *W; const float *dY; int64_t ldg; const float *X; int64_t ldx;
    int64_t B; const int32_t *cols; float *gq; float *xt; int64_t ldb; float *out;
    int64_t kb, kc; nm_gsddmm_fn fn; int err;
    const uint16_t *dY16, *X16;   /* bf16 dY / X (dY / X NULL then), widened while packing */
} gsddmm_args;

/* gq[q][b][j] = dY[b][perm[q*16 + j]] (0 for padding rows), groups split by thread;
 * xt[c][b] = X[b][c] (0 past K), columns split by thread (16 x 16 blocks). */
static void gsddmm_pack_task(void *p, int tid, int nth)
{
    gsddmm_args *a = (gsddmm_args *)p;
    const nm_grouped *W = a->W;
    int64_t q0, q1, c0, c1;
    split(W->Q, tid, nth, &q0, &q1);
    for (int64_t q = q0; q < q1; q++) {
        const int32_t *rows = W->perm + q * NM_GR;
        float *g = a->gq + q * a->B * NM_GR;
        for (int64_t b = 0; b < a->B; b++) {
            for (int j = 0; j < NM_GR; j++)
                g[b * NM_GR + j] = rows[j] >= 0 ? ld_f32_or_bf16(a->dY, a->dY16, b * a->ldg + rows[j]) : 0.0f;
        }
    }
    const int64_t Kpad = (W->K + W->m - 1) / W->m * W->m;
    split((Kpad + 15) / 16, tid, nth, &c0, &c1);
    for (int64_t cb = c0 * 16; cb < c1 * 16 && cb < Kpad; cb += 16) {
        const int64_t ce = cb + 16 < Kpad ? cb + 16 : Kpad, cx = ce < W->K ? ce : W->K;
        for (int64_t b0 = 0; b0 < a->B; b0 += 16) {
            const int64_t be = b0 + 16 < a->B ? b0 + 16 : a->B;
            for (int64_t b = b0; b < be; b++) {
                if (a->X16) {
                    const uint16_t *x = a->X16 + b * a->ldx;
                    for (int64_t c = cb; c < cx; c++) a->xt[c * a->ldb + b] = ld_f32_or_bf16(NULL, x, c);
                } else {
                    const float *x = a->X + b * a->ldx;
                    for (int64_t c = cb; c < cx; c++) a->xt[c * a->ldb + b] = x[c];
                }
                for (int64_t c = cx > cb ? cx : cb; c < ce; c++) a->xt[c * a->ldb + b] = 0.0f;
            }
        }
    }
}

/* Each thread owns a range of row groups; blocks of kb batch rows x chunks of kc
 * slots (whole groups of m columns: their x, kb x chunk columns, stays in L2). */
static void gsddmm_task(void *p, int tid, int nth)
{
    gsddmm_args *a = (gsddmm_args *)p;
    const nm_grouped *W = a->W;
    const int64_t gn = (W->K + W->m - 1) / W->m * W->n;
    int64_t q0, q1;
    split(W->Q, tid, nth, &q0, &q1);
    if (q1 <= q0) return;
    int32_t *cols = (int32_t *)alloc64((size_t)a->kc * sizeof(int32_t));
    if (!cols) { a->err = -3; return; }
    for (int64_t b0 = 0; b0 < a->B; b0 += a->kb) {
        const int64_t kb = b0 + a->kb < a->B ? a->kb : a->B - b0;
        for (int64_t e0 = 0; e0 < gn; e0 += a->kc) {
            const int64_t e1 = e0 + a->kc < gn ? e0 + a->kc : gn;
            for (int64_t q = q0; q < q1; q++) {
                for (int64_t e = e0; e < e1; e++) cols[e - e0] = a->cols[q * gn + e];
                a->fn(a->gq + (q * a->B + b0) * NM_GR, a->xt + b0, a->ldb, cols, e1 - e0, kb,
                      a->out + (q * gn + e0) * NM_GR, b0 == 0);
            }
        }
    }
    free(cols);
}

/* nm_grouped_sddmm_f32 on dY and X each float32 or bfloat16 bits (y16, x16). */
static int grouped_sddmm_driver(const nm_grouped *W, int64_t B, const void *dY, int y16, int64_t ldg,
                                const void *X, int x16, int64_t ldx, float *out, int nthreads)
{
    if (check_grouped(W) || B < 0) return -1;
    const int64_t G = (W->K + W->m - 1) / W->m, gn = G * W->n, Q = W->Q;
    if (Q == 0 || gn == 0) return 0;
    if (B == 0) { memset(out, 0, (size_t)(Q * gn * NM_GR) * sizeof(float)); return 0; }
    const int64_t ldb = (B + 15) / 16 * 16 + 16;   /* + 16: x's columns do not alias in L1 */
    int32_t *cols = grouped_slot_columns(W, 1);
    float *gq = (float *)alloc64((size_t)(Q * B * NM_GR) * sizeof(float));
    float *xt = (float *)alloc64((size_t)(G * W->m * ldb) * sizeof(float));
    if (!cols || !gq || !xt) { free(cols); free(gq); free(xt); return -3; }
    const int nth = clamp_threads(nthreads, 2.0 * B * W->N * gn, Q);
    gsddmm_args a = {W, y16 ? NULL : (const float *)dY, ldg, x16 ? NULL : (const float *)X, ldx, B, cols, gq, xt,
                     ldb, out, 0, 0, table()->gsddmm, 0, y16 ? (const uint16_t *)dY : NULL,
                     x16 ? (const uint16_t *)X : NULL};
    /* blocks of kb batch rows x chunks of kcg groups of m columns (kb x kcg*m floats of x) */
    a.kb = env_int("STEN_NM_GSDDMM_ROWS", 256);
    a.kc = equal_chunk_slots(G, env_int("STEN_NM_GSDDMM_BYTES", 192 * 1024) / (a.kb * 4 * W->m), W->n);
    run_parallel(nth, gsddmm_pack_task, &a);
    run_parallel(nth, gsddmm_task, &a);
    free(cols); free(gq); free(xt);
    return a.err;
}

int nm_grouped_sddmm_f32(const nm_grouped *W, int64_t B, const float *dY, int64_t ldg,
                         const float *X, int64_t ldx, float *out, int nthreads)
{
    return grouped_sddmm_driver(W, B, dY, 0, ldg, X, 0, ldx, out, nthreads);
}

/* -------------------------------------------------- grouped input gradient -- */
typedef struct {
    const nm_grouped *W; const float *dY; int64_t ldg; float *dX; int64_t ldx; int64_t B;
    const int32_t *cols; int64_t rows; nm_gtgather_fn fn; int err;
    const uint16_t *dY16;   /* bf16 dY (dY NULL then), widened while regrouping */
} gtgather_args;

/* Each thread takes a range of batch rows, block by block (rows, a multiple of the vector
 * width): dY's block regrouped and transposed (gyt [Q*16][rows]), every row group added
 * into dX's block transposed (gxt [Kpad][rows], in L2), then written back. */
static void gtgather_task(void *p, int tid, int nth)
{
    gtgather_args *a = (gtgather_args *)p;
    const nm_grouped *W = a->W;
    const int64_t G = (W->K + W->m - 1) / W->m, gn = G * W->n, Kpad = G * W->m;
    const int64_t ld = a->rows, vw = table()->vw;
    int64_t blk0, blk1;
    split((a->B + ld - 1) / ld, tid, nth, &blk0, &blk1);
    if (blk1 <= blk0) return;
    float *gyt = (float *)alloc64((size_t)(W->Q * NM_GR * ld) * sizeof(float));
    float *gxt = (float *)alloc64((size_t)(Kpad * ld) * sizeof(float));
    if (!gyt || !gxt) { free(gyt); free(gxt); a->err = -3; return; }
    for (int64_t blk = blk0; blk < blk1; blk++) {
        const int64_t b0 = blk * ld, nb = b0 + ld < a->B ? ld : a->B - b0;
        const int64_t nbv = (nb + vw - 1) / vw * vw;
        for (int64_t j = 0; j < W->Q * NM_GR; j++) {
            const int32_t r = W->perm[j];
            float *o = gyt + j * ld;
            for (int64_t bi = 0; bi < nbv; bi++)
                o[bi] = (r >= 0 && bi < nb) ? ld_f32_or_bf16(a->dY, a->dY16, (b0 + bi) * a->ldg + r) : 0.0f;
        }
        memset(gxt, 0, (size_t)(Kpad * ld) * sizeof(float));
        for (int64_t q = 0; q < W->Q; q++)
            a->fn(W->vals + q * gn * NM_GR, a->cols + q * gn, gn, gyt + q * NM_GR * ld, gxt, ld, nbv);
        for (int64_t bi = 0; bi < nb; bi++) {
            float *x = a->dX + (b0 + bi) * a->ldx;
            for (int64_t c = 0; c < W->K; c++) x[c] = gxt[c * ld + bi];
        }
    }
    free(gyt); free(gxt);
}

/* nm_grouped_tgather_f32 on dY float32 or bfloat16 bits (y16). */
static int grouped_tgather_driver(const nm_grouped *W, int64_t B, const void *dY, int y16, int64_t ldg,
                                  float *dX, int64_t ldx, int nthreads)
{
    if (check_grouped(W) || B < 0) return -1;
    const int64_t G = (W->K + W->m - 1) / W->m, gn = G * W->n;
    if (B == 0 || W->K == 0) return 0;
    if (W->N == 0) {
        for (int64_t b = 0; b < B; b++) memset(dX + b * ldx, 0, (size_t)W->K * sizeof(float));
        return 0;
    }
    int32_t *cols = grouped_slot_columns(W, 1);
    if (!cols) return -3;
    const int64_t vw = table()->vw;
    int64_t rows = env_int("STEN_NM_GTGATHER_ROWS", 16);
    rows = (rows + vw - 1) / vw * vw;
    const int nth = clamp_threads(nthreads, 2.0 * B * W->N * gn, (B + rows - 1) / rows);
    gtgather_args a = {W, y16 ? NULL : (const float *)dY, ldg, dX, ldx, B, cols, rows, table()->gtgather, 0,
                       y16 ? (const uint16_t *)dY : NULL};
    run_parallel(nth, gtgather_task, &a);
    free(cols);
    return a.err;
}

int nm_grouped_tgather_f32(const nm_grouped *W, int64_t B, const float *dY, int64_t ldg,
                           float *dX, int64_t ldx, int nthreads)
{
    return grouped_tgather_driver(W, B, dY, 0, ldg, dX, ldx, nthreads);
}

/* -------------------------------------------------------- column-grouped -- */
typedef struct {
    const nm_colgrouped *W;
    const float *xp;   /* panels (Kp x bch floats): chunks [nwhole, nbc) shared, then one per thread */
    int64_t Kp, nbc, B; float *Y; int64_t ldy;
    const float *bias; int64_t bch, kt, qb; int in_l1; nm_cgg_fn fn; int err; int64_t next;
    const float *X; int64_t ldx; int *packed;   /* per shared panel: 0 to pack, 1 packing, 2 packed */
    int tiles;   /* W->tiles is packed for this kt: passes stream it (NM_CG_TILES) */
    const uint16_t *X16;   /* bf16 x (X NULL then): widened while packing (pack_panel_bf16) */
    uint16_t *Y16;         /* bf16 result (Y NULL then): rounded as each unit is written */
    int64_t nwhole;        /* batch chunks [0, nwhole): one unit each, packed into the thread's panel */
} cgg_args;

/* Batch chunk bc's x panel into dst (Kp x bch floats). */
static void cgg_pack(cgg_args *a, int64_t bc, float *dst)
{
    if (a->X16) {   /* the tile: scratch for the edges (nm_bf16_pack.h) */
        float *tile = (float *)alloc64((size_t)(NM_BF16_PC * a->bch) * sizeof(float));
        if (tile) pack_panel_bf16(a->X16, a->ldx, a->B, a->W->K, bc * a->bch, a->bch, 0, a->Kp, tile, dst);
        else a->err = -3;
        free(tile);
    } else {
        pack_panel(a->X, a->ldx, a->B, a->W->K, bc * a->bch, a->bch, 0, a->Kp, dst);
    }
}

/* The shared panel of batch chunk bc >= nwhole (slot bc - nwhole of xp), packed by the
 * first unit that needs it (one parallel region for packing and products: on a loaded
 * machine every region's end waits for a thread the OS may have descheduled); a unit whose
 * chunk another thread is packing waits for it. */
static const float *cgg_panel_ready(cgg_args *a, int64_t bc)
{
    const int64_t i = bc - a->nwhole;
    float *dst = (float *)a->xp + i * a->Kp * a->bch;
    int expect = 0;
    if (__atomic_load_n(&a->packed[i], __ATOMIC_ACQUIRE) == 2) return dst;
    if (__atomic_compare_exchange_n(&a->packed[i], &expect, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        cgg_pack(a, bc, dst);
        __atomic_store_n(&a->packed[i], 2, __ATOMIC_RELEASE);
        return dst;
    }
    while (__atomic_load_n(&a->packed[i], __ATOMIC_ACQUIRE) != 2) sched_yield();
    return dst;
}

static void round_span(const float *y, uint16_t *y16, int64_t n);   /* nm_bf16.h */

/* rows per block of the bf16 write-out without AVX: transposed into an L1 stage, then rounded */
#define CG_STAGE_ROWS 32

/* Rows [qa*m, qe*m) of batch chunk bc (bch columns of ytmp, bch <= 128, the chunk's first
 * B - bc*bch valid) into Y, or rounded to bfloat16 into Y16 (Y NULL), transposed, bias
 * added: the paper-format drivers' last step per unit. The bf16 result takes no float32 Y
 * in memory and no second pass over it (3072x768 1:10, 2 threads: that pass took 0.42-0.49
 * ms beside a 2.4-2.6 ms product). */
static void cg_store_unit(const nm_colgrouped *W, const float *ytmp, int64_t B, int64_t bch, int64_t bc,
                          int64_t qa, int64_t qe, float *Y, uint16_t *Y16, int64_t ldy, const float *bias)
{
    const int64_t bmax = B - bc * bch < bch ? B - bc * bch : bch;
    const int64_t r0 = qa * W->m, r1 = qe * W->m < W->N ? qe * W->m : W->N, y0 = bc * bch * ldy + r0;
#ifdef STEN_NM_X86
    if (table()->vw >= 8) {   /* a bf16 result rounded in the 8 x 8 transposes (3072x768 1:10, 2
                               * threads: the staged rounding below ran 0.97x the float32 forward) */
        nm_store_transposed_avx8(ytmp, bch, r1 - r0, bmax, Y16 ? NULL : Y + y0, Y16 ? Y16 + y0 : NULL, ldy,
                                 bias ? bias + r0 : NULL);
        return;
    }
#endif
    if (!Y16) {
        nm_store_transposed(ytmp, bch, r1 - r0, bmax, Y + y0, ldy, bias ? bias + r0 : NULL);
        return;
    }
    float stage[128 * CG_STAGE_ROWS] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r += CG_STAGE_ROWS) {
        const int64_t nr = r1 - r < CG_STAGE_ROWS ? r1 - r : CG_STAGE_ROWS;
        nm_store_transposed(ytmp + (r - r0) * bch, bch, nr, bmax, stage, CG_STAGE_ROWS, bias ? bias + r : NULL);
        for (int64_t b = 0; b < bmax; b++) round_span(stage + b * CG_STAGE_ROWS, Y16 + (bc * bch + b) * ldy + r, nr);
    }
}

/* Row blocks [qa, qe) of batch chunk bc from its panel: their rows accumulated in ytmp,
 * slot range after slot range (kt slots of every pattern per pass), then written. */
static void cgg_blocks(cgg_args *a, const float *panel, int64_t bc, int64_t qa, int64_t qe, float *ytmp,
                       float *wbuf)
{
    const nm_colgrouped *W = a->W;
    for (int64_t t0 = 0; t0 < W->L; t0 += a->kt)
        a->fn(W, panel, qa, qe, t0, t0 + a->kt < W->L ? t0 + a->kt : W->L, ytmp,
              (t0 == 0 ? NM_CG_FIRST : 0) | (a->in_l1 ? NM_CG_IN_L1 : 0) | (a->tiles ? NM_CG_TILES : 0), wbuf);
    cg_store_unit(W, ytmp, a->B, a->bch, bc, qa, qe, a->Y, a->Y16, a->ldy, a->bias);
}

/* Units, taken dynamically: first the batch chunks [0, nwhole), a unit each (every row
 * block, qb at a time), packed into the thread's own panel, which stays in L2 from chunk
 * to chunk; then the other chunks' (batch chunk, qb row blocks), whose threads share one
 * packed panel (in L2) at a time. A fresh panel per chunk wrote 12 MB of x to memory
 * (768x3072 1:10, 1 thread: pack 0.70 -> 0.49 ms, passes 3.67 -> 3.53 ms). */
static void cgg_task(void *p, int tid, int nth)
{
    cgg_args *a = (cgg_args *)p;
    const nm_colgrouped *W = a->W;
    (void)nth;
    const int64_t qb = a->qb, panel_floats = a->Kp * a->bch;
    const int64_t nq = (W->Nb + qb - 1) / qb, nunits = a->nwhole + (a->nbc - a->nwhole) * nq;
    float *own = (float *)a->xp + (a->nbc - a->nwhole + tid) * panel_floats;
    float *ytmp = NULL, *wbuf = NULL;
    for (int64_t u; (u = next_unit(&a->next)) < nunits;) {
        if (!ytmp) {
            ytmp = (float *)alloc64((size_t)(qb * W->m * a->bch) * sizeof(float));
            wbuf = W->vtype == NM_BF16 ? (float *)alloc64((size_t)(W->n * W->L) * sizeof(float)) : NULL;
            if (!ytmp || (W->vtype == NM_BF16 && !wbuf)) { free(ytmp); free(wbuf); a->err = -3; return; }
        }
        if (u < a->nwhole) {
            cgg_pack(a, u, own);
            for (int64_t qa = 0; qa < W->Nb; qa += qb)
                cgg_blocks(a, own, u, qa, qa + qb < W->Nb ? qa + qb : W->Nb, ytmp, wbuf);
        } else {
            const int64_t v = u - a->nwhole, bc = a->nwhole + v / nq, qa = (v % nq) * qb;
            cgg_blocks(a, cgg_panel_ready(a, bc), bc, qa, qa + qb < W->Nb ? qa + qb : W->Nb, ytmp, wbuf);
        }
    }
    free(ytmp);
    free(wbuf);
}

int nm_colgrouped_gather_f32(const nm_colgrouped *W, int64_t B, const float *X, int64_t ldx,
                             float *Y, int64_t ldy, const float *bias, int nthreads)
{
    return nm_colgrouped_gather_variant_f32(W, B, X, ldx, Y, ldy, bias, nthreads, NM_CG_AUTO);
}

/* The loop order of a variant: slots per pass (kt) and row blocks per unit (qb).
 * NM_CG_STREAM: every slot in one pass over few row blocks (8: their accumulators stay in
 *   L1); the x columns come from the packed panel in L2, fetched ahead by software prefetch.
 * NM_CG_TILED (the original STen's order): a pass covers kt slots of every pattern, whose x
 *   columns (P * kt columns of bch floats, ~32 KiB) stay in L1 while many row blocks (their
 *   accumulators, ~256 KiB, in L2) sweep them; no prefetch.
 * STEN_NM_CG_KT / STEN_NM_CG_QB override kt / qb (experiments). */
/* bytes of x a tiled pass keeps in L1: 5/6 of the L1 data cache (40 KiB of Zen 5's 48,
 * 26 KiB of a 32 KiB one), the rest for the streamed values, indices and accumulators */
static int64_t cg_tile_bytes(void)
{
    long l1 = 0;
#ifdef _SC_LEVEL1_DCACHE_SIZE
    l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
#endif
    if (l1 < 16 * 1024 || l1 > 1024 * 1024) l1 = 32 * 1024;
    return env_int("STEN_NM_CG_TILE_BYTES", (int64_t)l1 * 5 / 6);
}

static void cg_variant(const nm_colgrouped *W, int variant, int64_t bch, int64_t nbc, int nth,
                       int64_t *kt, int64_t *qb, int *in_l1)
{
    if (variant == NM_CG_TILED) {
        *kt = cg_tile_bytes() / ((int64_t)W->P * bch * 4);
        /* whole blocks of NM_CG_KT_BLOCK slots: the unrolled pass kernel, and with g = 16 (the
         * default) tiles of whole chunks (a tile that splits a chunk touches every x column of
         * the chunk across the row blocks anyway); nearest multiple, ties down, at least one
         * (768x3072, 1 thread, AVX-512: 2:4 26 -> 32 slots, 1:4 40 -> 32, 2:8 5 -> 16: 3-14 %
         * faster) */
        *kt = (*kt + NM_CG_KT_BLOCK / 2 - 1) / NM_CG_KT_BLOCK * NM_CG_KT_BLOCK;
        if (*kt < NM_CG_KT_BLOCK) *kt = NM_CG_KT_BLOCK;
        *qb = env_int("STEN_NM_CG_ACC_BYTES", 256 * 1024) / ((int64_t)W->m * bch * 4);
        if (*qb < 1) *qb = 1;
        /* enough units for the threads (small batches: a single batch chunk) */
        while (*qb > 1 && nbc * ((W->Nb + *qb - 1) / *qb) < 2 * nth) *qb = (*qb + 1) / 2;
    } else {
        *kt = W->L;
        *qb = 8;
    }
    if (getenv("STEN_NM_CG_KT")) *kt = env_int("STEN_NM_CG_KT", W->L);
    if (getenv("STEN_NM_CG_QB")) *qb = env_int("STEN_NM_CG_QB", 8);
    if (*kt > W->L) *kt = W->L;
    *in_l1 = *kt < W->L;
}

/* Vectors per batch chunk of the paper-format forward: choose_nv's, but with 16-float vectors
 * and one row per pattern (n = 1) 8 instead of 4 (128 batch rows) where that chunk's panel
 * fits in half the L2 cache: each slot's index load and value broadcast then feed 8 FMAs
 * instead of 4 (3072x768 1:10, best loop order, same runs: 7.0x -> 7.1-8.9x dense at 1 thread,
 * 4.7x -> 5.2x at 2); with n >= 2 every x vector already feeds n rows and 2:4 was slower; a
 * larger panel (K = 3072: 1.5 MiB) streams from L3 and was slower.
 * STEN_NM_CG_NVI = 1..4 forces 2^(nvi-1) vectors (experiments, tests). */
static int cg_choose_nv(const nm_colgrouped *W, int64_t B, int variant, int vw, int *nvi)
{
    int nv = choose_nv(B, vw, nvi);
    const int64_t Kp = (int64_t)W->P * W->L;
    /* tiled: only where a block of NM_CG_KT_BLOCK slots of 8-vector x columns fits the L1 tile
     * (3072x768 1:10, 1 thread: 8 vectors with 16-slot tiles of 80 KiB 5.4-5.8 ms, 4 vectors
     * 5.05 ms; 1:4, 32 KiB, stays at 8: 8.85 vs 9.0 ms) */
    const int fits = variant != NM_CG_TILED ||
                     (int64_t)W->P * NM_CG_KT_BLOCK * 8 * vw * 4 <= cg_tile_bytes();
    if (vw >= 16 && W->n == 1 && nv == 4 && B >= 128 && Kp * 8 * vw * 4 <= l2_bytes() / 2 && fits) {
        nv = 8;
        *nvi = 3;
    }
    if (getenv("STEN_NM_CG_NVI")) {
        const int64_t e = env_int("STEN_NM_CG_NVI", 1) - 1;
        *nvi = e > 3 ? 3 : (int)e;
        nv = 1 << *nvi;
    }
    return nv;
}

/* A column-grouped descriptor's shape; its tables are checked by cg_check_tables. */
static int cg_check_shape(const nm_colgrouped *W)
{
    return !W || W->n < 1 || W->m < 2 || W->n >= W->m || W->P < 1 || W->N < 0 || W->K < 0 ||
           (W->vtype != NM_F32 && W->vtype != NM_BF16) ||
           W->Nb != (W->N + W->m - 1) / W->m || W->L < 0 || (int64_t)W->P * W->L < W->K ? -1 : 0;
}

/* Every pattern's rows below m and, with cols, every stored column below P * L (the kernels
 * read x at those columns). */
static int cg_check_tables(const nm_colgrouped *W, int cols)
{
    for (int64_t i = 0; i < (int64_t)W->P * W->n; i++)
        if (W->pats[i] < 0 || W->pats[i] >= W->m) return -1;
    if (!cols) return 0;
    const int64_t Kp = (int64_t)W->P * W->L;
    for (int64_t i = 0; i < W->Nb * Kp; i++)
        if (W->cols[i] < 0 || W->cols[i] >= Kp) return -1;
    return 0;
}

/* The paper-format forward in a loop order (variant) on float32 x, or bf16 x (x16: widened
 * while each batch chunk's panel is packed). check_cols: refuse stored columns past the
 * panel where the passes read them (not where they read the tile-major copy, whose columns
 * nm_colgrouped_pack_tiles checked): a scan of every column, 2-5 % of a 2:4 forward. */
static int cg_gather_driver(const nm_colgrouped *W, int64_t B, const void *X, int x16, int64_t ldx,
                            float *Y, uint16_t *Y16, int64_t ldy, const float *bias, int nthreads, int variant,
                            int check_cols)
{
    if (cg_check_shape(W) || B < 0 || variant < NM_CG_AUTO || variant > NM_CG_TILED) return -1;
    if (B == 0 || W->N == 0) return 0;
    if (W->K == 0 || W->L == 0) {   /* (a bf16 result's caller fills it) */
        if (Y16) return -1;
        fill_with_bias(Y, B, W->N, ldy, bias);
        return 0;
    }
    if (cg_check_tables(W, 0)) return -1;
    const nm_isa_table *T = table();
    const int64_t Kp = (int64_t)W->P * W->L;
    if (variant == NM_CG_AUTO) variant = (int)env_int("STEN_NM_CG_VARIANT", NM_CG_STREAM);
    int nvi; const int64_t bch = (int64_t)cg_choose_nv(W, B, variant, T->vw, &nvi) * T->vw;
    const int nth = clamp_threads(nthreads, 2.0 * B * W->Nb * W->n * Kp, W->Nb);
    const int64_t nbc = (B + bch - 1) / bch;
    int64_t kt, qb; int in_l1;
    cg_variant(W, variant, bch, nbc, nth, &kt, &qb, &in_l1);
    const int tiles = W->tiles && W->tile_kt == kt && env_int("STEN_NM_CG_TILES", 1) != 0;
    if (check_cols && !tiles && cg_check_tables(W, 1)) return -1;
    /* whole-chunk units while every thread gets as many (a chunk split in row-block groups
     * keeps the threads busy when there are fewer chunks than threads, or one left over) */
    const int64_t nq = (W->Nb + qb - 1) / qb, nwhole = nq == 1 ? nbc : nbc - nbc % nth;
    /* the shared panels, then one per thread */
    float *xp = (float *)scratch_take((size_t)((nbc - nwhole + nth) * Kp * bch) * sizeof(float));
    int *packed = (int *)calloc((size_t)(nbc - nwhole + 1), sizeof(int));
    if (!xp || !packed) { scratch_give(xp); free(packed); return -3; }
    cgg_args a = {W, xp, Kp, nbc, B, Y, ldy, bias, bch, kt, qb, in_l1, T->cgg[nvi], 0, 0,
                  x16 ? NULL : (const float *)X, ldx, packed, tiles, x16 ? (const uint16_t *)X : NULL, Y16,
                  nwhole};
    run_parallel(nth, cgg_task, &a);
    scratch_give(xp);
    free(packed);
    return a.err;
}

int nm_colgrouped_gather_variant_f32(const nm_colgrouped *W, int64_t B, const float *X, int64_t ldx,
                                     float *Y, int64_t ldy, const float *bias, int nthreads, int variant)
{
    return cg_gather_driver(W, B, X, 0, ldx, Y, NULL, ldy, bias, nthreads, variant, 0);
}

/* The tile-major packed form (nm_kernel.h): header of per-tile base columns, then per tile
 * (kt slots, the last narrower) the records of every (row block, pattern). */
static int64_t cg_tile_span(const nm_colgrouped *W, int64_t t0, int64_t t1, int32_t *base)
{
    int32_t lo = INT32_MAX, hi = -1;
    for (int64_t qp = 0; qp < W->Nb * W->P; qp++)
        for (int64_t t = t0; t < t1; t++) {
            const int32_t c = W->cols[qp * W->L + t];
            if (c < lo) lo = c;
            if (c > hi) hi = c;
        }
    if (hi < 0) lo = hi = 0;
    *base = lo;
    return (int64_t)hi - lo + 1;
}

int64_t nm_colgrouped_tiles_bytes(const nm_colgrouped *W, int64_t kt)
{
    if (cg_check_shape(W) || kt < 1 || W->L < 1) return -1;
    const int64_t nt = (W->L + kt - 1) / kt, last = W->L - (nt - 1) * kt;
    const int vb = nm_cg_tile_vb(W);
    return nm_cg_tiles_header(nt) + W->Nb * W->P * ((nt - 1) * nm_cg_tile_record(W->n, kt, vb) +
                                                   nm_cg_tile_record(W->n, last, vb));
}

int nm_colgrouped_pack_tiles(const nm_colgrouped *W, int64_t kt, void *out, int64_t bytes)
{
    const int64_t need = nm_colgrouped_tiles_bytes(W, kt);
    if (need < 0 || bytes < need || !out || cg_check_tables(W, 1)) return -1;
    const int n = W->n, vb = nm_cg_tile_vb(W), svb = W->vtype == NM_BF16 ? 2 : 4;   /* tile, stored */
    const int64_t L = W->L, nt = (L + kt - 1) / kt, QP = W->Nb * W->P;
    int32_t *hdr = (int32_t *)out;
    char *blk = (char *)out + nm_cg_tiles_header(nt);
    memset(out, 0, (size_t)need);
    for (int64_t tau = 0; tau < nt; tau++) {
        const int64_t t0 = tau * kt, t1 = t0 + kt < L ? t0 + kt : L, w = t1 - t0;
        const int64_t rec = nm_cg_tile_record(n, w, vb);
        int32_t base;
        if (cg_tile_span(W, t0, t1, &base) > 32768) return -2;   /* int16 columns */
        hdr[tau] = base;
        for (int64_t qp = 0; qp < QP; qp++) {
            char *r = blk + qp * rec;
            int16_t *c = (int16_t *)(r + nm_cg_tile_values(n, w, vb));
            const char *sv = (const char *)W->vals + qp * n * L * svb;
            for (int j = 0; j < n; j++) {
                const char *src = sv + ((int64_t)j * L + t0) * svb;
                if (vb == svb) memcpy(r + (int64_t)j * w * vb, src, (size_t)(w * vb));
                else nm_widen_bf16((const uint16_t *)(const void *)src, (float *)(void *)(r + (int64_t)j * w * vb), w);
            }
            for (int64_t t = 0; t < w; t++) c[t] = (int16_t)(W->cols[qp * L + t0 + t] - base);
        }
        blk += QP * rec;
    }
    return 0;
}

int64_t nm_colgrouped_tile_kt(const nm_colgrouped *W, int64_t B, int nthreads, int variant)
{
    if (cg_check_shape(W) || B < 1 || variant < NM_CG_AUTO || variant > NM_CG_TILED) return -1;
    if (W->N == 0 || W->K == 0 || W->L == 0) return -1;
    const nm_isa_table *T = table();
    const int64_t Kp = (int64_t)W->P * W->L;
    if (variant == NM_CG_AUTO) variant = (int)env_int("STEN_NM_CG_VARIANT", NM_CG_STREAM);
    int nvi; const int64_t bch = (int64_t)cg_choose_nv(W, B, variant, T->vw, &nvi) * T->vw;
    const int nth = clamp_threads(nthreads, 2.0 * B * W->Nb * W->n * Kp, W->Nb);
    const int64_t nbc = (B + bch - 1) / bch;
    int64_t kt, qb; int in_l1;
    cg_variant(W, variant, bch, nbc, nth, &kt, &qb, &in_l1);
    return kt;
}

/* ----------------------------------------------------------- conversions -- */
typedef struct {
    int64_t R, C; int32_t n, m; const float *D; int64_t ldd; const uint8_t *mask;
    float *vals; uint32_t *idx; int err;
} compress_args;

static void compress_task(void *p, int tid, int nth)
{
    compress_args *a = (compress_args *)p;
    const int n = a->n, m = a->m, bits = nm_index_bits(m), per = nm_index_per_word(m);
    const int64_t G = (a->C + m - 1) / m, gn = G * n, iw = (gn + per - 1) / per;
    int64_t r0, r1;
    split(a->R, tid, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float *row = a->D + r * a->ldd;
        const uint8_t *mrow = a->mask ? a->mask + r * a->C : NULL;
        float *v = a->vals + r * gn;
        uint32_t *w = a->idx + r * iw;
        memset(w, 0, (size_t)iw * sizeof(uint32_t));
        int64_t wi = 0;           /* current index word and slot in it */
        int slot = 0;
        for (int64_t g = 0; g < G; g++) {
            const int64_t c0 = g * m;
            const int valid = (int)(a->C - c0 < m ? a->C - c0 : m);
            const float *src = row + c0;
            uint32_t sel = 0;
            int nsel = 0;
            if (mrow) {
                for (int j = 0; j < valid; j++)
                    if (mrow[c0 + j]) { sel |= 1u << j; nsel++; }
                if (nsel > n) { a->err = -2; return; }
            } else if (valid <= n) {
                sel = valid >= 32 ? 0xffffffffu : ((1u << valid) - 1u);
                nsel = valid;
            } else {
                float mag[32];
                for (int j = 0; j < valid; j++) {
                    float v = fabsf(src[j]);
                    mag[j] = v != v ? INFINITY : v;      /* NaN counts as largest */
                }
                for (; nsel < n; nsel++) {
                    int best = -1; float bm = -1.0f;
                    for (int j = 0; j < valid; j++)
                        if (mag[j] > bm) { best = j; bm = mag[j]; }
                    sel |= 1u << best;
                    mag[best] = -2.0f;
                }
            }
            const uint32_t kept = sel;
            for (int j = 0; nsel < n && j < m; j++)          /* fill with zero slots */
                if (!(sel & (1u << j))) { sel |= 1u << j; nsel++; }
            while (sel) {
                const int j = __builtin_ctz(sel);
                sel &= sel - 1;
                *v++ = (kept & (1u << j)) ? src[j] : 0.0f;
                if (slot == per) { slot = 0; wi++; }
                w[wi] |= (uint32_t)j << (bits * slot);
                slot++;
            }
        }
    }
}

static int compress(int64_t R, int64_t C, int32_t n, int32_t m, const float *D, int64_t ldd,
                    const uint8_t *mask, float *vals, uint32_t *idx, int nthreads)
{
    if (n < 1 || m < 2 || n >= m || m > 32 || R < 0 || C < 0) return -1;
    if (R == 0 || C == 0) return 0;
    compress_args ca = {R, C, n, m, D, ldd, mask, vals, idx, 0};
    run_parallel(clamp_threads(nthreads, 8.0 * R * C, R), compress_task, &ca);
    return ca.err;
}

int nm_compress_f32(int64_t R, int64_t C, int32_t n, int32_t m, const float *D, int64_t ldd,
                    float *vals, uint32_t *idx, int nthreads)
{
    return compress(R, C, n, m, D, ldd, NULL, vals, idx, nthreads);
}

int nm_compress_mask_f32(int64_t R, int64_t C, int32_t n, int32_t m, const float *D, int64_t ldd,
                         const uint8_t *mask, float *vals, uint32_t *idx, int nthreads)
{
    return compress(R, C, n, m, D, ldd, mask, vals, idx, nthreads);
}

typedef struct { const nm_mat *A; float *D; int64_t ldd; float *vals; int to_dense; } decompress_args;

/* Row r of A against the dense row `row` [C]: to_dense (a constant at each call site) writes
 * the stored values into the zeroed row; otherwise vals[e] = row[column of slot e] (0 in the
 * padding). Walks the index words in order, no division per element (768x3072 2:4, 2
 * threads, Xeon SPR: 4.6 ms with `e / n`, `e % per` per element). */
static inline __attribute__((always_inline)) void nm_walk_row(const nm_mat *A, int64_t r, float *row,
                                                              float *vals, const int to_dense)
{
    const int n = A->n, m = A->m, bits = A->bits, per = A->per;
    const uint32_t mask = (1u << bits) - 1u;
    const int64_t gn = A->G * n, C = A->C;
    const uint32_t *words = A->idx + r * A->iw;
    int64_t e = 0, base = 0; /* element, and its group's first column */
    int j = 0;               /* element within its group */
    if (to_dense) memset(row, 0, (size_t)C * sizeof(float));
    for (int64_t wi = 0; e < gn; wi++) {
        const uint32_t word = words[wi];
        for (int k = 0; k < per && e < gn; k++, e++) {
            const int64_t c = base + ((word >> (bits * k)) & mask);
            if (to_dense) {
                if (c < C) row[c] = vals[e];
            } else {
                vals[e] = c < C ? row[c] : 0.0f;
            }
            if (++j == n) {
                j = 0;
                base += m;
            }
        }
    }
}

static void decompress_task(void *p, int tid, int nth)
{
    decompress_args *a = (decompress_args *)p;
    const nm_mat *A = a->A;
    const int64_t gn = A->G * A->n;
    int64_t r0, r1;
    split(A->R, tid, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        if (a->to_dense)
            nm_walk_row(A, r, a->D + r * a->ldd, (float *)A->vals + r * gn, 1);
        else
            nm_walk_row(A, r, a->D + r * a->ldd, a->vals + r * gn, 0);
    }
}

int nm_decompress_f32(const nm_mat *A, float *D, int64_t ldd, int nthreads)
{
    if (check_mat(A)) return -1;
    if (A->R == 0 || A->C == 0) return 0;
    decompress_args da = {A, D, ldd, NULL, 1};
    run_parallel(clamp_threads(nthreads, 4.0 * A->R * A->C, A->R), decompress_task, &da);
    return 0;
}

int nm_values_at_f32(const nm_mat *A, const float *D, int64_t ldd, float *vals, int nthreads)
{
    if (check_mat(A)) return -1;
    if (A->R == 0 || A->G == 0) return 0;
    if (!D || !vals || (A->R > 1 && ldd < A->C)) return -1;
    decompress_args da = {A, (float *)D, ldd, vals, 0};   /* (D only read in this mode) */
    run_parallel(clamp_threads(nthreads, 4.0 * A->R * A->C, A->R), decompress_task, &da);
    return 0;
}

/* The paper format against a dense [N][K] matrix D, per row block (cg_walk_block): to_dense
 * (a constant at each call site) writes the float32 values at their positions into the
 * block's rows, zeroed first; otherwise vals[q][p][j][t] = D[row][column] (0 at padding rows
 * and columns). In C: torch's advanced indexing took 5.8 ms for 3072x768 2:4 (2 threads). */
typedef struct { const nm_colgrouped *W; float *D; int64_t ldd; float *vals; int to_dense; } cg_dense_args;

static inline __attribute__((always_inline)) void cg_walk_block(const nm_colgrouped *W, int64_t q, float *D,
                                                                int64_t ldd, float *vals, const int to_dense)
{
    const int n = W->n, m = W->m, P = W->P;
    const int64_t L = W->L, K = W->K;
    if (to_dense)
        for (int64_t r = q * m; r < q * m + m && r < W->N; r++) memset(D + r * ldd, 0, (size_t)K * sizeof(float));
    for (int p = 0; p < P; p++) {
        const int32_t *cols = W->cols + (q * P + p) * L;
        for (int j = 0; j < n; j++) {
            const int64_t r = q * m + W->pats[p * n + j];
            float *v = vals + ((q * P + p) * n + j) * L;
            if (r >= W->N) {   /* a padding row of the last block */
                if (!to_dense) memset(v, 0, (size_t)L * sizeof(float));
                continue;
            }
            float *row = D + r * ldd;
            for (int64_t t = 0; t < L; t++) {
                const int64_t c = cols[t];
                if (to_dense) {
                    if (c < K) row[c] = v[t];
                } else {
                    v[t] = c < K ? row[c] : 0.0f;
                }
            }
        }
    }
}

static void cg_dense_task(void *p, int tid, int nth)
{
    cg_dense_args *a = (cg_dense_args *)p;
    int64_t q0, q1;
    split(a->W->Nb, tid, nth, &q0, &q1);
    for (int64_t q = q0; q < q1; q++) {
        if (a->to_dense)
            cg_walk_block(a->W, q, a->D, a->ldd, (float *)a->W->vals, 1);
        else
            cg_walk_block(a->W, q, a->D, a->ldd, a->vals, 0);
    }
}

static int cg_dense_driver(const nm_colgrouped *W, float *D, int64_t ldd, float *vals, int to_dense,
                           int nthreads)
{
    /* (one row: its stride is never used, and torch may give it any) */
    if (cg_check_shape(W) || (W->N > 1 && ldd < W->K) || (to_dense && W->vtype != NM_F32)) return -1;
    if (W->Nb == 0 || (to_dense ? W->K == 0 : W->L == 0)) return 0;   /* nothing to write */
    if ((W->N && W->K && !D) || !W->cols || !W->pats || !(to_dense ? W->vals : vals) || cg_check_tables(W, 1))
        return -1;
    cg_dense_args a = {W, D, ldd, vals, to_dense};   /* (D only read when not to_dense) */
    run_parallel(clamp_threads(nthreads, 4.0 * W->N * W->K, W->Nb), cg_dense_task, &a);
    return 0;
}

int nm_colgrouped_decompress_f32(const nm_colgrouped *W, float *D, int64_t ldd, int nthreads)
{
    return cg_dense_driver(W, D, ldd, NULL, 1, nthreads);
}

int nm_colgrouped_values_at_f32(const nm_colgrouped *W, const float *D, int64_t ldd, float *vals, int nthreads)
{
    return cg_dense_driver(W, (float *)D, ldd, vals, 0, nthreads);
}

/* ------------------------------------------- column-grouped backward (own file) -- */
#include "nm_colgrouped_bwd.h"

/* ------------------------------------------------- bf16 values (own file) -- */
#include "nm_bf16.h"
#include "nm_cg_bf16x.h"
#include "nm_bf16_bwd.h"
