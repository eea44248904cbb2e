/* Exact n:m forward with bf16 stored values (included once by nm_kernel.c after its
 * driver). The float32 driver's units of rows (gather_rows: the unit's values and offsets
 * beside one batch chunk's panel in L2), each thread widens the unit's kept values into a
 * buffer (rows x G*n floats, shifted into float32: exact) and runs the ISA's float32 gather
 * kernel on the unit (a descriptor of its rows); the widening is read once per unit and
 * reused over every batch chunk, ~1/B of the FMAs. The x panel is the cached scratch one.
 * float32 accumulation; no float32 copy of the weight is kept. */

static void bf16_gather_task(void *p, int tid, int nth)
{
    gather_args *a = (gather_args *)p;   /* the float32 driver's arguments (gather_driver) */
    const nm_mat *A = a->A;
    const int64_t gn = A->G * A->n;
    (void)tid; (void)nth;
    float *ytmp = NULL, *wv = NULL;
    int32_t *offs = NULL;
    const int64_t rows = a->rows;
    for (int64_t u; (u = next_unit(&a->next)) * rows < A->R;) {
        if (!ytmp) {
            ytmp = (float *)alloc64((size_t)(NM_ROWS * a->bch) * sizeof(float));
            offs = (int32_t *)alloc64((size_t)(rows * gn) * sizeof(int32_t));
            wv = (float *)alloc64((size_t)(rows * gn) * sizeof(float));
            if (!ytmp || !offs || !wv) { free(ytmp); free(offs); free(wv); a->err = -3; return; }
        }
        const int64_t r0 = u * rows, r1 = r0 + rows < A->R ? r0 + rows : A->R;
        nm_widen_bf16((const uint16_t *)(const void *)A->vals + r0 * gn, wv, (r1 - r0) * gn);
        nm_mat blk = *A;            /* rows [r0, r1) as a float32 matrix of their own */
        blk.R = r1 - r0;
        blk.vals = wv;
        blk.idx = A->idx + r0 * A->iw;
        a->fn(&blk, a->xp, a->Cpad, a->nbc, a->B, a->Y + r0, a->ldy, a->bias ? a->bias + r0 : NULL,
              0, r1 - r0, ytmp, offs, a->kbg);
    }
    free(ytmp); free(offs); free(wv);
}

int nm_gather_bf16w(const nm_mat *A, int64_t B, const float *X, int64_t ldx, float *Y, int64_t ldy,
                    const float *bias, int nthreads)
{
    return gather_driver(A, B, X, 0, ldx, Y, NULL, ldy, bias, nthreads, bf16_gather_task, (A->R + NM_ROWS - 1) / NM_ROWS);
}

/* bf16 X and bf16 values: X widened while packing its panel (no float32 copy of X) */
int nm_gather_bf16wx(const nm_mat *A, int64_t B, const uint16_t *X, int64_t ldx, float *Y, int64_t ldy,
                     const float *bias, int nthreads)
{
    return gather_driver(A, B, X, 1, ldx, Y, NULL, ldy, bias, nthreads, bf16_gather_task, (A->R + NM_ROWS - 1) / NM_ROWS);
}

/* float32 -> bfloat16 bits: f32_to_bf16_rne (nm_transpose.h), run on the kernels' threads.
 * Faster than torch's Tensor.to(bfloat16) on the kernels' outputs (measured 8 ms for 1024 x
 * 3072 with two threads there). */
typedef struct { const uint32_t *x; uint16_t *y; int64_t n; } to_bf16_args;

static void to_bf16_span(const uint32_t *restrict x, uint16_t *restrict y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) y[i] = f32_to_bf16_rne(x[i]);
}

#ifdef STEN_NM_X86
__attribute__((target("avx2"))) static void to_bf16_span_avx2(const uint32_t *restrict x, uint16_t *restrict y,
                                                               int64_t n)
{
    for (int64_t i = 0; i < n; i++) y[i] = f32_to_bf16_rne(x[i]);
}
#endif

static void to_bf16_task(void *p, int tid, int nth)
{
    to_bf16_args *a = (to_bf16_args *)p;
    int64_t i0, i1;
    split(a->n, tid, nth, &i0, &i1);
#ifdef STEN_NM_X86
    if (table()->vw >= 8) { to_bf16_span_avx2(a->x + i0, a->y + i0, i1 - i0); return; }
#endif
    to_bf16_span(a->x + i0, a->y + i0, i1 - i0);
}

int nm_f32_to_bf16(const float *x, uint16_t *y, int64_t n, int nthreads)
{
    if (n < 0) return -1;
    if (n == 0) return 0;
    to_bf16_args a = {(const uint32_t *)(const void *)x, y, n};
    run_parallel(clamp_threads(nthreads, 4.0 * n, (n + 4095) / 4096), to_bf16_task, &a);
    return 0;
}

/* ------------------------------------------------- grouped n:m, bf16 values -- */
/* Grouped forward with bf16 values, 8- and 4-float vectors (AVX2, portable): the float32
 * driver's two schedules, but the kernel runs
 * one row group at a time on that group's chunk of slots widened into a per-thread buffer
 * (kc x 16 floats, in L1/L2) and its offsets copied beside them, through a descriptor of
 * just that chunk (K = the chunk's columns, Q = 1); widening costs ~1/(6 x panels) of the FMAs. */
static void gbf16_group(const ggather_args *a, int64_t q, int64_t e0, int64_t e1, const float *xp,
                        int64_t pstride, int64_t cbase, int64_t np, float *T, float *wv, int32_t *ob,
                        int first)
{
    const nm_grouped *W = a->W;
    const int64_t gn = (W->K + W->m - 1) / W->m * W->n, ne = e1 - e0;
    nm_widen_bf16((const uint16_t *)(const void *)W->vals + (q * gn + e0) * NM_GR, wv, ne * NM_GR);
    memcpy(ob, a->offs + q * gn + e0, (size_t)ne * sizeof(int32_t));
    nm_grouped sub = *W;
    sub.K = ne / W->n * W->m;   /* chunks are whole groups of m columns: G*n = ne */
    sub.Q = 1;
    sub.vals = wv;
    a->fn(&sub, ob, xp, pstride, cbase, np, 0, ne, 0, 1, T + q * NM_GR, a->ldt, first);
}

static void gbf16_rows_task(void *p, int tid, int nth)
{
    ggather_args *a = (ggather_args *)p;
    const nm_grouped *W = a->W;
    const int64_t gn = (W->K + W->m - 1) / W->m * W->n, ccols = a->kc / W->n * W->m;
    int64_t pa, pb;
    split(a->npan, tid, nth, &pa, &pb);
    if (pb <= pa) return;
    float *T = (float *)alloc64((size_t)(a->mcp * NM_MB * a->ldt) * sizeof(float));
    float *xb = (float *)alloc64((size_t)(a->mcp * NM_MB * ccols) * sizeof(float));
    float *wv = (float *)alloc64((size_t)(a->kc * NM_GR) * sizeof(float));
    int32_t *ob = (int32_t *)alloc64((size_t)a->kc * sizeof(int32_t));
    int err = 0;
    float *tile = gpack_tile(a, &err);
    if (!T || !xb || !wv || !ob || err) {
        free(T); free(xb); free(wv); free(ob); free(tile);
        a->err = -3;
        return;
    }
    for (int64_t p0 = pa; p0 < pb; p0 += a->mcp) {
        const int64_t np = p0 + a->mcp < pb ? a->mcp : pb - p0;
        for (int64_t e0 = 0; e0 < gn; e0 += a->kc) {
            const int64_t e1 = e0 + a->kc < gn ? e0 + a->kc : gn;
            const int64_t c0 = e0 / W->n * W->m, c1 = e1 / W->n * W->m;
            for (int64_t i = 0; i < np; i++) gpack(a, p0 + i, c0, c1, tile, xb + i * NM_MB * (c1 - c0));
            for (int64_t q = 0; q < W->Q; q++)
                gbf16_group(a, q, e0, e1, xb, NM_MB * (c1 - c0), c0, np, T, wv, ob, e0 == 0);
        }
        const int64_t b1 = (p0 + np) * NM_MB < a->B ? (p0 + np) * NM_MB : a->B;
        unpermute(a, T, p0 * NM_MB, b1);
    }
    free(T); free(xb); free(wv); free(ob); free(tile);
}

static void gbf16_groups_task(void *p, int tid, int nth)
{
    ggather_args *a = (ggather_args *)p;
    const int64_t gn = (a->W->K + a->W->m - 1) / a->W->m * a->W->n;
    int64_t q0, q1;
    split(a->W->Q, tid, nth, &q0, &q1);
    if (q1 <= q0) return;
    float *wv = (float *)alloc64((size_t)(a->kc * NM_GR) * sizeof(float));
    int32_t *ob = (int32_t *)alloc64((size_t)a->kc * sizeof(int32_t));
    if (!wv || !ob) { free(wv); free(ob); a->err = -3; return; }
    for (int64_t e0 = 0; e0 < gn; e0 += a->kc) {
        const int64_t e1 = e0 + a->kc < gn ? e0 + a->kc : gn;
        for (int64_t q = q0; q < q1; q++)
            gbf16_group(a, q, e0, e1, a->xp, a->Kpad * NM_MB, 0, a->npan, a->T, wv, ob, e0 == 0);
    }
    free(wv); free(ob);
}

/* The grouped driver with the tasks above; 4x the float32 driver's panels per block: each
 * widening serves 4x the batch rows. */
static int grouped_gather_bf16w_scratch(const nm_grouped *W, int64_t B, const void *X, int x16, int64_t ldx,
                                        float *Y, uint16_t *Y16, int64_t ldy, const float *bias, int nthreads)
{
    const grouped_schedule s = {table()->ggather, gbf16_rows_task, gbf16_groups_task, 512 * 1024};
    return grouped_drive(W, B, X, x16, ldx, Y, Y16, ldy, bias, nthreads, &s);
}

/* Grouped forward with bf16 values. AVX-512: the float32 driver (both schedules) around
 * ggather16 (nm_grouped_bf16.h), which widens each slot's 16 values in registers as it loads
 * them and pairs micro-panels, so each widened vector feeds 12 FMAs: no scratch buffer
 * (measured 1.04-1.13x the float32 kernel, one thread). With 8- or 4-float vectors the
 * registers do not hold two panels and the in-register widening costs 4 operations per 12 FMAs
 * (measured 0.8-0.87x on AVX2), so those widen per row group and chunk into a buffer instead
 * (docs/nm.md). */
static int grouped_gather_bf16w_x(const nm_grouped *W, int64_t B, const void *X, int x16, int64_t ldx,
                                  float *Y, uint16_t *Y16, int64_t ldy, const float *bias, int nthreads)
{
    if (table()->vw >= 16 || env_int("STEN_NM_BF16_IN_REGISTERS", 0))
        return grouped_gather_with(W, B, X, x16, ldx, Y, Y16, ldy, bias, nthreads, table()->ggather16);
    return grouped_gather_bf16w_scratch(W, B, X, x16, ldx, Y, Y16, ldy, bias, nthreads);
}

int nm_grouped_gather_bf16w(const nm_grouped *W, int64_t B, const float *X, int64_t ldx,
                            float *Y, int64_t ldy, const float *bias, int nthreads)
{
    return grouped_gather_bf16w_x(W, B, X, 0, ldx, Y, NULL, ldy, bias, nthreads);
}

/* nm_grouped_gather_bf16w with bf16 x, widened while packing its micro-panels (gpack). */
int nm_grouped_gather_bf16wx(const nm_grouped *W, int64_t B, const uint16_t *X, int64_t ldx,
                             float *Y, int64_t ldy, const float *bias, int nthreads)
{
    return grouped_gather_bf16w_x(W, B, X, 1, ldx, Y, NULL, ldy, bias, nthreads);
}

/* ------------------------------------------------ exact forward, bf16 output -- */
/* The exact forward's bf16 result (a bf16 x and bf16 weight, or CPU autocast) rounded on the
 * kernels' threads unit by unit: each unit of rows runs into a per-thread float32 block
 * ([B][rows], in L2) that is rounded into Y16 while it is in cache, so there is no float32
 * Y in memory, no second pass over it and no second fork/join (the previous path: float32 Y,
 * then nm_f32_to_bf16). Same bits as that path. */

/* y16[i] = bf16(y[i]) (round to nearest even), i < n. */
static void round_span(const float *y, uint16_t *y16, int64_t n)
{
#ifdef STEN_NM_X86
    if (table()->vw >= 8) { to_bf16_span_avx2((const uint32_t *)(const void *)y, y16, n); return; }
#endif
    to_bf16_span((const uint32_t *)(const void *)y, y16, n);
}

/* An empty contraction's bf16 result: every output row the bias (or 0), rounded. */
static void fill_with_bias_bf16(uint16_t *Y, int64_t B, int64_t R, int64_t ldy, const float *bias)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < R; r++) {
            const float v = bias ? bias[r] : 0.0f;
            uint32_t u;
            memcpy(&u, &v, sizeof u);
            Y[b * ldy + r] = f32_to_bf16_rne(u);
        }
}

static void gather_out16(gather_args *a, int w16)
{
    const nm_mat *A = a->A;
    const int64_t gn = A->G * A->n, rows = a->rows;
    float *ytmp = NULL, *wv = NULL, *yb = NULL;
    int32_t *offs = NULL;
    for (int64_t u; (u = next_unit(&a->next)) * rows < A->R;) {
        if (!ytmp) {
            ytmp = (float *)alloc64((size_t)(NM_ROWS * a->bch) * sizeof(float));
            offs = (int32_t *)alloc64((size_t)(rows * gn) * sizeof(int32_t));
            yb = (float *)alloc64((size_t)(a->B * rows) * sizeof(float));
            wv = w16 ? (float *)alloc64((size_t)(rows * gn) * sizeof(float)) : NULL;
            if (!ytmp || !offs || !yb || (w16 && !wv)) {
                free(ytmp); free(offs); free(yb); free(wv);
                a->err = -3;
                return;
            }
        }
        const int64_t r0 = u * rows, r1 = r0 + rows < A->R ? r0 + rows : A->R, nr = r1 - r0;
        nm_mat blk = *A;            /* rows [r0, r1) as a matrix of their own */
        blk.R = nr;
        blk.idx = A->idx + r0 * A->iw;
        if (w16) {
            nm_widen_bf16((const uint16_t *)(const void *)A->vals + r0 * gn, wv, nr * gn);
            blk.vals = wv;
        } else {
            blk.vals = A->vals + r0 * gn;
        }
        a->fn(&blk, a->xp, a->Cpad, a->nbc, a->B, yb, rows, a->bias ? a->bias + r0 : NULL, 0, nr, ytmp, offs,
              a->kbg);
        for (int64_t b = 0; b < a->B; b++) round_span(yb + b * rows, a->Y16 + b * a->ldy + r0, nr);
    }
    free(ytmp); free(offs); free(yb); free(wv);
}

static void gather_out16_task(void *p, int tid, int nth)
{
    (void)tid; (void)nth;
    gather_out16((gather_args *)p, 0);
}

static void bf16_gather_out16_task(void *p, int tid, int nth)
{
    (void)tid; (void)nth;
    gather_out16((gather_args *)p, 1);
}

int nm_gather_bf16x_out16(const nm_mat *A, int64_t B, const uint16_t *X, int64_t ldx, uint16_t *Y, int64_t ldy,
                          const float *bias, int nthreads, int w16)
{
    if (check_mat(A) || B < 0) return -1;
    if (B == 0 || A->R == 0) return 0;
    if (A->C == 0) {
        fill_with_bias_bf16(Y, B, A->R, ldy, bias);
        return 0;
    }
    if (w16)
        return gather_driver(A, B, X, 1, ldx, NULL, Y, ldy, bias, nthreads, bf16_gather_out16_task,
                             (A->R + NM_ROWS - 1) / NM_ROWS);
    return gather_driver(A, B, X, 1, ldx, NULL, Y, ldy, bias, nthreads, gather_out16_task, A->R);
}

/* nm_grouped_gather_bf16x (w16 = 0) / nm_grouped_gather_bf16wx (w16 = 1) with a bfloat16 result
 * (uint16_t [B][N], row stride ldy): each row rounded as the driver writes it in order. */
int nm_grouped_gather_bf16x_out16(const nm_grouped *W, int64_t B, const uint16_t *X, int64_t ldx, uint16_t *Y,
                                  int64_t ldy, const float *bias, int nthreads, int w16)
{
    if (check_grouped(W) || B < 0) return -1;
    if (B == 0 || W->N == 0) return 0;
    if (W->K == 0) {
        fill_with_bias_bf16(Y, B, W->N, ldy, bias);
        return 0;
    }
    if (w16) return grouped_gather_bf16w_x(W, B, X, 1, ldx, NULL, Y, ldy, bias, nthreads);
    return grouped_gather_with(W, B, X, 1, ldx, NULL, Y, ldy, bias, nthreads, table()->ggather);
}
