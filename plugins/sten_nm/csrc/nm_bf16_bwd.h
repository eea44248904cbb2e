/* Input gradients with bf16 stored values, exact and 16-row grouped n:m (included once by
 * nm_kernel.c, after its drivers): the values are widened (exact: a shift) on the kernels'
 * threads into a buffer that lives for the call only, then the float32 kernel runs on a
 * descriptor of it. The exact input gradient already builds a transposed copy of the matrix
 * per call; this is one more pass over the stored values (~1/B of the FMAs), and no float32
 * copy of the weight is kept between calls. (The values gradients read no values: their
 * kernels take the bf16 descriptor as is.) */

typedef struct { const uint16_t *h; float *w; int64_t n; } widen_args;

static void widen_task(void *p, int tid, int nth)
{
    widen_args *a = (widen_args *)p;
    int64_t i0, i1;
    split(a->n, tid, nth, &i0, &i1);
    if (i1 > i0) nm_widen_bf16(a->h + i0, a->w + i0, i1 - i0);
}

/* n bf16 values widened into a fresh 64-byte aligned float32 buffer (NULL: out of memory). */
static float *widen_bf16(const void *h, int64_t n, int nthreads)
{
    float *w = (float *)alloc64((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!w) return NULL;
    widen_args a = {(const uint16_t *)h, w, n};
    run_parallel(clamp_threads(nthreads, 4.0 * n, (n + 4095) / 4096), widen_task, &a);
    return w;
}

int nm_tgather_bf16w(const nm_mat *A, int64_t B, const float *Y, int64_t ldy, float *X, int64_t ldx,
                     const float *bias, int nthreads)
{
    if (check_mat(A) || B < 0) return -1;
    nm_mat f = *A;
    float *w = widen_bf16(A->vals, A->R * A->G * A->n, nthreads);
    if (!w) return -3;
    f.vals = w;
    const int rc = nm_tgather_f32(&f, B, Y, ldy, X, ldx, bias, nthreads);
    free(w);
    return rc;
}

int nm_grouped_tgather_bf16w(const nm_grouped *W, int64_t B, const float *dY, int64_t ldg,
                             float *dX, int64_t ldx, int nthreads)
{
    if (check_grouped(W) || B < 0) return -1;
    const int64_t gn = (W->K + W->m - 1) / W->m * W->n;
    nm_grouped f = *W;
    float *w = widen_bf16(W->vals, W->Q * gn * NM_GR, nthreads);
    if (!w) return -3;
    f.vals = w;
    const int rc = nm_grouped_tgather_f32(&f, B, dY, ldg, dX, ldx, nthreads);
    free(w);
    return rc;
}

/* ----------------------------------------------- bf16 grad_output (and x) read in C -- */
/* The backward kernels with dY (and, for the values gradients, X) given as bfloat16 bits:
 * widened while the drivers pack or regroup them (exact), so no float32 copy is made in
 * torch. w16: the descriptor's values are bfloat16 (widened for the call, as above). */
int nm_tgather_mixed(const nm_mat *A, int64_t B, const void *Y, int64_t ldy, float *X, int64_t ldx,
                     const float *bias, int nthreads, int w16, int y16)
{
    if (check_mat(A) || B < 0) return -1;
    if (!w16) return tgather_driver(A, B, Y, y16, ldy, X, ldx, bias, nthreads);
    nm_mat f = *A;
    float *w = widen_bf16(A->vals, A->R * A->G * A->n, nthreads);
    if (!w) return -3;
    f.vals = w;
    const int rc = tgather_driver(&f, B, Y, y16, ldy, X, ldx, bias, nthreads);
    free(w);
    return rc;
}

int nm_sddmm_mixed(const nm_mat *A, int64_t B, const void *Y, int64_t ldy, const void *X, int64_t ldx,
                   float *out, int nthreads, int y16, int x16)
{
    return sddmm_driver(A, B, Y, y16, ldy, X, x16, ldx, out, nthreads);
}

int nm_grouped_tgather_mixed(const nm_grouped *W, int64_t B, const void *dY, int64_t ldg, float *dX,
                             int64_t ldx, int nthreads, int w16, int y16)
{
    if (check_grouped(W) || B < 0) return -1;
    if (!w16) return grouped_tgather_driver(W, B, dY, y16, ldg, dX, ldx, nthreads);
    const int64_t gn = (W->K + W->m - 1) / W->m * W->n;
    nm_grouped f = *W;
    float *w = widen_bf16(W->vals, W->Q * gn * NM_GR, nthreads);
    if (!w) return -3;
    f.vals = w;
    const int rc = grouped_tgather_driver(&f, B, dY, y16, ldg, dX, ldx, nthreads);
    free(w);
    return rc;
}

int nm_grouped_sddmm_mixed(const nm_grouped *W, int64_t B, const void *dY, int64_t ldg, const void *X,
                           int64_t ldx, float *out, int nthreads, int y16, int x16)
{
    return grouped_sddmm_driver(W, B, dY, y16, ldg, X, x16, ldx, out, nthreads);
}

int nm_colgrouped_grad_input_mixed(const nm_colgrouped *W, int64_t B, const void *dY, int64_t ldg, float *dX,
                                   int64_t ldx, int nthreads, int y16)
{
    return cg_grad_input_driver(W, B, dY, y16, ldg, dX, ldx, nthreads);
}

int nm_colgrouped_grad_values_mixed(const nm_colgrouped *W, int64_t B, const void *dY, int64_t ldg,
                                    const void *X, int64_t ldx, float *out, int nthreads, int y16, int x16)
{
    return cg_grad_values_driver(W, B, dY, y16, ldg, X, x16, ldx, out, nthreads);
}
