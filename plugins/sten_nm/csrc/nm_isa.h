/* Internal: per-ISA kernel table (one per instruction set, picked at run time). */
#ifndef STEN_NM_ISA_H
#define STEN_NM_ISA_H
#include "nm_kernel.h"

/* rows per block in the gather / sddmm kernels (their accumulators stay in L1) */
#define NM_ROWS 32
/* grouped kernel: rows per group (shared pattern) and batch rows per micro-panel */
#define NM_MB 6

/* Panels: a [B][C] operand is packed per batch chunk of `bch` rows as
 * [nbc][Cpad][bch] (transposed, zero padded, 64-byte aligned). */
typedef void (*nm_gather_fn)(const nm_mat *A, const float *xp, int64_t Cpad, int64_t nbc, int64_t B,
                             float *Y, int64_t ldy, const float *bias, int64_t r0, int64_t r1,
                             float *ytmp, int32_t *offs, int64_t kbg);
typedef void (*nm_scatter_fn)(const nm_mat *A, const float *yp, int64_t nbc, int64_t B, float *X,
                              int64_t ldx, const float *bias, int64_t ga, int64_t gb, float *acc,
                              int32_t *offs, int64_t kbg);
typedef void (*nm_sddmm_fn)(const nm_mat *A, const float *xp, int64_t Cpad, const float *yp,
                            int64_t nbc, float *out, int64_t r0, int64_t r1, int32_t *offs,
                            int64_t kbg, float *vacc);

/* Decode the offsets of rows [r0, r1), groups [g0, g1) into
 * out[(r - r0) * (g1 - g0) * n + j] = (column - g0 * m) * scale. */
static inline void nm_decode(const nm_mat *A, int64_t r0, int64_t r1, int64_t g0, int64_t g1,
                             int64_t scale, int32_t *out)
{
    const int n = A->n, m = A->m, bits = A->bits, per = A->per;
    const uint32_t mask = (1u << bits) - 1u;
    const int64_t e0 = g0 * n, ne = (g1 - g0) * n;
    for (int64_t r = r0; r < r1; r++) {
        const uint32_t *wp = A->idx + r * A->iw + e0 / per;
        uint32_t cur = *wp >> (bits * (int)(e0 % per));
        int left = per - (int)(e0 % per);
        int32_t *o = out + (r - r0) * ne;
        int64_t base = 0;
        for (int64_t e = 0; e < ne; base += m) {
            for (int t = 0; t < n; t++, e++) {
                if (left == 0) { cur = *++wp; left = per; }
                o[e] = (int32_t)((base + (int64_t)(cur & mask)) * scale);
                cur >>= bits; left--;
            }
        }
    }
}

typedef void (*nm_cgather_fn)(const int64_t *rowptr, const int32_t *toff, const float *tv,
                              int64_t c0, int64_t c1, const float *yp, int64_t R, int64_t nbc,
                              int64_t B, float *X, int64_t ldx, const float *bias, float *ytmp,
                              int64_t *cur, int64_t kbr);
typedef void (*nm_ggather_fn)(const nm_grouped *W, const int32_t *offs, const float *xp,
                              int64_t pstride, int64_t cbase, int64_t np, int64_t e0, int64_t e1,
                              int64_t q0, int64_t q1, float *T, int64_t ldt, int first);

typedef void (*nm_gsddmm_fn)(const float *gq, const float *xt, int64_t ldb, const int32_t *cols,
                             int64_t ne, int64_t kb, float *out, int first);

typedef void (*nm_unperm_fn)(const float *t, const int32_t *inv, const float *bias, int64_t N,
                             float *y);

typedef void (*nm_gtgather_fn)(const float *wv, const int32_t *cols, int64_t gn, const float *gyt,
                               float *gxt, int64_t ld, int64_t nb);

/* flags of nm_cgg_fn: start the accumulators at zero; the x columns of the slots sit in L1
 * (a small slot range reused by many row blocks: no software prefetch) */
#define NM_CG_FIRST 1
#define NM_CG_IN_L1 2
/* W->tiles holds this pass's tile (t0 a multiple of W->tile_kt): int16 columns relative to
 * the tile's base, values and columns streamed contiguously */
#define NM_CG_TILES 4
/* slots per block of the unrolled pass kernel (nm_colgrouped.h); tiled passes are multiples */
#define NM_CG_KT_BLOCK 16

/* w[i] = float(h[i]) for i < n: bf16 bits widened (shifted into the high half: exact) */
static inline void nm_widen_bf16(const uint16_t *restrict h, float *restrict w, int64_t n)
{
    uint32_t *restrict u = (uint32_t *)(void *)w;
    for (int64_t i = 0; i < n; i++) u[i] = (uint32_t)h[i] << 16;
}

/* tile-major packed form: header bytes (one int32 per tile, 64-byte multiple) and record
 * bytes for w slots (n*w values of vb bytes, 4 for float32 and 2 for bf16, then w int16; each
 * part padded to 4 bytes) */
static inline int64_t nm_cg_tiles_header(int64_t ntiles) { return (ntiles * 4 + 63) / 64 * 64; }
static inline int64_t nm_cg_tile_values(int n, int64_t w, int vb) { return ((int64_t)n * w * vb + 3) / 4 * 4; }
static inline int64_t nm_cg_tile_record(int n, int64_t w, int vb)
{
    return nm_cg_tile_values(n, w, vb) + (2 * w + 3) / 4 * 4;
}
/* bytes per value in the tile records: bf16 stored values stay bf16 at n = 1 (the pass
 * widens each as it is broadcast) and are widened when packed at n >= 2, where the pass
 * would otherwise widen each record into a buffer first: reading the values from any other
 * place than the record ran the 2:4 passes 10 % slower than float32 values (768x3072, 1
 * thread, AVX-512: 10.8-10.9 vs 9.8 ms, whether the buffer was widened per record, per row
 * block or not at all) */
static inline int nm_cg_tile_vb(const nm_colgrouped *W) { return W->vtype == NM_BF16 && W->n == 1 ? 2 : 4; }
typedef void (*nm_cgg_fn)(const nm_colgrouped *W, const float *panel, int64_t q0, int64_t q1,
                          int64_t t0, int64_t t1, float *ytmp, int flags, float *wbuf);

typedef struct {
    const char *name;
    int vw;                     /* floats per vector */
    nm_gather_fn gather[4];     /* NV = 1, 2, 4, 8 vectors per batch chunk */
    nm_scatter_fn scatter[4];
    nm_sddmm_fn sddmm[4];
    nm_cgather_fn cgather[4];   /* CSR gather (transposed products) */
    nm_ggather_fn ggather;      /* grouped n:m, 6 x 16 register block */
    nm_unperm_fn unperm;        /* grouped n:m: one output row back in the original order */
    nm_gsddmm_fn gsddmm;
    nm_cgg_fn cgg[4];           /* column-grouped n:m forward, NV = 1, 2, 4, 8 */
    nm_gtgather_fn gtgather;    /* grouped n:m input gradient, 6 slots x 8 rows x 1 vector */
    nm_ggather_fn ggather16;    /* grouped n:m forward, bf16 values widened in registers */
} nm_isa_table;

extern const nm_isa_table nm_table_generic;
#if defined(__GNUC__) && defined(__x86_64__)
#define STEN_NM_X86 1
extern const nm_isa_table nm_table_avx2;
extern const nm_isa_table nm_table_avx512;
#endif
#endif
