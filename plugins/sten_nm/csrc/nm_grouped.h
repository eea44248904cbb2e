/* Grouped n:m kernel body (included once per ISA by nm_impl.h; needs VW, SUF, vf).
 *
 * Groups of NM_GR = 16 output rows share one n:m pattern per group of m columns,
 * so the kernel is a dense-GEMM-like 6 x 16 register block: per kept column,
 * 16 / VW weight vectors and 6 broadcasts of x feed 6 * 16 / VW FMAs. */
#define NMG_CAT_(a, b) a##_##b
#define NMG_CAT(a, b) NMG_CAT_(a, b)
#define NVR (NM_GR / VW)

static void NMG_CAT(ggather, SUF)(const nm_grouped *W, const float *xp, int64_t Kpad, int64_t B,
                                  int64_t bb, float *Y, int64_t ldy, const float *bias,
                                  int64_t q0, int64_t q1, int32_t *offs)
{
    const int n = W->n, m = W->m, bits = W->bits, per = W->per;
    const uint32_t mask = (1u << bits) - 1u;
    const int64_t G = (W->K + m - 1) / m, gn = G * n;
    const int64_t npan = (B + NM_MB - 1) / NM_MB;
    const int64_t ppb = bb / NM_MB;   /* micro-panels per batch block */
    for (int64_t p0 = 0; p0 < npan; p0 += ppb) {
        const int64_t p1 = p0 + ppb < npan ? p0 + ppb : npan;
        for (int64_t q = q0; q < q1; q++) {
            /* decode this row group's kept columns (as offsets into a micro-panel) */
            const uint32_t *wp = W->idx + q * W->iw;
            uint32_t cur = wp[0];
            int left = per;
            for (int64_t e = 0, base = 0; e < gn; base += m)
                for (int t = 0; t < n; t++, e++) {
                    if (left == 0) { cur = *++wp; left = per; }
                    offs[e] = (int32_t)((base + (int64_t)(cur & mask)) * NM_MB);
                    cur >>= bits; left--;
                }
            const float *wv = W->vals + q * gn * NM_GR;
            const int32_t *rows = W->perm + q * NM_GR;
            for (int64_t p = p0; p < p1; p++) {
                const float *xk = xp + p * Kpad * NM_MB;
                vf acc[NM_MB][NVR];
                for (int i = 0; i < NM_MB; i++)
                    for (int u = 0; u < NVR; u++) acc[i][u] = (vf){0};
                for (int64_t e = 0; e < gn; e++) {
                    vf w[NVR];
                    for (int u = 0; u < NVR; u++) w[u] = *(const vf *)(wv + e * NM_GR + u * VW);
                    const float *xe = xk + offs[e];
#pragma GCC unroll 6
                    for (int i = 0; i < NM_MB; i++) {
                        const float s = xe[i];
#pragma GCC unroll 4
                        for (int u = 0; u < NVR; u++) acc[i][u] += s * w[u];
                    }
                }
                const int64_t bmax = B - p * NM_MB < NM_MB ? B - p * NM_MB : NM_MB;
                for (int i = 0; i < bmax; i++) {
                    float *yrow = Y + (p * NM_MB + i) * ldy;
                    for (int u = 0; u < NVR; u++)
                        for (int l = 0; l < VW; l++) {
                            const int32_t r = rows[u * VW + l];
                            if (r >= 0) yrow[r] = acc[i][u][l] + (bias ? bias[r] : 0.0f);
                        }
                }
            }
        }
    }
}

#undef NVR
#undef NMG_CAT
#undef NMG_CAT_
