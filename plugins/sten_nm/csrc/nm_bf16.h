/* Exact n:m forward with bf16 stored values (included once by nm_kernel.c after its
 * driver). A block of NM_ROWS rows at a time, each thread widens the block's kept values
 * into a scratch buffer in L1 (NM_ROWS x G*n floats, shifted into float32: exact) and runs
 * the ISA's float32 gather kernel on that block (a descriptor of the block's rows); the
 * widening is read once per block and reused over every batch chunk, ~1/B of the FMAs.
 * float32 accumulation; no float32 copy of the weight is kept. */

typedef struct {
    const nm_mat *A; const float *xp; int64_t Cpad, nbc, B; float *Y; int64_t ldy;
    const float *bias; int64_t kbg, bch; nm_gather_fn fn; int err; int64_t next;
} bf16_gather_args;

static void bf16_gather_task(void *p, int tid, int nth)
{
    bf16_gather_args *a = (bf16_gather_args *)p;
    const nm_mat *A = a->A;
    const int64_t gn = A->G * A->n;
    (void)tid; (void)nth;
    float *ytmp = NULL, *wv = NULL;
    int32_t *offs = NULL;
    for (int64_t u; (u = next_unit(&a->next)) * NM_ROWS < A->R;) {
        if (!ytmp) {
            ytmp = (float *)alloc64((size_t)(NM_ROWS * a->bch) * sizeof(float));
            offs = (int32_t *)alloc64((size_t)(NM_ROWS * gn) * sizeof(int32_t));
            wv = (float *)alloc64((size_t)(NM_ROWS * gn) * sizeof(float));
            if (!ytmp || !offs || !wv) { free(ytmp); free(offs); free(wv); a->err = -3; return; }
        }
        const int64_t r0 = u * NM_ROWS, r1 = r0 + NM_ROWS < A->R ? r0 + NM_ROWS : A->R;
        const uint16_t *h = (const uint16_t *)(const void *)A->vals + r0 * gn;
        uint32_t *w = (uint32_t *)wv;
        for (int64_t i = 0; i < (r1 - r0) * gn; i++) w[i] = (uint32_t)h[i] << 16;
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
    int nth = clamp_threads(nthreads, 2.0 * B * A->R * A->G * A->n, (A->R + NM_ROWS - 1) / NM_ROWS);
    int64_t nbc;
    float *xp = make_panel(X, ldx, B, A->C, Cpad, bch, &nbc, nth);
    if (!xp) return -3;
    bf16_gather_args ga = {A, xp, Cpad, nbc, B, Y, ldy, bias, block_groups(A, bch), bch, T->gather[nvi], 0, 0};
    run_parallel(nth, bf16_gather_task, &ga);
    free(xp);
    return ga.err;
}

/* float32 -> bfloat16 bits, round to nearest even, NaN -> 0x7fc0 (torch's scalar
 * rounding; its vectorised one gives 0xffff, also a NaN);
 * branch-free so the loop vectorises, run on the kernels' threads. Faster than torch's
 * Tensor.to(bfloat16) on the kernels' outputs (measured 8 ms for 1024 x 3072 with two
 * threads there). */
static inline uint16_t f32_to_bf16_rne(uint32_t u)
{
    const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(nan ? 0x7fc0u : r);
}

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
/* Grouped forward with bf16 values: the float32 driver (both schedules) around the ISA's
 * ggather16 kernel (nm_grouped_bf16.h), which widens each slot's 16 values in registers
 * as it loads them: no scratch buffer, half the weight bytes of float32 (measured 1.04-1.13x
 * the float32 kernel on AVX-512, one thread; docs/nm.md). */
int nm_grouped_gather_bf16w(const nm_grouped *W, int64_t B, const float *X, int64_t ldx,
                            float *Y, int64_t ldy, const float *bias, int nthreads)
{
    return grouped_gather_with(W, B, X, ldx, Y, ldy, bias, nthreads, table()->ggather16);
}
