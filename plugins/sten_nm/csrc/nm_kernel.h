/* sten_nm: n:m sparse x dense kernels in plain C (no torch headers).
 *
 * An n:m matrix A[R][C] keeps n of every m consecutive columns of each row.
 * Storage (row-major, G = ceil(C/m) groups per row, padding is internal):
 *   vals[R][G*n]   float32, kept values of each group in increasing column order
 *   idx[R][iw]     uint32 words, offsets (0..m-1) within the group, `bits` bits
 *                  each, `per` = floor(32/bits) offsets per word, low bits first;
 *                  iw = ceil(G*n/per)
 * Padded slots (columns >= C) hold value 0.
 */
#ifndef STEN_NM_KERNEL_H
#define STEN_NM_KERNEL_H
#include <stdint.h>

typedef struct {
    int64_t R, C;        /* logical shape */
    int32_t n, m;        /* n kept of every m along C */
    int32_t bits, per;   /* index packing */
    int64_t G, iw;       /* groups per row, index words per row */
    const float *vals;
    const uint32_t *idx;
} nm_mat;

/* Grouped n:m: the rows of W[N][K] are put in groups of NM_GR = 16 (a permutation,
 * chosen by the sparsifier) and all rows of a group share one n:m pattern.
 *   vals[Q][G*n][16]  kept values: slot j of the 16 rows of group q (contiguous)
 *   idx[Q][iw]        packed offsets of each group's pattern (as for nm_mat)
 *   perm[Q*16]        the original row of each stored row, -1 for padding rows */
#define NM_GR 16
typedef struct {
    int64_t N, K;        /* logical shape of W */
    int32_t n, m, bits, per;
    int64_t Q, iw;       /* row groups, index words per group */
    const float *vals;
    const uint32_t *idx;
    const int32_t *perm;
} nm_grouped;

/* Y[b][perm-row] = sum_k W[row][k] X[b][k] (+ bias); X [B][K] (ldx), Y [B][N] (ldy). */
int nm_grouped_gather_f32(const nm_grouped *W, int64_t B, const float *X, int64_t ldx,
                          float *Y, int64_t ldy, const float *bias, int nthreads);

/* Gradient of W's stored values for Y = X W^T: out[q][e][j] = sum_b dY[b][perm[q*16+j]]
 * X[b][column of slot e of group q] (0 for padding rows); out is [Q][G*n][16]. */
int nm_grouped_sddmm_f32(const nm_grouped *W, int64_t B, const float *dY, int64_t ldg,
                         const float *X, int64_t ldx, float *out, int nthreads);

/* Input gradient for Y = X W^T: dX[b][c] = sum_r dY[b][r] W[r][c]; dX is [B][K] (ldx). */
int nm_grouped_tgather_f32(const nm_grouped *W, int64_t B, const float *dY, int64_t ldg,
                           float *dX, int64_t ldx, int nthreads);

/* Column-grouped n:m (the STen paper's format): in each block of m rows of W[N][K], each
 * column keeps the n rows of one of the P = C(m, n) patterns; pattern p of row block q owns
 * L columns (the Python side checks that every column of a chunk has one owner).
 *   vals[Nb][P][n][L]  kept values (vtype NM_F32: float; NM_BF16: bfloat16 bits, uint16_t,
 *                      widened to float per row block in the kernel, fp32 accumulation);
 *   cols[Nb][P][L]     their columns (< P*L; >= K: padding, value 0)
 *   pats[P][n]         row offsets of each pattern in its block */
#define NM_F32 0
#define NM_BF16 1
typedef struct {
    int64_t N, K;
    int32_t n, m, P, vtype;
    int64_t Nb, L;
    const void *vals;
    const int32_t *cols;
    const int32_t *pats;
    /* optional (NULL: unused): the forward's tile-major copy of vals + cols for tiles of
     * tile_kt slots (nm_colgrouped_pack_tiles); used only by a forward pass whose slot tile
     * equals tile_kt, ignored by every other kernel */
    const void *tiles;
    int64_t tile_kt;
} nm_colgrouped;

/* Tile-major copy of a column-grouped matrix for the forward (internal packed form): per tile
 * of kt slots (the last may be narrower) and per (row block, pattern) one record of the tile's
 * values [n][w] (as stored: float32, or bf16 widened by the pass) then its columns [w] as
 * int16 relative to the tile's first column (each part padded to 4 bytes), records contiguous
 * in (row block, pattern) order, after a header of one int32 base column per tile; a tiled
 * pass then streams one contiguous block. nm_colgrouped_tiles_bytes: the size for kt, or -1
 * where not applicable (kt < 1, or a tile spans 32768 columns or more: pack_tiles says so).
 * nm_colgrouped_pack_tiles: writes it (0, or < 0). */
int64_t nm_colgrouped_tiles_bytes(const nm_colgrouped *W, int64_t kt);
int nm_colgrouped_pack_tiles(const nm_colgrouped *W, int64_t kt, void *out, int64_t bytes);
/* The slots per pass the forward uses for a batch of B rows in this variant (what
 * nm_colgrouped_pack_tiles should be given), or -1 for invalid arguments. */
int64_t nm_colgrouped_tile_kt(const nm_colgrouped *W, int64_t B, int nthreads, int variant);

/* Y[b][r] = sum_k W[r][k] X[b][k] (+ bias[r]); X [B][K] (ldx), Y [B][N] (ldy). */
int nm_colgrouped_gather_f32(const nm_colgrouped *W, int64_t B, const float *X, int64_t ldx,
                             float *Y, int64_t ldy, const float *bias, int nthreads);
/* The same product in a chosen loop order (see nm_kernel.c, cg_variant): NM_CG_STREAM (all
 * slots per pass, x from L2), NM_CG_TILED (x tile in L1, accumulators in L2), NM_CG_AUTO
 * (STEN_NM_CG_VARIANT, else NM_CG_STREAM; the Python side tunes the choice per shape). */
#define NM_CG_AUTO 0
#define NM_CG_STREAM 1
#define NM_CG_TILED 2
int nm_colgrouped_gather_variant_f32(const nm_colgrouped *W, int64_t B, const float *X, int64_t ldx,
                                     float *Y, int64_t ldy, const float *bias, int nthreads,
                                     int variant);

/* D = the dense [N][K] matrix (ldd >= K) of float32 W; vtype NM_BF16 is refused (-1). */
int nm_colgrouped_decompress_f32(const nm_colgrouped *W, float *D, int64_t ldd, int nthreads);
/* vals[q][p][j][t] = D[q*m + pats[p][j]][cols[q][p][t]] (0 at padding): the stored positions'
 * entries of a dense [N][K] matrix (ldd >= K), W's values unread; vals is float32 [Nb][P][n][L]. */
int nm_colgrouped_values_at_f32(const nm_colgrouped *W, const float *D, int64_t ldd, float *vals, int nthreads);

/* Input gradient for Y = X W^T: dX[b][k] = sum_r dY[b][r] W[r][k]; dY [B][N] (ldg), dX [B][K] (ldx). */
int nm_colgrouped_grad_input_f32(const nm_colgrouped *W, int64_t B, const float *dY, int64_t ldg,
                                 float *dX, int64_t ldx, int nthreads);
/* Gradient of the stored values for Y = X W^T, at the kept positions only:
 * out[q][p][j][t] = sum_b dY[b][q*m + pats[p][j]] X[b][cols[q][p][t]] (0 at padding); out is
 * float32 [Nb][P][n][L] whatever vtype. */
int nm_colgrouped_grad_values_f32(const nm_colgrouped *W, int64_t B, const float *dY, int64_t ldg,
                                  const float *X, int64_t ldx, float *out, int nthreads);

/* Y[b][r] = sum_c A[r][c] X[b][c] (+ bias[r]); X is [B][C] (row stride ldx), Y [B][R] (ldy). */
int nm_gather_f32(const nm_mat *A, int64_t B, const float *X, int64_t ldx,
                  float *Y, int64_t ldy, const float *bias, int nthreads);
/* nm_gather_f32 for a matrix whose vals point to bfloat16 bits (uint16_t [R][G*n]): widened
 * per block of rows in the kernel, float32 accumulation. */
int nm_gather_bf16w(const nm_mat *A, int64_t B, const float *X, int64_t ldx,
                    float *Y, int64_t ldy, const float *bias, int nthreads);
/* nm_gather_f32 / nm_gather_bf16w with X bfloat16 bits (uint16_t [B][C], row stride ldx,
 * any 2-byte offset): widened while packing the kernel's panel (exact), no float32 copy of X. */
int nm_gather_bf16x(const nm_mat *A, int64_t B, const uint16_t *X, int64_t ldx,
                    float *Y, int64_t ldy, const float *bias, int nthreads);
int nm_gather_bf16wx(const nm_mat *A, int64_t B, const uint16_t *X, int64_t ldx,
                     float *Y, int64_t ldy, const float *bias, int nthreads);
/* nm_grouped_gather_f32 for vals pointing to bfloat16 bits ([Q][G*n][16] uint16_t): each
 * row group's chunk of slots widened in the kernel, float32 accumulation. */
int nm_grouped_gather_bf16w(const nm_grouped *W, int64_t B, const float *X, int64_t ldx,
                            float *Y, int64_t ldy, const float *bias, int nthreads);
/* nm_gather_bf16x (w16 = 0) / nm_gather_bf16wx (w16 = 1) with a bfloat16 result Y (uint16_t
 * [B][R], row stride ldy): each unit of rows rounded (nearest even) on the kernels' threads
 * while in cache; the same bits as the float32 result rounded by nm_f32_to_bf16. */
int nm_gather_bf16x_out16(const nm_mat *A, int64_t B, const uint16_t *X, int64_t ldx, uint16_t *Y, int64_t ldy,
                          const float *bias, int nthreads, int w16);
/* nm_grouped_gather_f32 / nm_grouped_gather_bf16w with X bfloat16 bits (uint16_t [B][K], row
 * stride ldx, any 2-byte offset): widened while packing the 6-row micro-panels (exact), no
 * float32 copy of X. */
int nm_grouped_gather_bf16x(const nm_grouped *W, int64_t B, const uint16_t *X, int64_t ldx,
                            float *Y, int64_t ldy, const float *bias, int nthreads);
int nm_grouped_gather_bf16wx(const nm_grouped *W, int64_t B, const uint16_t *X, int64_t ldx,
                             float *Y, int64_t ldy, const float *bias, int nthreads);
/* the same with a bfloat16 result (uint16_t [B][N], ldy; w16: bf16 values), rows rounded as
 * the driver writes them; the same bits as rounding the float32 result. */
int nm_grouped_gather_bf16x_out16(const nm_grouped *W, int64_t B, const uint16_t *X, int64_t ldx, uint16_t *Y,
                                  int64_t ldy, const float *bias, int nthreads, int w16);
/* nm_colgrouped_gather_f32 with X in bfloat16 bits (uint16_t [B][K], row stride ldx), read by
 * the kernel: on AVX512_BF16 CPUs (ISA avx512) with bf16 values, vdpbf16ps on adjacent-slot
 * pairs; otherwise x widened while packing and the float32 kernel (csrc/nm_cg_bf16x.h). */
int nm_colgrouped_gather_bf16x(const nm_colgrouped *W, int64_t B, const uint16_t *X, int64_t ldx,
                               float *Y, int64_t ldy, const float *bias, int nthreads);
/* nm_colgrouped_gather_bf16x in a loop order (nm_colgrouped_gather_variant_f32's variant): with
 * bf16 values where vdpbf16ps runs, NM_CG_STREAM (or AUTO resolving to it) on it, NM_CG_TILED
 * with x widened. _out16: a bfloat16 result (uint16_t [B][N], ldy), each unit rounded as it
 * is written; the same bits as rounding the float32 result. */
int nm_colgrouped_gather_bf16x_variant(const nm_colgrouped *W, int64_t B, const uint16_t *X, int64_t ldx,
                                       float *Y, int64_t ldy, const float *bias, int nthreads, int variant);
int nm_colgrouped_gather_bf16x_out16(const nm_colgrouped *W, int64_t B, const uint16_t *X, int64_t ldx,
                                     uint16_t *Y, int64_t ldy, const float *bias, int nthreads, int variant);
/* Whether bf16 x with bf16 values runs on vdpbf16ps now (CPU has it, ISA avx512, not off). */
int nm_bf16_dot(void);
/* nm_tgather_f32 / nm_grouped_tgather_f32 (input gradients) for values in bfloat16 bits:
 * widened on the kernels' threads into a buffer for this call only (csrc/nm_bf16_bwd.h). */
int nm_tgather_bf16w(const nm_mat *A, int64_t B, const float *Y, int64_t ldy, float *X, int64_t ldx,
                     const float *bias, int nthreads);
int nm_grouped_tgather_bf16w(const nm_grouped *W, int64_t B, const float *dY, int64_t ldg,
                             float *dX, int64_t ldx, int nthreads);
/* The backward products with dY (Y) and, for the values gradients, X each float32 or bfloat16
 * bits (y16 / x16 = 1: uint16_t rows, any 2-byte offset), widened while packing (exact), float32
 * results; w16 = 1: the descriptor's values are bfloat16 (csrc/nm_bf16_bwd.h). Same arguments
 * as the _f32 functions otherwise. */
int nm_tgather_mixed(const nm_mat *A, int64_t B, const void *Y, int64_t ldy, float *X, int64_t ldx,
                     const float *bias, int nthreads, int w16, int y16);
int nm_sddmm_mixed(const nm_mat *A, int64_t B, const void *Y, int64_t ldy, const void *X, int64_t ldx,
                   float *out, int nthreads, int y16, int x16);
int nm_grouped_tgather_mixed(const nm_grouped *W, int64_t B, const void *dY, int64_t ldg, float *dX,
                             int64_t ldx, int nthreads, int w16, int y16);
int nm_grouped_sddmm_mixed(const nm_grouped *W, int64_t B, const void *dY, int64_t ldg, const void *X,
                           int64_t ldx, float *out, int nthreads, int y16, int x16);
int nm_colgrouped_grad_input_mixed(const nm_colgrouped *W, int64_t B, const void *dY, int64_t ldg, float *dX,
                                   int64_t ldx, int nthreads, int y16);
int nm_colgrouped_grad_values_mixed(const nm_colgrouped *W, int64_t B, const void *dY, int64_t ldg,
                                    const void *X, int64_t ldx, float *out, int nthreads, int y16, int x16);
/* Whether the CPU has AVX512_BF16 (and AVX-512BW); whether the vdpbf16ps switch is on. */
int nm_bf16_dot_supported(void);
int nm_bf16_dot_enabled(void);
/* Turn the vdpbf16ps path on (1; -1 if the CPU lacks AVX512_BF16) or off (0). */
int nm_set_bf16_dot(int on);
/* y[i] = x[i] rounded to bfloat16 (nearest even, as torch; NaN -> 0x7fc0), i < n. */
int nm_f32_to_bf16(const float *x, uint16_t *y, int64_t n, int nthreads);
/* X[b][c] = sum_r A[r][c] Y[b][r] (+ bias[c]); Y is [B][R] (ldy), X [B][C] (ldx). */
int nm_scatter_f32(const nm_mat *A, int64_t B, const float *Y, int64_t ldy,
                   float *X, int64_t ldx, const float *bias, int nthreads);
/* Same result as nm_scatter_f32, through a transposed (CSR) copy of A built per call
 * (2 x the stored bytes, transient); faster where stores are the bottleneck. */
int nm_tgather_f32(const nm_mat *A, int64_t B, const float *Y, int64_t ldy,
                   float *X, int64_t ldx, const float *bias, int nthreads);
/* out[r][j] = sum_b Y[b][r] X[b][c_j] at the stored positions; out is [R][G*n]. */
int nm_sddmm_f32(const nm_mat *A, int64_t B, const float *Y, int64_t ldy,
                 const float *X, int64_t ldx, float *out, int nthreads);
/* Keep the n largest magnitudes of every m (ties: lower column first); fills vals/idx. */
int nm_compress_f32(int64_t R, int64_t C, int32_t n, int32_t m, const float *D, int64_t ldd,
                    float *vals, uint32_t *idx, int nthreads);
/* Same, but keep the positions where mask (uint8, [R][C]) is nonzero (at most n per group). */
int nm_compress_mask_f32(int64_t R, int64_t C, int32_t n, int32_t m, const float *D, int64_t ldd,
                         const uint8_t *mask, float *vals, uint32_t *idx, int nthreads);
/* D[r][c] = A[r][c] (zeros elsewhere); D is [R][C] (ldd). */
int nm_decompress_f32(const nm_mat *A, float *D, int64_t ldd, int nthreads);
/* vals[r][e] = D[r][column of slot e] (0 in the padding): the stored positions' entries of a
 * dense [R][C] matrix (ldd), A's values unread; vals is [R][G*n]. */
int nm_values_at_f32(const nm_mat *A, const float *D, int64_t ldd, float *vals, int nthreads);
/* Name of the instruction set picked at run time: "avx512", "avx2" or "generic". */
const char *nm_isa(void);
/* Force an ISA ("avx512", "avx2", "generic"); returns 0 on success, -1 if unsupported. */
int nm_set_isa(const char *name);

/* Threading: "openmp" (the process's OpenMP pool) or "pthreads" (threads per call). */
const char *nm_threading(void);
/* Pick "openmp" (only in an OpenMP build) or "pthreads"; 0 on success, -1 otherwise. */
int nm_set_threading(const char *name);
/* File of the OpenMP runtime the kernels call ("" if unknown), NULL without OpenMP. */
const char *nm_openmp_library(void);

int nm_index_bits(int32_t m);
int nm_index_per_word(int32_t m);
#endif
