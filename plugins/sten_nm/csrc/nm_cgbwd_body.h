/* Column-grouped n:m backward kernels, one ISA (included by nm_colgrouped_bwd.h after
 * defining CGB_VW (floats per vector), CGB_SUF (suffix) and CGB_TARGET (a function
 * attribute: the instruction set, or nothing for the portable build)). */
#define CGB_CAT_(a, b) a##_##b
#define CGB_CAT(a, b) CGB_CAT_(a, b)
typedef float CGB_CAT(cgbv, CGB_SUF) __attribute__((vector_size(CGB_VW * 4)));
#define CGB_V CGB_CAT(cgbv, CGB_SUF)

/* Input gradient of one batch chunk (bch = NV vectors) for the slots [0, L) of one
 * (row block, pattern): gxt[cols[t]] += sum_{j < NJ} v[j*L + t] * g_j, the NJ rows' dY
 * vectors (g) in registers. */
static inline __attribute__((always_inline)) CGB_TARGET void CGB_CAT(cgb_gx_rows, CGB_SUF)(
    const float *const *g, const float *v, int64_t L, const int32_t *cols, float *gxt, int64_t bch,
    const int NV, const int NJ)
{
    CGB_V gr[4][4];
    for (int j = 0; j < NJ; j++)
        for (int u = 0; u < NV; u++) gr[j][u] = *(const CGB_V *)(g[j] + u * CGB_VW);
    for (int64_t t = 0; t < L; t++) {
        float *o = gxt + (int64_t)cols[t] * bch;
        CGB_V acc[4];
        for (int u = 0; u < NV; u++) acc[u] = *(const CGB_V *)(o + u * CGB_VW);
        for (int j = 0; j < NJ; j++) {
            const float w = v[(int64_t)j * L + t];
            for (int u = 0; u < NV; u++) acc[u] += w * gr[j][u];
        }
        for (int u = 0; u < NV; u++) *(CGB_V *)(o + u * CGB_VW) = acc[u];
    }
}

#define CGB_GX_CASE(nv, nj) CGB_CAT(cgb_gx_rows, CGB_SUF)(g, vj, L, cols, gxt, bch, nv, nj)
/* One batch chunk: every (row block, pattern), rows in groups of up to 4. */
static CGB_TARGET void CGB_CAT(cgb_gx, CGB_SUF)(const nm_colgrouped *W, const float *gyp, float *gxt,
                                                int64_t bch, float *wbuf)
{
    const int n = W->n, m = W->m, P = W->P, NV = (int)(bch / CGB_VW);
    const int64_t L = W->L;
    for (int64_t q = 0; q < W->Nb; q++)
        for (int p = 0; p < P; p++) {
            const int32_t *cols = W->cols + (q * P + p) * L;
            const float *v = cgb_values(W, q, p, wbuf);
            const int32_t *rows = W->pats + p * n;
            for (int j0 = 0; j0 < n; j0 += 4) {
                const int nj = n - j0 < 4 ? n - j0 : 4;
                const float *g[4];
                for (int j = 0; j < nj; j++) g[j] = gyp + (q * m + rows[j0 + j]) * bch;
                const float *vj = v + (int64_t)j0 * L;
#define CGB_NJ_SWITCH(nv) \
                switch (nj) { case 1: CGB_GX_CASE(nv, 1); break; case 2: CGB_GX_CASE(nv, 2); break; \
                              case 3: CGB_GX_CASE(nv, 3); break; default: CGB_GX_CASE(nv, 4); break; }
                if (NV == 1) { CGB_NJ_SWITCH(1) }
                else if (NV == 2) { CGB_NJ_SWITCH(2) }
                else { CGB_NJ_SWITCH(4) }
#undef CGB_NJ_SWITCH
            }
        }
}
#undef CGB_GX_CASE

/* Values gradient of row blocks [q0, q1) over one batch block (bb = nvb vectors; x's
 * block xp [Kp][bb], dY's gyp [Nb*m][bb]): out[q][p][j][t] (+)= sum_b dY[b][row] x[b][col]. */
static CGB_TARGET void CGB_CAT(cgb_gv, CGB_SUF)(const nm_colgrouped *W, const float *xp, const float *gyp,
                                                int64_t bb, int64_t q0, int64_t q1, float *out, int first)
{
    const int n = W->n, m = W->m, P = W->P;
    const int64_t L = W->L, nvb = bb / CGB_VW;
    for (int64_t q = q0; q < q1; q++)
        for (int p = 0; p < P; p++) {
            const int32_t *cols = W->cols + (q * P + p) * L;
            const int32_t *rows = W->pats + p * n;
            float *o = out + (q * P + p) * (int64_t)n * L;
            int64_t t = 0;
            for (; t + 4 <= L; t += 4) {   /* 4 dot products per row, one reduction each */
                const float *x0 = xp + (int64_t)cols[t] * bb, *x1 = xp + (int64_t)cols[t + 1] * bb;
                const float *x2 = xp + (int64_t)cols[t + 2] * bb, *x3 = xp + (int64_t)cols[t + 3] * bb;
                for (int j = 0; j < n; j++) {
                    const float *g = gyp + (q * m + rows[j]) * bb;
                    CGB_V s0 = (CGB_V){0}, s1 = (CGB_V){0}, s2 = (CGB_V){0}, s3 = (CGB_V){0};
                    for (int64_t u = 0; u < nvb; u++) {
                        const CGB_V gv = *(const CGB_V *)(g + u * CGB_VW);
                        s0 += gv * *(const CGB_V *)(x0 + u * CGB_VW);
                        s1 += gv * *(const CGB_V *)(x1 + u * CGB_VW);
                        s2 += gv * *(const CGB_V *)(x2 + u * CGB_VW);
                        s3 += gv * *(const CGB_V *)(x3 + u * CGB_VW);
                    }
                    float h0 = 0.0f, h1 = 0.0f, h2 = 0.0f, h3 = 0.0f;
                    for (int l = 0; l < CGB_VW; l++) { h0 += s0[l]; h1 += s1[l]; h2 += s2[l]; h3 += s3[l]; }
                    float *oj = o + (int64_t)j * L + t;
                    if (first) { oj[0] = h0; oj[1] = h1; oj[2] = h2; oj[3] = h3; }
                    else { oj[0] += h0; oj[1] += h1; oj[2] += h2; oj[3] += h3; }
                }
            }
            for (; t < L; t++) {
                const float *x = xp + (int64_t)cols[t] * bb;
                for (int j = 0; j < n; j++) {
                    const float *g = gyp + (q * m + rows[j]) * bb;
                    CGB_V acc = (CGB_V){0};
                    for (int64_t u = 0; u < nvb; u++)
                        acc += *(const CGB_V *)(g + u * CGB_VW) * *(const CGB_V *)(x + u * CGB_VW);
                    float h = 0.0f;
                    for (int l = 0; l < CGB_VW; l++) h += acc[l];
                    o[(int64_t)j * L + t] = first ? h : o[(int64_t)j * L + t] + h;
                }
            }
        }
}

#undef CGB_V
#undef CGB_CAT
#undef CGB_CAT_
