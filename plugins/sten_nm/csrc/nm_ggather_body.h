/* The grouped n:m forward kernel (6 x 16 register block), included once per stored-value type
 * by nm_grouped.h (float32) and nm_grouped_bf16.h (bf16 widened in registers). Needs VW, vf, vfu,
 * NVR, NM_GR, NM_MB and: GG_FN (the function's name), GG_VT (the stored value type) and
 * GG_LOAD(p) (the VW floats of a vector of stored values at p, any alignment).
 *
 * Kept slots [e0, e1) of row groups [q0, q1) times np packed micro-panels of x
 * (panel p at xp + p * pstride, [column - cbase][NM_MB]); offs[q * gn + e] is the
 * slot's column times NM_MB. T rows: p * NM_MB + i, columns q * 16 + lane, row
 * stride ldt. first: start from zero, else add to T. */
static void GG_FN(const nm_grouped *W, const int32_t *offs, const float *xp, int64_t pstride,
                  int64_t cbase, int64_t np, int64_t e0, int64_t e1, int64_t q0, int64_t q1,
                  float *T, int64_t ldt, int first)
{
    const int64_t gn = (W->K + W->m - 1) / W->m * W->n, cb = cbase * NM_MB;
    for (int64_t q = q0; q < q1; q++) {
        const GG_VT *wv = (const GG_VT *)(const void *)W->vals + (q * gn + e0) * NM_GR;
        const int32_t *oq = offs + q * gn + e0;
        const int64_t ne = e1 - e0;
        int64_t p = 0;
#if VW == 16
        /* two panels per pass: 12 accumulators (6 alone are too few FMA chains for the
         * latency) and each weight vector feeds 12 FMAs */
        for (; p + 2 <= np; p += 2) {
            const float *xk0 = xp + p * pstride, *xk1 = xk0 + pstride;
            float *t = T + p * NM_MB * ldt + q * NM_GR;
            vf acc[2 * NM_MB];
            for (int i = 0; i < 2 * NM_MB; i++)
                acc[i] = first ? (vf){0} : *(const vf *)(t + i * ldt);
            for (int64_t e = 0; e < ne; e++) {
                const vf w = GG_LOAD(wv + e * NM_GR);
                const float *xe0 = xk0 + (oq[e] - cb), *xe1 = xk1 + (oq[e] - cb);
#pragma GCC unroll 6
                for (int i = 0; i < NM_MB; i++) acc[i] += xe0[i] * w;
#pragma GCC unroll 6
                for (int i = 0; i < NM_MB; i++) acc[NM_MB + i] += xe1[i] * w;
            }
            for (int i = 0; i < 2 * NM_MB; i++) *(vf *)(t + i * ldt) = acc[i];
        }
#endif
        for (; p < np; p++) {
            const float *xk = xp + p * pstride;
            float *t = T + p * NM_MB * ldt + q * NM_GR;
            vf acc[NM_MB][NVR];
            for (int i = 0; i < NM_MB; i++)
                for (int u = 0; u < NVR; u++)
                    acc[i][u] = first ? (vf){0} : *(const vf *)(t + i * ldt + u * VW);
            for (int64_t e = 0; e < ne; e++) {
                vf w[NVR];
                for (int u = 0; u < NVR; u++) w[u] = GG_LOAD(wv + e * NM_GR + u * VW);
                const float *xe = xk + (oq[e] - cb);
#pragma GCC unroll 6
                for (int i = 0; i < NM_MB; i++) {
                    const float s = xe[i];
#pragma GCC unroll 4
                    for (int u = 0; u < NVR; u++) acc[i][u] += s * w[u];
                }
            }
            for (int i = 0; i < NM_MB; i++)
                for (int u = 0; u < NVR; u++) *(vf *)(t + i * ldt + u * VW) = acc[i][u];
        }
    }
}

#undef GG_FN
#undef GG_VT
#undef GG_LOAD
