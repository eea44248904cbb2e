/* Grouped n:m kernel body (included once per ISA by nm_impl.h; needs VW, SUF, vf).
 *
 * Groups of NM_GR = 16 output rows share one n:m pattern per group of m columns,
 * so the kernel is a dense-GEMM-like 6 x 16 register block: per kept column,
 * 16 / VW weight vectors and 6 broadcasts of x feed 6 * 16 / VW FMAs (with 16-float
 * vectors, two 6-row micro-panels per pass: 12 FMAs per weight vector).
 * Results go to T (the rows of a batch block, columns in the grouped order) with
 * whole-vector stores; the driver puts them back in the original row order. */
#define NMG_CAT_(a, b) a##_##b
#define NMG_CAT(a, b) NMG_CAT_(a, b)
#define NVR (NM_GR / VW)

/* ggather: kept slots [e0, e1) of row groups [q0, q1) times np packed micro-panels of x
 * (panel p at xp + p * pstride, [column - cbase][NM_MB]); nm_ggather_body.h */
#define GG_FN NMG_CAT(ggather, SUF)
#define GG_VT float
#define GG_LOAD(p) (*(const vfu *)(p))
#include "nm_ggather_body.h"

/* Gradient of the stored values, one row group and one chunk of its slots:
 * out[e][j] (+)= sum_b gq[b][j] * xt[cols[e] * ldb + b] for e < ne, b < kb, j < 16,
 * where gq is the group's rows of dY ([b][16], grouped order) and xt is x
 * transposed. 6 slots x 16 rows per register block. */
static void NMG_CAT(gsddmm, SUF)(const float *gq, const float *xt, int64_t ldb, const int32_t *cols,
                                 int64_t ne, int64_t kb, float *out, int first)
{
    for (int64_t e0 = 0; e0 < ne; e0 += NM_MB) {
        const int ns = ne - e0 < NM_MB ? (int)(ne - e0) : NM_MB;
        const float *xs[NM_MB];
        for (int s = 0; s < NM_MB; s++) xs[s] = xt + (int64_t)cols[e0 + (s < ns ? s : 0)] * ldb;
        vf acc[NM_MB][NVR];
        for (int s = 0; s < NM_MB; s++)
            for (int u = 0; u < NVR; u++)
                acc[s][u] = (first || s >= ns) ? (vf){0} : *(const vfu *)(out + (e0 + s) * NM_GR + u * VW);
        for (int64_t b = 0; b < kb; b++) {
            vf g[NVR];
            for (int u = 0; u < NVR; u++) g[u] = *(const vf *)(gq + b * NM_GR + u * VW);
#pragma GCC unroll 6
            for (int s = 0; s < NM_MB; s++) {
                const float v = xs[s][b];
#pragma GCC unroll 4
                for (int u = 0; u < NVR; u++) acc[s][u] += v * g[u];
            }
        }
        for (int s = 0; s < ns; s++)
            for (int u = 0; u < NVR; u++) *(vfu *)(out + (e0 + s) * NM_GR + u * VW) = acc[s][u];
    }
}

/* One row back in the original order: y[r] = t[inv[r]] (+ bias[r]) for r < N
 * (vector stores; the loads are the permutation's gather). */
static void NMG_CAT(unperm, SUF)(const float *t, const int32_t *inv, const float *bias, int64_t N,
                                 float *y)
{
    int64_t r = 0;
    for (; r + VW <= N; r += VW) {
        vf v, b = (vf){0};
        for (int l = 0; l < VW; l++) v[l] = t[inv[r + l]];
        if (bias) __builtin_memcpy(&b, bias + r, sizeof b);
        v += b;
        __builtin_memcpy(y + r, &v, sizeof v);
    }
    for (; r < N; r++) y[r] = t[inv[r]] + (bias ? bias[r] : 0.0f);
}

/* Input gradient, one row group: gxt[cols[e]][b] += sum_j wv[e][j] * gyt[j][b] for the
 * group's slots e < gn, its 16 rows j and batch columns b < nb (a multiple of VW); gyt
 * and gxt are batch-minor with row stride ld. Per half of the group (8 rows, kept in
 * registers) and vector of batch: 6 slots at a time, 8 broadcasts and FMAs each. */
static void NMG_CAT(gtgather, SUF)(const float *wv, const int32_t *cols, int64_t gn,
                                   const float *gyt, float *gxt, int64_t ld, int64_t nb)
{
    for (int h = 0; h < NM_GR; h += 8)
        for (int64_t p = 0; p < nb; p += VW) {
            vf g[8];
            for (int jj = 0; jj < 8; jj++) g[jj] = *(const vf *)(gyt + (h + jj) * ld + p);
            int64_t e0 = 0;
            for (; e0 + NM_MB <= gn; e0 += NM_MB) {
                float *o[NM_MB];
                vf acc[NM_MB];
                for (int s = 0; s < NM_MB; s++) {
                    o[s] = gxt + (int64_t)cols[e0 + s] * ld + p;
                    acc[s] = *(const vf *)o[s];
                }
#pragma GCC unroll 8
                for (int jj = 0; jj < 8; jj++) {
#pragma GCC unroll 6
                    for (int s = 0; s < NM_MB; s++) acc[s] += wv[(e0 + s) * NM_GR + h + jj] * g[jj];
                }
                for (int s = 0; s < NM_MB; s++) *(vf *)o[s] = acc[s];
            }
            for (; e0 < gn; e0++) {
                float *o = gxt + (int64_t)cols[e0] * ld + p;
                vf acc = *(const vf *)o;
                for (int jj = 0; jj < 8; jj++) acc += wv[e0 * NM_GR + h + jj] * g[jj];
                *(vf *)o = acc;
            }
        }
}

#undef NVR
#undef NMG_CAT
#undef NMG_CAT_
