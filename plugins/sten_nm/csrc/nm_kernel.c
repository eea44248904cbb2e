/* sten_nm driver: ISA selection, threading (pthreads), packing, conversions. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "nm_isa.h"

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
typedef struct { task_fn fn; void *arg; int tid, nth; } task_t;

static void *task_main(void *p)
{
    task_t *t = (task_t *)p;
    t->fn(t->arg, t->tid, t->nth);
    return NULL;
}

/* Run fn(arg, tid, nth) for tid in [0, nth): tid 0 on the caller's thread. */
static void run_parallel(int nth, task_fn fn, void *arg)
{
    if (nth <= 1) { fn(arg, 0, 1); return; }
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

static void split(int64_t total, int tid, int nth, int64_t *a, int64_t *b)
{
    int64_t q = total / nth, rem = total % nth;
    *a = tid * q + (tid < rem ? tid : rem);
    *b = *a + q + (tid < rem ? 1 : 0);
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

/* --------------------------------------------------------------- panels -- */
/* Pack X[B][C] (row stride ldx) into [nbc][Cpad][bch], transposed, zero padded. */
typedef struct {
    const float *X; int64_t ldx, B, C, Cpad, nbc, bch; float *xp;
} pack_args;

static void pack_task(void *p, int tid, int nth)
{
    pack_args *a = (pack_args *)p;
    int64_t c_a, c_b;
    split((a->Cpad + 15) / 16, tid, nth, &c_a, &c_b);
    c_a *= 16; c_b *= 16;
    if (c_b > a->Cpad) c_b = a->Cpad;
    const int64_t bch = a->bch;
    for (int64_t bc = 0; bc < a->nbc; bc++) {
        float *panel = a->xp + bc * a->Cpad * bch;
        for (int64_t c0 = c_a; c0 < c_b; c0 += 16) {
            const int64_t c1 = c0 + 16 < c_b ? c0 + 16 : c_b;
            for (int64_t bi = 0; bi < bch; bi++) {
                const int64_t b = bc * bch + bi;
                if (b < a->B) {
                    const float *row = a->X + b * a->ldx;
                    for (int64_t c = c0; c < c1; c++)
                        panel[c * bch + bi] = c < a->C ? row[c] : 0.0f;
                } else {
                    for (int64_t c = c0; c < c1; c++) panel[c * bch + bi] = 0.0f;
                }
            }
        }
    }
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

static float *make_panel(const float *X, int64_t ldx, int64_t B, int64_t C, int64_t Cpad,
                         int64_t bch, int64_t *nbc_out, int nth)
{
    const int64_t nbc = (B + bch - 1) / bch;
    float *xp = (float *)alloc64((size_t)(nbc * Cpad * bch) * sizeof(float));
    if (!xp) return NULL;
    pack_args pa = {X, ldx, B, C, Cpad, nbc, bch, xp};
    int pth = nth;
    if ((Cpad + 15) / 16 < pth) pth = (int)((Cpad + 15) / 16);
    run_parallel(pth, pack_task, &pa);
    *nbc_out = nbc;
    return xp;
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
    const float *bias; int64_t kbg, bch; nm_gather_fn fn; int err;
} gather_args;

static void gather_task(void *p, int tid, int nth)
{
    gather_args *a = (gather_args *)p;
    int64_t r0, r1;
    split(a->A->R, tid, nth, &r0, &r1);
    if (r1 <= r0) return;
    float *ytmp = (float *)alloc64((size_t)(NM_ROWS * a->bch) * sizeof(float));
    int32_t *offs = (int32_t *)alloc64((size_t)(NM_ROWS * a->A->G * a->A->n) * sizeof(int32_t));
    if (!ytmp || !offs) { free(ytmp); free(offs); a->err = -3; return; }
    a->fn(a->A, a->xp, a->Cpad, a->nbc, a->B, a->Y, a->ldy, a->bias, r0, r1, ytmp, offs, a->kbg);
    free(ytmp); free(offs);
}

int nm_gather_f32(const nm_mat *A, int64_t B, const float *X, int64_t ldx, float *Y, int64_t ldy,
                  const float *bias, int nthreads)
{
    if (check_mat(A) || B < 0) return -1;
    if (B == 0 || A->R == 0) return 0;
    if (A->C == 0) {
        for (int64_t b = 0; b < B; b++)
            for (int64_t r = 0; r < A->R; r++) Y[b * ldy + r] = bias ? bias[r] : 0.0f;
        return 0;
    }
    const nm_isa_table *T = table();
    int nvi; const int64_t bch = (int64_t)choose_nv(B, T->vw, &nvi) * T->vw;
    const int64_t Cpad = A->G * A->m;
    int nth = clamp_threads(nthreads, 2.0 * B * A->R * A->G * A->n, A->R);
    int64_t nbc;
    float *xp = make_panel(X, ldx, B, A->C, Cpad, bch, &nbc, nth);
    if (!xp) return -3;
    gather_args ga = {A, xp, Cpad, nbc, B, Y, ldy, bias, block_groups(A, bch), bch, T->gather[nvi], 0};
    run_parallel(nth, gather_task, &ga);
    free(xp);
    return ga.err;
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
int nm_tgather_f32(const nm_mat *A, int64_t B, const float *Y, int64_t ldy, float *X, int64_t ldx,
                   const float *bias, int nthreads)
{
    if (check_mat(A) || B < 0) return -1;
    if (B == 0 || A->C == 0) return 0;
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
    float *yp = make_panel(Y, ldy, B, R, R, bch, &nbc, nth);
    if (!yp) { free(rowptr); free(toff); free(tv); return -3; }
    int64_t kbr = env_int("STEN_NM_BLOCK_BYTES", 16 * 1024) / (bch * 4);
    if (kbr < 1) kbr = 1;
    cgather_args ca = {rowptr, toff, tv, yp, R, C, nbc, B, X, ldx, bias, bch, kbr, T->cgather[nvi], 0};
    run_parallel(nth, cgather_task, &ca);
    free(yp); free(rowptr); free(toff); free(tv);
    return ca.err;
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
        for (int64_t b = 0; b < B; b++)
            for (int64_t c = 0; c < A->C; c++) X[b * ldx + c] = bias ? bias[c] : 0.0f;
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
    float *out; int64_t kbg; nm_sddmm_fn fn; int err;
} sddmm_args;

static void sddmm_task(void *p, int tid, int nth)
{
    sddmm_args *a = (sddmm_args *)p;
    int64_t r0, r1;
    split(a->A->R, tid, nth, &r0, &r1);
    if (r1 <= r0) return;
    int32_t *offs = (int32_t *)alloc64((size_t)(NM_ROWS * a->A->G * a->A->n) * sizeof(int32_t));
    if (!offs) { a->err = -3; return; }
    a->fn(a->A, a->xp, a->Cpad, a->yp, a->nbc, a->out, r0, r1, offs, a->kbg);
    free(offs);
}

int nm_sddmm_f32(const nm_mat *A, int64_t B, const float *Y, int64_t ldy, const float *X,
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
    float *xp = make_panel(X, ldx, B, A->C, Cpad, bch, &nbc, nth);
    float *yp = make_panel(Y, ldy, B, A->R, A->R, bch, &nbc2, nth);
    if (!xp || !yp) { free(xp); free(yp); return -3; }
    sddmm_args sa = {A, xp, Cpad, yp, nbc, out, block_groups(A, bch), T->sddmm[nvi], 0};
    run_parallel(nth, sddmm_task, &sa);
    free(xp); free(yp);
    return sa.err;
}

/* --------------------------------------------------------------- grouped -- */
typedef struct {
    const nm_grouped *W; const float *xp; int64_t Kpad, B, bb; float *Y; int64_t ldy;
    const float *bias; nm_ggather_fn fn; int err;
} ggather_args;

static void ggather_task(void *p, int tid, int nth)
{
    ggather_args *a = (ggather_args *)p;
    int64_t q0, q1;
    split(a->W->Q, tid, nth, &q0, &q1);
    if (q1 <= q0) return;
    const int64_t gn = (a->W->K + a->W->m - 1) / a->W->m * a->W->n;
    int32_t *offs = (int32_t *)alloc64((size_t)(gn > 0 ? gn : 1) * sizeof(int32_t));
    if (!offs) { a->err = -3; return; }
    a->fn(a->W, a->xp, a->Kpad, a->B, a->bb, a->Y, a->ldy, a->bias, q0, q1, offs);
    free(offs);
}

int nm_grouped_gather_f32(const nm_grouped *W, int64_t B, const float *X, int64_t ldx,
                          float *Y, int64_t ldy, const float *bias, int nthreads)
{
    if (!W || W->n < 1 || W->m < 2 || W->n >= W->m || W->m > 32 || W->N < 0 || W->K < 0 || B < 0)
        return -1;
    if (W->bits != nm_index_bits(W->m) || W->per != nm_index_per_word(W->m)) return -1;
    const int64_t G = (W->K + W->m - 1) / W->m;
    if (W->Q != (W->N + NM_GR - 1) / NM_GR || W->iw != (G * W->n + W->per - 1) / W->per) return -1;
    if (B == 0 || W->N == 0) return 0;
    if (W->K == 0) {
        for (int64_t b = 0; b < B; b++)
            for (int64_t r = 0; r < W->N; r++) Y[b * ldy + r] = bias ? bias[r] : 0.0f;
        return 0;
    }
    const nm_isa_table *T = table();
    const int64_t Kpad = G * W->m;
    int nth = clamp_threads(nthreads, 2.0 * B * W->N * G * W->n, W->Q);
    int64_t npan;
    float *xp = make_panel(X, ldx, B, W->K, Kpad, NM_MB, &npan, nth);
    if (!xp) return -3;
    /* batch block: its panel (bb x Kpad floats) should stay in L2 */
    int64_t bb = env_int("STEN_NM_GROUPED_PANEL_BYTES", 192 * 1024) / (Kpad * 4) / NM_MB * NM_MB;
    if (bb < NM_MB) bb = NM_MB;
    ggather_args ga = {W, xp, Kpad, B, bb, Y, ldy, bias, T->ggather, 0};
    run_parallel(nth, ggather_task, &ga);
    free(xp);
    return ga.err;
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

typedef struct { const nm_mat *A; float *D; int64_t ldd; } decompress_args;

static void decompress_task(void *p, int tid, int nth)
{
    decompress_args *a = (decompress_args *)p;
    const nm_mat *A = a->A;
    const int n = A->n, m = A->m, bits = A->bits, per = A->per;
    const uint32_t mask = (1u << bits) - 1u;
    const int64_t gn = A->G * n;
    int64_t r0, r1;
    split(A->R, tid, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        float *row = a->D + r * a->ldd;
        for (int64_t c = 0; c < A->C; c++) row[c] = 0.0f;
        const float *v = A->vals + r * gn;
        for (int64_t e = 0; e < gn; e++) {
            const int64_t c = (e / n) * m + ((A->idx[r * A->iw + e / per] >> (bits * (int)(e % per))) & mask);
            if (c < A->C) row[c] = v[e];
        }
    }
}

int nm_decompress_f32(const nm_mat *A, float *D, int64_t ldd, int nthreads)
{
    if (check_mat(A)) return -1;
    if (A->R == 0 || A->C == 0) return 0;
    decompress_args da = {A, D, ldd};
    run_parallel(clamp_threads(nthreads, 4.0 * A->R * A->C, A->R), decompress_task, &da);
    return 0;
}
