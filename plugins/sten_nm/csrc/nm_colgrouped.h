/* Column-grouped n:m kernel body (the paper's format; included once per ISA by nm_impl.h;
 * needs VW, SUF, vf). Row block q, pattern p: the L columns it owns, n rows; per column one
 * batch vector of x (NV vectors from the packed panel) feeds n FMAs. */
#define NMC_CAT_(a, b, c) a##_##b##_##c
#define NMC_CAT(a, b, c) NMC_CAT_(a, b, c)
#define NMC_ROWS 4   /* pattern rows per register block */

/* Slots [t0, t1) of every pattern (a range of whole chunks: its x columns, a block of the
 * panel, stay in L1 while the row blocks [q0, q1) sweep it); first: start ytmp at zero. */
static void NMC_CAT(cgg, SUF, NV)(const nm_colgrouped *W, const float *panel, int64_t q0, int64_t q1,
                                   int64_t t0, int64_t t1, float *ytmp, int first)
{
    const int n = W->n, m = W->m, P = W->P;
    const int64_t L = W->L;
    for (int64_t q = q0; q < q1; q++) {
        float *yt = ytmp + (q - q0) * m * BCHN;
        if (first)
            for (int64_t i = 0; i < m * BCHN; i++) yt[i] = 0.0f;
        for (int p = 0; p < P; p++) {
            const int32_t *cols = W->cols + (q * P + p) * L;
            const float *v = W->vals + (q * P + p) * (int64_t)n * L;
            const int32_t *rows = W->pats + p * n;
            for (int j0 = 0; j0 < n; j0 += NMC_ROWS) {
                const int nj = n - j0 < NMC_ROWS ? n - j0 : NMC_ROWS;
                vf acc[NMC_ROWS][NV];
                for (int j = 0; j < NMC_ROWS; j++)
                    for (int u = 0; u < NV; u++) acc[j][u] = (vf){0};
                for (int64_t t = t0; t < t1; t++) {
                    const float *px = panel + (int64_t)cols[t] * BCHN;
                    vf xv[NV];
                    for (int u = 0; u < NV; u++) xv[u] = *(const vf *)(px + u * VW);
                    for (int j = 0; j < nj; j++) {
                        const float s = v[(int64_t)(j0 + j) * L + t];
#pragma GCC unroll 8
                        for (int u = 0; u < NV; u++) acc[j][u] += s * xv[u];
                    }
                }
                for (int j = 0; j < nj; j++) {
                    float *o = yt + (int64_t)rows[j0 + j] * BCHN;
                    for (int u = 0; u < NV; u++) *(vf *)(o + u * VW) += acc[j][u];
                }
            }
        }
    }
}

#undef NMC_ROWS
#undef NMC_CAT
#undef NMC_CAT_
