/* Column-grouped n:m kernel body (the paper's format; included once per ISA and NV by
 * nm_body.h; needs VW, SUF, vf, NV, BCHN). Row block q, pattern p: the L columns it owns,
 * n rows; per column one batch vector of x (NV vectors from the packed panel) feeds the
 * FMAs of up to NMC_NJ rows, whose accumulators stay in registers: the row count is a
 * compile-time constant in each specialisation (a run-time count made GCC keep them on
 * the stack). With at most 8 accumulators (n = 1, or n = 2 with 4 vectors, on AVX-512) two
 * alternating sets hide the FMA latency: 8 chains of a 4-cycle FMA leave no slack for 2 FMAs
 * a cycle (768x3072 2:4 passes, 1 thread: 11.5 -> 10.3 ms; 2:8 -3 %). With 12 (3:4) a second
 * set was 4-6 % slower: the registers run out. */
#define NMC_CAT_(a, b, c) a##_##b##_##c
#define NMC_CAT(a, b, c) NMC_CAT_(a, b, c)
#define NMC_CAT4_(a, b, c, d) a##_##b##_##c##_##d
#define NMC_CAT4(a, b, c, d) NMC_CAT4_(a, b, c, d)

/* vector registers of the ISA: 32 with AVX-512, 16 with AVX2 / SSE / NEON-as-4 */
#ifndef NMC_REGS
#define NMC_REGS (VW >= 16 ? 32 : 16)
#endif
/* rows per register block: accumulators + one x batch vector set + 2 spare registers */
#define NMC_NJ_RAW ((NMC_REGS - NV - 2) / NV)
#define NMC_NJ (NMC_NJ_RAW > 4 ? 4 : (NMC_NJ_RAW < 1 ? 1 : NMC_NJ_RAW))

/* slots ahead whose x columns are prefetched (STEN_NM_CG_AHEAD at build time) */
#ifndef NMC_AHEAD
#define NMC_AHEAD 8
#endif

/* acc_j += sum_{t in [t0,t1)} v[j*L + t] * x[cols[t]] for j < NJ; out[j] += acc_j. */
static inline __attribute__((always_inline)) void NMC_CAT(cgg_rows, SUF, NV)(
    const float *panel, const void *colsp, const float *v, int64_t L, int64_t t0, int64_t t1,
    float *const *out, const int NJ, const int pf, const int I16)
{
    /* columns as int32 (the stored table) or int16 (the tile-major packed form, relative to
     * the tile's base: panel points at it); I16 is a compile-time constant per call site */
    const int32_t *cols = (const int32_t *)colsp;
    const int16_t *cols16 = (const int16_t *)colsp;
#define NMC_COL(i) (I16 ? (int64_t)cols16[i] : (int64_t)cols[i])
    /* two accumulator sets when one set has at most 8 independent chains and both fit */
    const int S = (NJ * NV <= 8 && 2 * NJ * NV + NV + 2 <= NMC_REGS) ? 2 : 1;
    vf acc[2][4][NV];
    for (int s = 0; s < 2; s++)
        for (int j = 0; j < 4; j++)
            for (int u = 0; u < NV; u++) acc[s][j][u] = (vf){0};
    int64_t t = t0;
    if (S == 2) {
        for (; t + 2 <= t1; t += 2) {
#pragma GCC unroll 2
            for (int s = 0; s < 2; s++) {
                /* the columns are data-dependent (no hardware prefetch): fetch ahead */
                if (pf) {
                    const int64_t tp = t + s + NMC_AHEAD < t1 ? t + s + NMC_AHEAD : t1 - 1;
                    const float *px = panel + NMC_COL(tp) * BCHN;
#pragma GCC unroll 8
                    for (int l = 0; l < BCHN; l += 16) __builtin_prefetch(px + l);
                }
                const float *px = panel + NMC_COL(t + s) * BCHN;
                vf xv[NV];
#pragma GCC unroll 8
                for (int u = 0; u < NV; u++) xv[u] = *(const vf *)(px + u * VW);
#pragma GCC unroll 4
                for (int j = 0; j < NJ; j++) {
                    const float w = v[(int64_t)j * L + t + s];
#pragma GCC unroll 8
                    for (int u = 0; u < NV; u++) acc[s][j][u] += w * xv[u];
                }
            }
        }
    }
    for (; t < t1; t++) {
        if (pf) {
            const int64_t tp = t + NMC_AHEAD < t1 ? t + NMC_AHEAD : t1 - 1;
            const float *px = panel + NMC_COL(tp) * BCHN;
#pragma GCC unroll 8
            for (int l = 0; l < BCHN; l += 16) __builtin_prefetch(px + l);
        }
        const float *px = panel + NMC_COL(t) * BCHN;
        vf xv[NV];
#pragma GCC unroll 8
        for (int u = 0; u < NV; u++) xv[u] = *(const vf *)(px + u * VW);
#pragma GCC unroll 4
        for (int j = 0; j < NJ; j++) {
            const float w = v[(int64_t)j * L + t];
#pragma GCC unroll 8
            for (int u = 0; u < NV; u++) acc[0][j][u] += w * xv[u];
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NJ; j++)
#pragma GCC unroll 8
        for (int u = 0; u < NV; u++) {
            vf r = acc[0][j][u];
            if (S == 2) r += acc[1][j][u];
            *(vf *)(out[j] + u * VW) += r;
        }
#undef NMC_COL
}

/* cgg_rows for a packed tile of a multiple of NMC_KT slots read from L1 (the tiled order's
 * usual pass, no prefetch), in blocks of NMC_KT slots whose count, value offsets and record
 * layout are compile-time constants: no remainder loop, and four int16 columns per 64-bit
 * load. With one row per pattern every x vector feeds one FMA, so the load ports bound the
 * loop: a column load per slot was a sixth of its loads (768x3072 1:10, AVX-512, 1 thread:
 * 5.48 -> 5.12 ms). Fully unrolling the 16 slots made GCC hoist every load and spill. */
#ifndef NMC_KFIX_ONCE
#define NMC_KFIX_ONCE
#include <stdlib.h>
/* STEN_NM_CG_KFIX=0: the general slot loop for full tiles too (tests, A/B) */
static inline int nmc_kfix_enabled(void)
{
    const char *e = getenv("STEN_NM_CG_KFIX");
    return !(e && e[0] == '0');
}
#endif
#define NMC_KT NM_CG_KT_BLOCK
/* BF (a compile-time constant): vp holds bf16 values, widened as each is broadcast */
static inline __attribute__((always_inline)) void NMC_CAT(cgg_rows_kt, SUF, NV)(
    const float *panel, const int16_t *cols, const void *vp, int64_t w, float *const *out, const int NJ,
    const int BF)
{
    const float *v = (const float *)vp;
    const uint16_t *vh = (const uint16_t *)vp;
    const int S = (NJ * NV <= 8 && 2 * NJ * NV + NV + 2 <= NMC_REGS) ? 2 : 1;
    vf acc[2][4][NV];
    for (int s = 0; s < 2; s++)
        for (int j = 0; j < 4; j++)
            for (int u = 0; u < NV; u++) acc[s][j][u] = (vf){0};
    /* four int16 columns per 64-bit load: the load ports, not the FMAs, bound one row */
    for (int64_t tb = 0; tb < w; tb += NMC_KT, cols += NMC_KT, v += NMC_KT, vh += NMC_KT)
#pragma GCC unroll 2
    for (int t = 0; t < NMC_KT; t += 4) {
        uint64_t c4;
        __builtin_memcpy(&c4, cols + t, sizeof c4);
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            /* column t + s: the word's low half first on a little-endian machine */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
            const int sh = 16 * (3 - s);
#else
            const int sh = 16 * s;
#endif
            const float *px = panel + (int64_t)(uint16_t)(c4 >> sh) * BCHN;
            vf xv[NV];
#pragma GCC unroll 8
            for (int u = 0; u < NV; u++) xv[u] = *(const vf *)(px + u * VW);
#pragma GCC unroll 4
            for (int j = 0; j < NJ; j++) {
                float wv;
                if (BF) {
                    const uint32_t u = (uint32_t)vh[j * w + t + s] << 16;
                    __builtin_memcpy(&wv, &u, sizeof wv);
                } else {
                    wv = v[j * w + t + s];
                }
#pragma GCC unroll 8
                for (int u = 0; u < NV; u++) acc[S == 2 ? (s & 1) : 0][j][u] += wv * xv[u];
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NJ; j++)
#pragma GCC unroll 8
        for (int u = 0; u < NV; u++) {
            vf r = acc[0][j][u];
            if (S == 2) r += acc[1][j][u];
            *(vf *)(out[j] + u * VW) += r;
        }
}

#define NMC_CALLK(NJ_) NMC_CAT(cgg_rows_kt, SUF, NV)(pan, c16, vj, t1 - t0, out, NJ_, 0)
#if NMC_NJ >= 4
#define NMC_DISPATCHK { switch (nj) { case 1: NMC_CALLK(1); break; case 2: NMC_CALLK(2); break; \
    case 3: NMC_CALLK(3); break; default: NMC_CALLK(4); break; } }
#elif NMC_NJ >= 3
#define NMC_DISPATCHK { switch (nj) { case 1: NMC_CALLK(1); break; case 2: NMC_CALLK(2); break; \
    default: NMC_CALLK(3); break; } }
#elif NMC_NJ >= 2
#define NMC_DISPATCHK { switch (nj) { case 1: NMC_CALLK(1); break; default: NMC_CALLK(2); break; } }
#else
#define NMC_DISPATCHK { NMC_CALLK(1); }
#endif

/* one call of cgg_rows with a compile-time row count nj and prefetch flag PF */
#define NMC_CALL1(NJ_, PF_) NMC_CAT(cgg_rows, SUF, NV)(pan, cp, vj, ls, t0, t1, out, NJ_, PF_, 0)
#define NMC_CALL2(NJ_, PF_) NMC_CAT(cgg_rows, SUF, NV)(pan, cp, vj, ls, t0, t1, out, NJ_, PF_, 1)
#define NMC_CALL(NJ_, PF_) do { if (i16) NMC_CALL2(NJ_, PF_); else NMC_CALL1(NJ_, PF_); } while (0)
#if NMC_NJ >= 4
#define NMC_DISPATCH(PF_) { switch (nj) { case 1: NMC_CALL(1, PF_); break; case 2: NMC_CALL(2, PF_); break; \
    case 3: NMC_CALL(3, PF_); break; default: NMC_CALL(4, PF_); break; } }
#elif NMC_NJ >= 3
#define NMC_DISPATCH(PF_) { switch (nj) { case 1: NMC_CALL(1, PF_); break; case 2: NMC_CALL(2, PF_); break; \
    default: NMC_CALL(3, PF_); break; } }
#elif NMC_NJ >= 2
#define NMC_DISPATCH(PF_) { switch (nj) { case 1: NMC_CALL(1, PF_); break; default: NMC_CALL(2, PF_); break; } }
#else
#define NMC_DISPATCH(PF_) { NMC_CALL(1, PF_); }
#endif

/* A tiled pass over full packed tiles (w slots, a multiple of NMC_KT) of row blocks [q0, q1):
 * records (q, p) in order, NJ = n rows each (a compile-time constant). BF: bf16 values in
 * the records (n = 1 only, nm_cg_tile_vb), widened as each is broadcast: bf16 values /
 * float32 values, fp32 x, tiled, 2 threads: 1:10 0.97-0.99x, against 0.94-0.96x widened per
 * record into a buffer first. */
static inline __attribute__((always_inline)) void NMC_CAT(cgg_pass_kt, SUF, NV)(
    const nm_colgrouped *W, const float *pan, const char *tblk, int64_t rec, int64_t q0, int64_t q1,
    int64_t w, float *ytmp, int first, const int NJ, const int BF)
{
    const int P = W->P, m = W->m;
    const int64_t vo = nm_cg_tile_values(NJ, w, BF ? 2 : 4);
    const char *r = tblk + q0 * P * rec;
    for (int64_t q = q0; q < q1; q++) {
        float *yt = ytmp + (q - q0) * m * BCHN;
        if (first)
            for (int64_t i = 0; i < m * BCHN; i++) yt[i] = 0.0f;
        const int32_t *rows = W->pats;
        for (int p = 0; p < P; p++, r += rec, rows += NJ) {
            float *out[4] = {yt, yt, yt, yt};
            for (int j = 0; j < NJ; j++) out[j] = yt + (int64_t)rows[j] * BCHN;
            const int16_t *cols = (const int16_t *)(const void *)(r + vo);
            NMC_CAT(cgg_rows_kt, SUF, NV)(pan, cols, r, w, out, NJ, BF);
        }
    }
}

/* Slots [t0, t1) of every pattern (a range of whole chunks: its x columns, a block of the
 * panel, stay in L1 while the row blocks [q0, q1) sweep it); first: start ytmp at zero. */
/* wbuf: n * L floats of scratch (the widened values of one pattern when vtype is NM_BF16;
 * widening once per pattern and batch chunk costs ~1/BCHN of the FMAs). */
static void NMC_CAT(cgg, SUF, NV)(const nm_colgrouped *W, const float *panel, int64_t q0, int64_t q1,
                                   int64_t t0, int64_t t1, float *ytmp, int flags, float *wbuf)
{
    const int first = flags & NM_CG_FIRST, pf = !(flags & NM_CG_IN_L1), i16 = !!(flags & NM_CG_TILES);
    const int n = W->n, m = W->m, P = W->P;
    const int64_t L = W->L;
    const int vb = nm_cg_tile_vb(W);   /* bytes per value in the tile records */
    /* tile-major packed form: this pass's block of records and its base column */
    const char *tblk = NULL;
    const float *pan = panel;
    int64_t rec = 0;
    /* a full packed tile of NMC_KT slots read from L1: the unrolled slot loop */
    const int kfix = i16 && !pf && (t1 - t0) % NMC_KT == 0 && nmc_kfix_enabled();
    if (i16) {
        const int64_t kt = W->tile_kt, tau = t0 / kt, nt = (L + kt - 1) / kt;
        tblk = (const char *)W->tiles + nm_cg_tiles_header(nt) + tau * W->Nb * P * nm_cg_tile_record(n, kt, vb);
        rec = nm_cg_tile_record(n, t1 - t0, vb);
        pan = panel + (int64_t)((const int32_t *)W->tiles)[tau] * BCHN;
    }
    /* full tiles, one call per record with the row count a compile-time constant: records
     * (q, p) are contiguous, so no per-pattern set-up beyond the output rows (768x3072, 1
     * thread, AVX-512, passes only: 1:10 4.47 -> 3.71 ms, 2:8 8.0 -> 7.6, 1:4 8.2 -> 7.3) */
    if (kfix && n <= NMC_NJ) {
#define NMC_PASS_(NJ_, BF_) NMC_CAT(cgg_pass_kt, SUF, NV)(W, pan, tblk, rec, q0, q1, t1 - t0, ytmp, first, NJ_, BF_)
#define NMC_PASS(NJ_) NMC_PASS_(NJ_, 0)
        switch (n) {
        case 1: if (vb == 2) NMC_PASS_(1, 1); else NMC_PASS(1); break;
#if NMC_NJ >= 2
        case 2: NMC_PASS(2); break;
#endif
#if NMC_NJ >= 3
        case 3: NMC_PASS(3); break;
#endif
#if NMC_NJ >= 4
        default: NMC_PASS(4); break;
#endif
        }
#undef NMC_PASS
#undef NMC_PASS_
        return;
    }
    /* partial tiles, more rows per pattern than a register block holds, the stream order or
     * the stored tables: per (row block, pattern) */
    for (int64_t q = q0; q < q1; q++) {
        float *yt = ytmp + (q - q0) * m * BCHN;
        if (first)
            for (int64_t i = 0; i < m * BCHN; i++) yt[i] = 0.0f;
        for (int p = 0; p < P; p++) {
            const void *cp;
            const float *v;
            int64_t ls;   /* stride between a pattern's value rows */
            if (i16) {
                /* record: [n][w] values then [w] int16, indexed from t0 like the table; bf16
                 * values widened into wbuf (n * w floats, in L1) */
                const char *r = tblk + (q * P + p) * rec;
                const int64_t w = t1 - t0;
                if (vb == 2) {
                    nm_widen_bf16((const uint16_t *)(const void *)r, wbuf, n * w);
                    v = wbuf - t0;
                } else {
                    v = (const float *)r - t0;
                }
                ls = w;
                cp = (const int16_t *)(r + nm_cg_tile_values(n, w, vb)) - t0;
            } else {
                cp = W->cols + (q * P + p) * L;
                ls = L;
                const int64_t vo = (q * P + p) * (int64_t)n * L;
                if (W->vtype == NM_BF16) {
                    const uint16_t *h = (const uint16_t *)W->vals + vo;
                    for (int j = 0; j < n; j++)
                        nm_widen_bf16(h + (int64_t)j * L + t0, wbuf + (int64_t)j * L + t0, t1 - t0);
                    v = wbuf;
                } else {
                    v = (const float *)W->vals + vo;
                }
            }
            const int32_t *rows = W->pats + p * n;
            for (int j0 = 0; j0 < n; j0 += NMC_NJ) {
                const int nj = n - j0 < NMC_NJ ? n - j0 : NMC_NJ;
                float *out[4] = {yt, yt, yt, yt};
                for (int j = 0; j < nj; j++) out[j] = yt + (int64_t)rows[j0 + j] * BCHN;
                /* pf a constant in each call: no per-slot branch */
                if (kfix) {
                    const int16_t *c16 = (const int16_t *)cp + t0;
                    const float *vj = v + (int64_t)j0 * ls + t0;
                    NMC_DISPATCHK
                } else {
                    const float *vj = v + (int64_t)j0 * ls;
                    if (pf) NMC_DISPATCH(1) else NMC_DISPATCH(0)
                }
            }
        }
    }
}

#undef NMC_DISPATCH
#undef NMC_DISPATCHK
#undef NMC_CALLK
#undef NMC_CALL
#undef NMC_CALL1
#undef NMC_CALL2
#undef NMC_NJ
#undef NMC_NJ_RAW
#undef NMC_CAT4
#undef NMC_CAT4_
#undef NMC_CAT
#undef NMC_CAT_
