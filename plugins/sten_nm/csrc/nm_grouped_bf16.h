/* Grouped n:m forward with bf16 stored values, widened in the load path (included once per
 * ISA by nm_impl.h; needs VW, SUF, vf).
 *
 * The same 6 x 16 register block and arguments as ggather (nm_grouped.h), but W->vals
 * points to bfloat16 bits ([Q][G*n][16] uint16_t): each slot's 16 values are one
 * half-width load, zero-extended and shifted into float32 (exact) in registers, so there is
 * no scratch buffer and half the weight bytes move. Unaligned loads (any data_ptr()). */
#define NMGB_CAT_(a, b) a##_##b
#define NMGB_CAT(a, b) NMGB_CAT_(a, b)
#define NVRB (NM_GR / VW)

typedef uint16_t NMGB_CAT(vh, SUF) __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint32_t NMGB_CAT(vu, SUF) __attribute__((vector_size(VW * 4)));

static void NMGB_CAT(ggather16, SUF)(const nm_grouped *W, const int32_t *offs, const float *xp,
                                     int64_t pstride, int64_t cbase, int64_t np, int64_t e0,
                                     int64_t e1, int64_t q0, int64_t q1, float *T, int64_t ldt,
                                     int first)
{
    typedef NMGB_CAT(vh, SUF) vh;
    typedef NMGB_CAT(vu, SUF) vu;
    const int64_t gn = (W->K + W->m - 1) / W->m * W->n, cb = cbase * NM_MB;
    const uint16_t *vals = (const uint16_t *)(const void *)W->vals;
    for (int64_t q = q0; q < q1; q++) {
        const uint16_t *wv = vals + (q * gn + e0) * NM_GR;
        const int32_t *oq = offs + q * gn + e0;
        const int64_t ne = e1 - e0;
        int64_t p = 0;
#if VW == 16
        /* two panels per pass: 12 accumulators, each widened vector feeds 12 FMAs */
        for (; p + 2 <= np; p += 2) {
            const float *xk0 = xp + p * pstride, *xk1 = xk0 + pstride;
            float *t = T + p * NM_MB * ldt + q * NM_GR;
            vf acc[2 * NM_MB];
            for (int i = 0; i < 2 * NM_MB; i++)
                acc[i] = first ? (vf){0} : *(const vf *)(t + i * ldt);
            for (int64_t e = 0; e < ne; e++) {
                vh h;
                __builtin_memcpy(&h, wv + e * NM_GR, sizeof h);
                const vu b = __builtin_convertvector(h, vu) << 16;
                vf w;
                __builtin_memcpy(&w, &b, sizeof b);
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
            vf acc[NM_MB][NVRB];
            for (int i = 0; i < NM_MB; i++)
                for (int u = 0; u < NVRB; u++)
                    acc[i][u] = first ? (vf){0} : *(const vf *)(t + i * ldt + u * VW);
            for (int64_t e = 0; e < ne; e++) {
                vf w[NVRB];
                for (int u = 0; u < NVRB; u++) {
                    vh h;
                    __builtin_memcpy(&h, wv + e * NM_GR + u * VW, sizeof h);
                    const vu b = __builtin_convertvector(h, vu) << 16;
                    __builtin_memcpy(&w[u], &b, sizeof b);
                }
                const float *xe = xk + (oq[e] - cb);
#pragma GCC unroll 6
                for (int i = 0; i < NM_MB; i++) {
                    const float s = xe[i];
#pragma GCC unroll 4
                    for (int u = 0; u < NVRB; u++) acc[i][u] += s * w[u];
                }
            }
            for (int i = 0; i < NM_MB; i++)
                for (int u = 0; u < NVRB; u++) *(vf *)(t + i * ldt + u * VW) = acc[i][u];
        }
    }
}

#undef NVRB
#undef NMGB_CAT
#undef NMGB_CAT_
