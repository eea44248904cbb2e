/* Kernel bodies, included by nm_impl.h once per NV (vectors per batch chunk).
 * Needs: VW (floats per vector), NV, SUF (ISA suffix), vf (vector type).
 * Offsets are decoded once per block of rows (nm_decode) into float offsets of
 * the panel, so the inner loops are: load value, load offset, NV FMAs. */
#include "nm_transpose.h"
#define BCHN (VW * NV)
/* rows ahead whose values and offsets the exact forward prefetches (0: none; A/B at build time) */
#ifndef NM_PF_ROWS
#define NM_PF_ROWS 2
#endif
#define NMCAT3_(a, b, c) a##_##b##_##c
#define NMCAT3(a, b, c) NMCAT3_(a, b, c)
#define FN(name) NMCAT3(name, SUF, NV)

static void FN(gather)(const nm_mat *A, const float *xp, int64_t Cpad, int64_t nbc, int64_t B,
                       float *Y, int64_t ldy, const float *bias, int64_t r0, int64_t r1,
                       float *ytmp, int32_t *offs, int64_t kbg)
{
    /* Loop order: the rows [r0, r1) (offsets decoded once; offs holds (r1 - r0) * G * n)
     * -> batch chunk (its panel stays in L2 while every block of the rows sweeps it) ->
     * block of NM_ROWS rows -> block of columns (panel block in L1) -> row (accumulators
     * in ytmp, L1) -> kept values. */
    const int n = A->n;
    const int64_t G = A->G, gn = G * n;
    nm_decode(A, r0, r1, 0, G, BCHN, offs);
    for (int64_t bc = 0; bc < nbc; bc++) {
        const float *panel = xp + bc * Cpad * BCHN;
        const int64_t bmax = B - bc * BCHN < BCHN ? B - bc * BCHN : BCHN;
        for (int64_t rb = r0; rb < r1; rb += NM_ROWS) {
            const int64_t re = rb + NM_ROWS < r1 ? rb + NM_ROWS : r1;
            for (int64_t g0 = 0; g0 < G; g0 += kbg) {
                const int64_t g1 = g0 + kbg < G ? g0 + kbg : G;
                const int64_t e0 = g0 * n, e1 = g1 * n;
                int64_t r = rb;
#if NV < 8 && (VW >= 16 ? 32 : 16) >= 2 * NV + 4
                /* two rows at once: twice the independent FMA chains (NV alone is too
                 * few to hide the FMA latency), where the registers hold them */
                for (; r + 2 <= re; r += 2) {
                    vf acc0[NV], acc1[NV];
                    float *yt0 = ytmp + (r - rb) * BCHN, *yt1 = yt0 + BCHN;
                    if (g0 == 0) {
                        for (int u = 0; u < NV; u++) acc0[u] = acc1[u] = (vf){0};
                    } else {
                        for (int u = 0; u < NV; u++) {
                            acc0[u] = *(const vf *)(yt0 + u * VW);
                            acc1[u] = *(const vf *)(yt1 + u * VW);
                        }
                    }
                    const float *v0 = A->vals + r * gn, *v1 = v0 + gn;
                    const int32_t *o0 = offs + (r - r0) * gn, *o1 = o0 + gn;
                    /* the next row pair's values and offsets of this block (gn apart per row,
                     * in L2: the hardware prefetcher does not follow 128-byte pieces that far
                     * apart). A/B, fastest of 6 x 7: 1 thread 3072x768 2:4 31.7 -> 30.0 ms, 1:4
                     * 18.5 -> 17.3, 768x3072 2:4 34.9 -> 34.0; 2 threads 3072x768 2:4 16.6 -> 15.9 */
                    if (NM_PF_ROWS && r + NM_PF_ROWS + 2 <= re) {
                        for (int64_t e = e0; e < e1; e += 16) {
                            __builtin_prefetch(v0 + NM_PF_ROWS * gn + e);
                            __builtin_prefetch(v1 + NM_PF_ROWS * gn + e);
                            __builtin_prefetch(o0 + NM_PF_ROWS * gn + e);
                            __builtin_prefetch(o1 + NM_PF_ROWS * gn + e);
                        }
                    }
                    for (int64_t e = e0; e < e1; e++) {
                        const float s0 = v0[e], s1 = v1[e];
                        const float *px0 = panel + o0[e], *px1 = panel + o1[e];
#pragma GCC unroll 8
                        for (int u = 0; u < NV; u++) {
                            acc0[u] += s0 * *(const vf *)(px0 + u * VW);
                            acc1[u] += s1 * *(const vf *)(px1 + u * VW);
                        }
                    }
                    for (int u = 0; u < NV; u++) {
                        *(vf *)(yt0 + u * VW) = acc0[u];
                        *(vf *)(yt1 + u * VW) = acc1[u];
                    }
                }
#endif
                for (; r < re; r++) {
                    vf acc[NV];
                    float *yt = ytmp + (r - rb) * BCHN;
                    if (g0 == 0) {
                        for (int u = 0; u < NV; u++) acc[u] = (vf){0};
                    } else {
                        for (int u = 0; u < NV; u++) acc[u] = *(const vf *)(yt + u * VW);
                    }
                    const float *v = A->vals + r * gn;
                    const int32_t *o = offs + (r - r0) * gn;
                    for (int64_t e = e0; e < e1; e++) {
                        const float s = v[e];
                        const float *px = panel + o[e];
#pragma GCC unroll 8
                        for (int u = 0; u < NV; u++) acc[u] += s * *(const vf *)(px + u * VW);
                    }
                    for (int u = 0; u < NV; u++) *(vf *)(yt + u * VW) = acc[u];
                }
            }
            nm_store_transposed(ytmp, BCHN, re - rb, bmax, Y + bc * BCHN * ldy + rb, ldy,
                                bias ? bias + rb : NULL);
        }
    }
}

static void FN(scatter)(const nm_mat *A, const float *yp, int64_t nbc, int64_t B, float *X,
                        int64_t ldx, const float *bias, int64_t ga, int64_t gb, float *acc,
                        int32_t *offs, int64_t kbg)
{
    /* Loop order: block of columns (offsets of all rows decoded once) -> batch chunk
     * -> row -> kept values (read-modify-write of the L1 accumulator block). */
    const int n = A->n, m = A->m;
    const int64_t gn = A->G * n, R = A->R, C = A->C;
    for (int64_t g0 = ga; g0 < gb; g0 += kbg) {
        const int64_t g1 = g0 + kbg < gb ? g0 + kbg : gb;
        const int64_t ne = (g1 - g0) * n;
        const int64_t ncols = (g1 - g0) * m;
        nm_decode(A, 0, R, g0, g1, BCHN, offs);
        for (int64_t bc = 0; bc < nbc; bc++) {
            const float *panel = yp + bc * R * BCHN;
            const int64_t bmax = B - bc * BCHN < BCHN ? B - bc * BCHN : BCHN;
            for (int64_t i = 0; i < ncols * BCHN; i++) acc[i] = 0.0f;
            for (int64_t r = 0; r < R; r++) {
                vf yv[NV];
                for (int u = 0; u < NV; u++) yv[u] = *(const vf *)(panel + r * BCHN + u * VW);
                const float *v = A->vals + r * gn + g0 * n;
                const int32_t *o = offs + r * ne;
                for (int64_t e = 0; e < ne; e++) {
                    const float s = v[e];
                    float *q = acc + o[e];
#pragma GCC unroll 8
                    for (int u = 0; u < NV; u++) *(vf *)(q + u * VW) += s * yv[u];
                }
            }
            const int64_t c0 = g0 * m, c1 = g1 * m < C ? g1 * m : C;
            for (int64_t b = 0; b < bmax; b++) {
                float *xrow = X + (bc * BCHN + b) * ldx;
                if (bias) {
                    for (int64_t c = c0; c < c1; c++) xrow[c] = acc[(c - c0) * BCHN + b] + bias[c];
                } else {
                    for (int64_t c = c0; c < c1; c++) xrow[c] = acc[(c - c0) * BCHN + b];
                }
            }
        }
    }
}

/* out[r][e] = sum_b Y[b][r] X[b][col(r, e)]. Loop order: block of NM_ROWS rows (offsets
 * decoded once) -> block of columns -> batch chunk (its panel block in L1) -> row -> kept
 * values, each adding its NV-vector product into one vector accumulator per kept value
 * (vacc: NM_ROWS * kbg * n vectors), reduced across lanes once, after the last chunk.
 * Reducing every kept value's dot product in every chunk instead cost 2.5-3x as long
 * (3072x768 1:4, 2 threads, Xeon SPR: 67 ms against 24; dense GEMM's whole product 20-30). */
static void FN(sddmm)(const nm_mat *A, const float *xp, int64_t Cpad, const float *yp,
                      int64_t nbc, float *out, int64_t r0, int64_t r1, int32_t *offs, int64_t kbg,
                      float *vacc)
{
    const int n = A->n;
    const int64_t G = A->G, gn = G * n, R = A->R;
    for (int64_t rb = r0; rb < r1; rb += NM_ROWS) {
        const int64_t re = rb + NM_ROWS < r1 ? rb + NM_ROWS : r1;
        nm_decode(A, rb, re, 0, G, BCHN, offs);
        for (int64_t g0 = 0; g0 < G; g0 += kbg) {
            const int64_t g1 = g0 + kbg < G ? g0 + kbg : G;
            const int64_t e0 = g0 * n, ne = (g1 - g0) * n;
            for (int64_t i = 0; i < (re - rb) * ne; i++) *(vf *)(vacc + i * VW) = (vf){0};
            for (int64_t bc = 0; bc < nbc; bc++) {
                const float *panel = xp + bc * Cpad * BCHN;
                const float *ypanel = yp + bc * R * BCHN;
                for (int64_t r = rb; r < re; r++) {
                    vf yv[NV];
#pragma GCC unroll 8
                    for (int u = 0; u < NV; u++) yv[u] = *(const vf *)(ypanel + r * BCHN + u * VW);
                    const int32_t *o = offs + (r - rb) * gn + e0;
                    float *va = vacc + (r - rb) * ne * VW;
                    for (int64_t e = 0; e < ne; e++) {
                        const float *px = panel + o[e];
                        vf s = *(const vf *)(va + e * VW);
#pragma GCC unroll 8
                        for (int u = 0; u < NV; u++) s += yv[u] * *(const vf *)(px + u * VW);
                        *(vf *)(va + e * VW) = s;
                    }
                }
            }
            for (int64_t r = rb; r < re; r++) {
                const float *va = vacc + (r - rb) * ne * VW;
                float *o_out = out + r * gn + e0;
                for (int64_t e = 0; e < ne; e++) {
                    const vf s = *(const vf *)(va + e * VW);
                    float h = 0.0f;
                    for (int l = 0; l < VW; l++) h += s[l];
                    o_out[e] = h;
                }
            }
        }
    }
}

/* CSR gather (used for X = Y A, through the transpose of A built per call):
 * X[b][c] = sum_{p in row c} tv[p] * Y[b][src(p)], with toff[p] = src(p) * BCHN and
 * the entries of each row sorted by src. Blocked over src rows with per-row cursors. */
static void FN(cgather)(const int64_t *rowptr, const int32_t *toff, const float *tv, int64_t c0,
                        int64_t c1, const float *yp, int64_t R, int64_t nbc, int64_t B, float *X,
                        int64_t ldx, const float *bias, float *ytmp, int64_t *cur, int64_t kbr)
{
    for (int64_t rb = c0; rb < c1; rb += NM_ROWS) {
        const int64_t re = rb + NM_ROWS < c1 ? rb + NM_ROWS : c1;
        for (int64_t bc = 0; bc < nbc; bc++) {
            const float *panel = yp + bc * R * BCHN;
            const int64_t bmax = B - bc * BCHN < BCHN ? B - bc * BCHN : BCHN;
            for (int64_t c = rb; c < re; c++) cur[c - rb] = rowptr[c];
            for (int64_t s0 = 0; s0 < R; s0 += kbr) {
                const int64_t lim = (s0 + kbr < R ? s0 + kbr : R) * BCHN;
                for (int64_t c = rb; c < re; c++) {
                    vf acc[NV];
                    float *yt = ytmp + (c - rb) * BCHN;
                    if (s0 == 0) {
                        for (int u = 0; u < NV; u++) acc[u] = (vf){0};
                    } else {
                        for (int u = 0; u < NV; u++) acc[u] = *(const vf *)(yt + u * VW);
                    }
                    int64_t p = cur[c - rb];
                    const int64_t end = rowptr[c + 1];
                    for (; p < end && toff[p] < lim; p++) {
                        const float s = tv[p];
                        const float *px = panel + toff[p];
#pragma GCC unroll 8
                        for (int u = 0; u < NV; u++) acc[u] += s * *(const vf *)(px + u * VW);
                    }
                    cur[c - rb] = p;
                    for (int u = 0; u < NV; u++) *(vf *)(yt + u * VW) = acc[u];
                }
            }
            for (int64_t b = 0; b < bmax; b++) {
                float *xrow = X + (bc * BCHN + b) * ldx;
                for (int64_t c = rb; c < re; c++)
                    xrow[c] = ytmp[(c - rb) * BCHN + b] + (bias ? bias[c] : 0.0f);
            }
        }
    }
}

#include "nm_colgrouped.h"

#undef BCHN
#undef FN
#undef NMCAT3
#undef NMCAT3_
