/* Column-grouped (paper format) forward with bf16 activations read by the kernel (included
 * once by nm_kernel.c, after its drivers). Two paths, same result up to float32 rounding
 * order (float32 accumulation in both; bf16 x and bf16 values are exact in float32):
 *
 *  - dot (AVX512_BF16, `vdpbf16ps`), when the ISA is avx512, the CPU has avx512_bf16 (cpuid
 *    at run time; the function is compiled with a target attribute, so the library builds
 *    and runs on CPUs without it) and the values are bf16: x is packed once per batch chunk
 *    as a bf16 panel [Kp][bch] (bch a multiple of 32); per pattern, two slots' x columns are
 *    interleaved into adjacent-K pairs (2 loads + 2 unpacks per 32 batch rows) and each of
 *    the pattern's n rows takes one `vdpbf16ps` per 16 batch rows with the two slots' values
 *    as one 32-bit broadcast (adjacent in vals[..][j][L]): half the multiply instructions
 *    and half the x bytes of the float32 kernel. The unpacks work within 128-bit lanes: the
 *    accumulators hold the batch rows in their order, put back with one permute per 16 rows
 *    when a pattern's rows are written (once per L slots).
 *    The loop order is the stream one (units of 8 row blocks x one batch chunk, every slot
 *    per pass, x columns prefetched ahead): variant NM_CG_STREAM (or AUTO resolving to it).
 *  - widen (every ISA, fp32 values, and the tiled order): the float32 driver
 *    (cg_gather_driver) in either loop order, x widened to float32 while each batch chunk's
 *    panel is packed (no float32 copy of x in torch), on the tile-major packed weight where
 *    it has one. With bf16 values the tuner times this tiled order against the dot path: at
 *    3072x768 1:10 (2 threads) the dot path ran 0.93x the float32 forward's tiled order.
 *
 * STEN_NM_BF16_DOT=0 (or nm_set_bf16_dot(0)) turns the dot path off. */
#ifdef STEN_NM_X86
#include <immintrin.h>
#endif

static int g_bf16_dot = -1;   /* -1: not decided yet (env, cpuid) */

static int bf16_dot_supported(void)
{
#ifdef STEN_NM_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

int nm_bf16_dot_supported(void) { return bf16_dot_supported(); }

/* The switch (env STEN_NM_BF16_DOT at first use, else on where supported; nm_set_bf16_dot). */
int nm_bf16_dot_enabled(void)
{
    if (g_bf16_dot < 0) {
        const char *e = getenv("STEN_NM_BF16_DOT");
        g_bf16_dot = bf16_dot_supported() && !(e && strcmp(e, "0") == 0);
    }
    return g_bf16_dot;
}

int nm_set_bf16_dot(int on)
{
    if (on && !bf16_dot_supported()) return -1;
    g_bf16_dot = on ? 1 : 0;
    return 0;
}

/* Whether a bf16-x, bf16-values product runs on vdpbf16ps now (the ISA avx512 and on). */
int nm_bf16_dot(void)
{
    return nm_bf16_dot_enabled() && table()->vw >= 16;
}

typedef struct {
    const nm_colgrouped *W; const uint16_t *X; int64_t ldx, B, Kp, bch, nbc;
    void *xp; float *Y; uint16_t *Y16; int64_t ldy; const float *bias; int err; int64_t next;
} cgx_args;

#define CGX_PC NM_BF16_PC   /* panel columns per packing unit (the rows' segments stay in L1) */

/* bf16 panel of batch chunk bc, columns [c0, c0 + CGX_PC) (fewer at Kp): bits [c][bch], zero
 * past B or K: pack_panel_bf16's float32 panel (nm_bf16_pack.h) in f, its high halves kept. */
static void cgx_pack(const cgx_args *a, int64_t bc, int64_t c0, float *tile, float *f)
{
    const int64_t bch = a->bch;
    const int64_t c1 = c0 + CGX_PC < a->Kp ? c0 + CGX_PC : a->Kp;
    pack_panel_bf16(a->X, a->ldx, a->B, a->W->K, bc * bch, bch, c0, c1, tile, f);
    uint16_t *restrict d = (uint16_t *)a->xp + (bc * a->Kp + c0) * bch;
    const uint32_t *restrict s = (const uint32_t *)f;
    for (int64_t i = 0; i < (c1 - c0) * bch; i++) d[i] = (uint16_t)(s[i] >> 16);
}

static void cgx_pack_task(void *p, int tid, int nth)
{
    cgx_args *a = (cgx_args *)p;
    (void)tid; (void)nth;
    const int64_t ncu = (a->Kp + CGX_PC - 1) / CGX_PC;
    float *tile = NULL, *f = NULL;
    for (int64_t u; (u = next_unit(&a->next)) < a->nbc * ncu;) {
        if (!tile) {
            tile = (float *)alloc64((size_t)(CGX_PC * a->bch) * sizeof(float));
            f = (float *)alloc64((size_t)(CGX_PC * a->bch) * sizeof(float));
            if (!tile || !f) { free(tile); free(f); a->err = -3; return; }
        }
        cgx_pack(a, u / ncu, (u % ncu) * CGX_PC, tile, f);
    }
    free(tile);
    free(f);
}

#ifdef STEN_NM_X86
#define CGX_AHEAD 8
#define CGX_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* out[j][b] += sum_{t < L} v[j*L + t] x[b][cols[t]] for j < NJ, b < 32 * NP: two slots per
 * step, one vdpbf16ps per row and 16 batch rows. */
static inline __attribute__((always_inline)) CGX_TARGET void cgx_dot_pair(
    const uint16_t *panel, int64_t bch, const int32_t *cols, const uint16_t *v, int64_t L, int64_t t,
    __m512 (*acc)[4], const int NJ, const int NP)
{
    /* the columns are data-dependent (no hardware prefetch): fetch ahead */
    const int64_t tp = t + CGX_AHEAD + 1 < L ? t + CGX_AHEAD : L - 2;
    __builtin_prefetch(panel + (int64_t)cols[tp] * bch);
    __builtin_prefetch(panel + (int64_t)cols[tp + 1] * bch);
    if (NP == 2) {
        __builtin_prefetch(panel + (int64_t)cols[tp] * bch + 32);
        __builtin_prefetch(panel + (int64_t)cols[tp + 1] * bch + 32);
    }
    const uint16_t *xa = panel + (int64_t)cols[t] * bch, *xb = panel + (int64_t)cols[t + 1] * bch;
    __m512i xv[4];
#pragma GCC unroll 2
    for (int u = 0; u < NP; u++) {
        const __m512i A = _mm512_load_si512((const void *)(xa + 32 * u));
        const __m512i Bv = _mm512_load_si512((const void *)(xb + 32 * u));
        xv[2 * u] = _mm512_unpacklo_epi16(A, Bv);
        xv[2 * u + 1] = _mm512_unpackhi_epi16(A, Bv);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NJ; j++) {
        uint32_t wp;
        __builtin_memcpy(&wp, v + (int64_t)j * L + t, sizeof wp);
        const __m512i w = _mm512_set1_epi32((int)wp);
#pragma GCC unroll 4
        for (int u = 0; u < 2 * NP; u++)
            acc[j][u] = _mm512_dpbf16_ps(acc[j][u], (__m512bh)xv[u], (__m512bh)w);
    }
}

/* out[j][b] += sum_{t < L} v[j*L + t] x[b][cols[t]] for j < NJ, b < 32 * NP: two slots per
 * step, one vdpbf16ps per row and 16 batch rows; with fewer than 8 accumulators (n = 1) two
 * sets take alternate slot pairs (the instruction's latency hidden). */
static inline __attribute__((always_inline)) CGX_TARGET void cgx_dot_rows(
    const uint16_t *panel, int64_t bch, const int32_t *cols, const uint16_t *v, int64_t L,
    float *const *out, const int NJ, const int NP)
{
    __m512 acc[2][4][4];
    const int S = NJ * 2 * NP < 8 ? 2 : 1;
    for (int s = 0; s < 2; s++)
        for (int j = 0; j < 4; j++)
            for (int u = 0; u < 4; u++) acc[s][j][u] = _mm512_setzero_ps();
    int64_t t = 0;
    if (S == 2)
        for (; t + 4 <= L; t += 4) {
            cgx_dot_pair(panel, bch, cols, v, L, t, acc[0], NJ, NP);
            cgx_dot_pair(panel, bch, cols, v, L, t + 2, acc[1], NJ, NP);
        }
    for (; t + 2 <= L; t += 2) cgx_dot_pair(panel, bch, cols, v, L, t, acc[0], NJ, NP);
    if (t < L) {   /* odd slot: paired with a zero column and a zero value */
        const uint16_t *xa = panel + (int64_t)cols[t] * bch;
        __m512i xv[4];
        for (int u = 0; u < NP; u++) {
            const __m512i A = _mm512_load_si512((const void *)(xa + 32 * u));
            xv[2 * u] = _mm512_unpacklo_epi16(A, _mm512_setzero_si512());
            xv[2 * u + 1] = _mm512_unpackhi_epi16(A, _mm512_setzero_si512());
        }
        for (int j = 0; j < NJ; j++) {
            const __m512i w = _mm512_set1_epi32((int)(uint32_t)v[(int64_t)j * L + t]);
            for (int u = 0; u < 2 * NP; u++)
                acc[0][j][u] = _mm512_dpbf16_ps(acc[0][j][u], (__m512bh)xv[u], (__m512bh)w);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NJ; j++)
#pragma GCC unroll 4
        for (int u = 0; u < 2 * NP; u++) {
            __m512 r = acc[0][j][u];
            if (S == 2) r = _mm512_add_ps(r, acc[1][j][u]);
            acc[0][j][u] = r;
        }
    /* the unpacks' lanes: lo[4L+k] is batch row 8L+k, hi[4L+k] row 8L+4+k (L < 4, k < 4) */
    const __m512i n0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i n1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 4
    for (int j = 0; j < NJ; j++)
#pragma GCC unroll 2
        for (int u = 0; u < NP; u++) {
            const __m512 lo = acc[0][j][2 * u], hi = acc[0][j][2 * u + 1];
            float *o = out[j] + 32 * u;
            _mm512_store_ps(o, _mm512_add_ps(_mm512_load_ps(o), _mm512_permutex2var_ps(lo, n0, hi)));
            _mm512_store_ps(o + 16, _mm512_add_ps(_mm512_load_ps(o + 16), _mm512_permutex2var_ps(lo, n1, hi)));
        }
}

#define CGX_CALL(NJ_, NP_) cgx_dot_rows(panel, bch, cols, vj, L, out, NJ_, NP_)
#define CGX_NJ(NP_) { switch (nj) { case 1: CGX_CALL(1, NP_); break; case 2: CGX_CALL(2, NP_); break; \
    case 3: CGX_CALL(3, NP_); break; default: CGX_CALL(4, NP_); break; } }

/* Row blocks [q0, q1) of one batch chunk (bch = 32 or 64) into ytmp [q][m][bch] (zeroed here). */
static CGX_TARGET void cgx_dot_blocks(const nm_colgrouped *W, const uint16_t *panel, int64_t bch,
                                      int64_t q0, int64_t q1, float *ytmp)
{
    const int n = W->n, m = W->m, P = W->P;
    const int64_t L = W->L;
    for (int64_t q = q0; q < q1; q++) {
        float *yt = ytmp + (q - q0) * m * bch;
        for (int64_t i = 0; i < m * bch; i++) yt[i] = 0.0f;
        for (int p = 0; p < P; p++) {
            const int32_t *cols = W->cols + (q * P + p) * L;
            const uint16_t *v = (const uint16_t *)W->vals + (q * P + p) * (int64_t)n * L;
            const int32_t *rows = W->pats + p * n;
            for (int j0 = 0; j0 < n; j0 += 4) {
                const int nj = n - j0 < 4 ? n - j0 : 4;
                float *out[4] = {yt, yt, yt, yt};
                for (int j = 0; j < nj; j++) out[j] = yt + (int64_t)rows[j0 + j] * bch;
                const uint16_t *vj = v + (int64_t)j0 * L;
                if (bch == 64) CGX_NJ(2) else CGX_NJ(1)
            }
        }
    }
}
#undef CGX_NJ
#undef CGX_CALL
#endif

#define CGX_QB 8   /* row blocks per unit: their accumulators stay in L1 */

static void cgx_task(void *p, int tid, int nth)
{
    cgx_args *a = (cgx_args *)p;
    const nm_colgrouped *W = a->W;
    (void)tid; (void)nth;
    const int64_t nq = (W->Nb + CGX_QB - 1) / CGX_QB;
    float *ytmp = NULL;
    for (int64_t u; (u = next_unit(&a->next)) < a->nbc * nq;) {
        if (!ytmp && !(ytmp = (float *)alloc64((size_t)(CGX_QB * W->m * a->bch) * sizeof(float)))) {
            a->err = -3;
            return;
        }
        const int64_t bc = u / nq, qa = (u % nq) * CGX_QB, qe = qa + CGX_QB < W->Nb ? qa + CGX_QB : W->Nb;
#ifdef STEN_NM_X86   /* the dot path runs only there (nm_bf16_dot) */
        cgx_dot_blocks(W, (const uint16_t *)a->xp + bc * a->Kp * a->bch, a->bch, qa, qe, ytmp);
#endif
        cg_store_unit(W, ytmp, a->B, a->bch, bc, qa, qe, a->Y, a->Y16, a->ldy, a->bias);
    }
    free(ytmp);
}

/* The dot path's driver: the bf16 panel packed in one parallel region, then the units. */
static int cgx_dot_driver(const nm_colgrouped *W, int64_t B, const uint16_t *X, int64_t ldx, float *Y,
                          uint16_t *Y16, int64_t ldy, const float *bias, int nthreads)
{
    const int64_t bch = B > 32 ? 64 : 32;
    const int64_t Kp = (int64_t)W->P * W->L, nbc = (B + bch - 1) / bch;
    const int nth = clamp_threads(nthreads, 2.0 * B * W->Nb * W->n * Kp, W->Nb);
    void *xp = alloc64((size_t)(nbc * Kp * bch) * 2);
    if (!xp) return -3;
    cgx_args a = {W, X, ldx, B, Kp, bch, nbc, xp, Y, Y16, ldy, bias, 0, 0};
    run_parallel(nth, cgx_pack_task, &a);
    a.next = 0;
    run_parallel(nth, cgx_task, &a);
    free(xp);
    return a.err;
}

/* bf16 x: the dot path where it runs (bf16 values, nm_bf16_dot) in the stream order, else x
 * widened into the float32 driver's panel in the variant's loop order (NM_CG_AUTO:
 * STEN_NM_CG_VARIANT, else stream); into float32 Y, or bf16 Y16 (Y NULL). */
static int cgx_gather(const nm_colgrouped *W, int64_t B, const uint16_t *X, int64_t ldx, float *Y, uint16_t *Y16,
                      int64_t ldy, const float *bias, int nthreads, int variant)
{
    if (cg_check_shape(W) || B < 0 || variant < NM_CG_AUTO || variant > NM_CG_TILED) return -1;
    if (B == 0 || W->N == 0) return 0;
    if (W->K == 0 || W->L == 0) {
        if (Y16) fill_with_bias_bf16(Y16, B, W->N, ldy, bias);
        else fill_with_bias(Y, B, W->N, ldy, bias);
        return 0;
    }
    if (variant == NM_CG_AUTO) variant = (int)env_int("STEN_NM_CG_VARIANT", NM_CG_STREAM);
    /* the dot path runs in the stream order; the tiled order widens x (the tuner picks) */
    if (W->vtype == NM_BF16 && nm_bf16_dot() && variant != NM_CG_TILED)
        return cg_check_tables(W, 1) ? -1 : cgx_dot_driver(W, B, X, ldx, Y, Y16, ldy, bias, nthreads);
    return cg_gather_driver(W, B, X, 1, ldx, Y, Y16, ldy, bias, nthreads, variant, 1);
}

int nm_colgrouped_gather_bf16x_variant(const nm_colgrouped *W, int64_t B, const uint16_t *X, int64_t ldx,
                                       float *Y, int64_t ldy, const float *bias, int nthreads, int variant)
{
    return cgx_gather(W, B, X, ldx, Y, NULL, ldy, bias, nthreads, variant);
}

int nm_colgrouped_gather_bf16x_out16(const nm_colgrouped *W, int64_t B, const uint16_t *X, int64_t ldx,
                                     uint16_t *Y, int64_t ldy, const float *bias, int nthreads, int variant)
{
    return cgx_gather(W, B, X, ldx, NULL, Y, ldy, bias, nthreads, variant);
}

int nm_colgrouped_gather_bf16x(const nm_colgrouped *W, int64_t B, const uint16_t *X, int64_t ldx,
                               float *Y, int64_t ldy, const float *bias, int nthreads)
{
    return nm_colgrouped_gather_bf16x_variant(W, B, X, ldx, Y, ldy, bias, nthreads, NM_CG_AUTO);
}
