/* Column-grouped n:m (the paper's format) backward kernels: the input gradient
 * dX = dY W and the gradient of the stored values (dY^T X at the kept positions only).
 * Included once by nm_kernel.c after its driver (threads, panels, ISA table); the vector
 * bodies are compiled per instruction set with function target attributes
 * (nm_cgbwd_body.h) and picked by the ISA in force (its vector width). */

/* The values of (row block q, pattern p) as float: the stored floats, or bf16 widened
 * into wbuf (n * L floats). */
static inline const float *cgb_values(const nm_colgrouped *W, int64_t q, int p, float *wbuf)
{
    const int64_t nl = (int64_t)W->n * W->L, vo = (q * W->P + p) * nl;
    if (W->vtype != NM_BF16) return (const float *)W->vals + vo;
    nm_widen_bf16((const uint16_t *)W->vals + vo, wbuf, nl);
    return wbuf;
}

#define CGB_VW 4
#define CGB_SUF generic
#define CGB_TARGET
#include "nm_cgbwd_body.h"
#undef CGB_VW
#undef CGB_SUF
#undef CGB_TARGET
#ifdef STEN_NM_X86
#define CGB_VW 8
#define CGB_SUF avx2
#define CGB_TARGET __attribute__((target("avx2,fma")))
#include "nm_cgbwd_body.h"
#undef CGB_VW
#undef CGB_SUF
#undef CGB_TARGET
#define CGB_VW 16
#define CGB_SUF avx512
#define CGB_TARGET __attribute__((target("avx512f,avx2,fma")))
#include "nm_cgbwd_body.h"
#undef CGB_VW
#undef CGB_SUF
#undef CGB_TARGET
#endif

typedef void (*cgb_gx_fn)(const nm_colgrouped *, const float *, float *, int64_t, float *);
typedef void (*cgb_gv_fn)(const nm_colgrouped *, const float *, const float *, int64_t, int64_t, int64_t,
                          float *, int);

/* The kernels of the ISA in force (tests force each with nm_set_isa). */
static int cgb_pick(cgb_gx_fn *gx, cgb_gv_fn *gv)
{
    const int vw = table()->vw;
#ifdef STEN_NM_X86
    if (vw == 16) { *gx = cgb_gx_avx512; *gv = cgb_gv_avx512; return 16; }
    if (vw == 8) { *gx = cgb_gx_avx2; *gv = cgb_gv_avx2; return 8; }
#endif
    (void)vw;
    *gx = cgb_gx_generic; *gv = cgb_gv_generic;
    return 4;
}

/* ------------------------------------------------------------ input gradient -- */
typedef struct {
    const nm_colgrouped *W; const float *gyp; int64_t Nm, nbc, bch, B; float *dX; int64_t ldx;
    cgb_gx_fn fn; int err; int64_t next;
} cgb_gx_args;

/* Units: batch chunks (dynamic); a thread accumulates a chunk's dX transposed
 * (gxt [P*L][bch], in L2) over every row block, then writes its rows. */
static void cgb_gx_task(void *p, int tid, int nth)
{
    cgb_gx_args *a = (cgb_gx_args *)p;
    const nm_colgrouped *W = a->W;
    const int64_t Kp = (int64_t)W->P * W->L;
    (void)tid; (void)nth;
    float *gxt = NULL, *wbuf = NULL;
    for (int64_t c; (c = next_unit(&a->next)) < a->nbc;) {
        if (!gxt) {
            gxt = (float *)alloc64((size_t)(Kp * a->bch) * sizeof(float));
            wbuf = (float *)alloc64((size_t)(W->n * W->L) * sizeof(float));
            if (!gxt || !wbuf) { free(gxt); free(wbuf); a->err = -3; return; }
        }
        memset(gxt, 0, (size_t)(Kp * a->bch) * sizeof(float));
        a->fn(W, a->gyp + c * a->Nm * a->bch, gxt, a->bch, wbuf);
        const int64_t b0 = c * a->bch, nb = a->B - b0 < a->bch ? a->B - b0 : a->bch;
        for (int64_t bi = 0; bi < nb; bi++) {
            float *x = a->dX + (b0 + bi) * a->ldx;
            for (int64_t k = 0; k < W->K; k++) x[k] = gxt[k * a->bch + bi];
        }
    }
    free(gxt); free(wbuf);
}

/* nm_colgrouped_grad_input_f32 on dY float32 or bfloat16 bits (y16: widened while packing). */
static int cg_grad_input_driver(const nm_colgrouped *W, int64_t B, const void *dY, int y16, int64_t ldg,
                                float *dX, int64_t ldx, int nthreads)
{
    if (cg_check_shape(W) || cg_check_tables(W, 1) || B < 0) return -1;
    if (B == 0 || W->K == 0) return 0;
    if (W->N == 0 || W->L == 0) {
        for (int64_t b = 0; b < B; b++) memset(dX + b * ldx, 0, (size_t)W->K * sizeof(float));
        return 0;
    }
    cgb_gx_fn gx; cgb_gv_fn gv;
    const int vw = cgb_pick(&gx, &gv);
    const int64_t Kp = (int64_t)W->P * W->L, Nm = W->Nb * W->m;
    /* vectors per batch chunk: up to 4 (2 with 16 registers), dX's chunk within ~512 KiB,
     * and enough chunks for the threads */
    const int maxnv = vw >= 16 ? 4 : 2;
    const int64_t bytes = env_int("STEN_NM_CGBWD_BYTES", 512 * 1024);
    int nv = 1;
    while (nv < maxnv && (int64_t)nv * vw < B && Kp * 2 * nv * vw * 4 <= bytes &&
           (B + 2 * nv * vw - 1) / (2 * nv * vw) >= nthreads)
        nv *= 2;
    const int64_t bch = (int64_t)nv * vw;
    const int nth = clamp_threads(nthreads, 2.0 * B * W->Nb * W->n * Kp, (B + bch - 1) / bch);
    int64_t nbc;
    float *gyp = make_panel_x(dY, y16, ldg, B, W->N, Nm, bch, &nbc, nth, 0);
    if (!gyp) return -3;
    cgb_gx_args a = {W, gyp, Nm, nbc, bch, B, dX, ldx, gx, 0, 0};
    run_parallel(nth, cgb_gx_task, &a);
    free(gyp);
    return a.err;
}

int nm_colgrouped_grad_input_f32(const nm_colgrouped *W, int64_t B, const float *dY, int64_t ldg,
                                 float *dX, int64_t ldx, int nthreads)
{
    return cg_grad_input_driver(W, B, dY, 0, ldg, dX, ldx, nthreads);
}

/* ----------------------------------------------------------- values gradient -- */
typedef struct {
    const nm_colgrouped *W; const float *xp, *gyp; int64_t Kp, Nm, nblk, bb; float *out;
    cgb_gv_fn fn;
} cgb_gv_args;

/* Each thread owns a range of row blocks (its outputs) and sweeps the batch blocks in
 * order: a block of x (Kp x bb floats) stays in the thread's L2 for all its row blocks. */
static void cgb_gv_task(void *p, int tid, int nth)
{
    cgb_gv_args *a = (cgb_gv_args *)p;
    int64_t q0, q1;
    split(a->W->Nb, tid, nth, &q0, &q1);
    if (q1 <= q0) return;
    for (int64_t k = 0; k < a->nblk; k++)
        a->fn(a->W, a->xp + k * a->Kp * a->bb, a->gyp + k * a->Nm * a->bb, a->bb, q0, q1, a->out, k == 0);
}

/* nm_colgrouped_grad_values_f32 on dY and X each float32 or bfloat16 bits (y16, x16). */
static int cg_grad_values_driver(const nm_colgrouped *W, int64_t B, const void *dY, int y16, int64_t ldg,
                                 const void *X, int x16, int64_t ldx, float *out, int nthreads)
{
    if (cg_check_shape(W) || cg_check_tables(W, 1) || B < 0) return -1;
    const int64_t Kp = (int64_t)W->P * W->L, Nm = W->Nb * W->m;
    const int64_t total = W->Nb * Kp * W->n;
    if (total == 0) return 0;
    if (B == 0) { memset(out, 0, (size_t)total * sizeof(float)); return 0; }
    cgb_gx_fn gx; cgb_gv_fn gv;
    const int vw = cgb_pick(&gx, &gv);
    /* batch rows per block: 256 (STEN_NM_CGBWD_VECTORS vectors), fewer for a small batch:
     * long dot products amortise their reductions (measured: 64 rows were 1.6-2x slower);
     * STEN_NM_CGBWD_XBYTES caps x's block (Kp x bb floats) */
    int64_t nvb = env_int("STEN_NM_CGBWD_VECTORS", 256 / vw);
    if (getenv("STEN_NM_CGBWD_XBYTES")) {
        const int64_t cap = env_int("STEN_NM_CGBWD_XBYTES", 256 * 1024) / (Kp * vw * 4);
        nvb = cap < 1 ? 1 : (cap < nvb ? cap : nvb);
    }
    if (nvb * vw > B) nvb = (B + vw - 1) / vw;
    const int64_t bb = nvb * vw;
    const int nth = clamp_threads(nthreads, 2.0 * B * total, W->Nb);
    int64_t nblk, nblk2;
    float *xp = make_panel_x(X, x16, ldx, B, W->K, Kp, bb, &nblk, nth, 0);
    float *gyp = make_panel_x(dY, y16, ldg, B, W->N, Nm, bb, &nblk2, nth, 0);
    if (!xp || !gyp) { free(xp); free(gyp); return -3; }
    cgb_gv_args a = {W, xp, gyp, Kp, Nm, nblk, bb, out, gv};
    run_parallel(nth, cgb_gv_task, &a);
    free(xp); free(gyp);
    return 0;
}

int nm_colgrouped_grad_values_f32(const nm_colgrouped *W, int64_t B, const float *dY, int64_t ldg,
                                  const float *X, int64_t ldx, float *out, int nthreads)
{
    return cg_grad_values_driver(W, B, dY, 0, ldg, X, 0, ldx, out, nthreads);
}
