/* Packing a bfloat16 operand X[B][C] (uint16_t bits, row stride ldx, any 2-byte offset)
 * into a float32 panel, widened while packing (exact: bf16 bits shifted into the high half
 * of a float32), so no float32 copy of X is made. Used by the exact forward's panel
 * (make_panel_x) and the paper format's bf16-x pack (nm_cg_bf16x.h). Needs pack_panel. */
#ifndef STEN_NM_BF16_PACK_H
#define STEN_NM_BF16_PACK_H

/* columns per packing unit: the rows' widened segments ([bch][NM_BF16_PC] floats) stay in L1 */
#define NM_BF16_PC 64

/* dst[c - c0][bi] = float(X[b0 + bi][c]) for bi < bch, c in [c0, c1) (0 past B or C); tile
 * is scratch of bch * NM_BF16_PC floats. A whole chunk of a multiple of 8 rows on AVX2/AVX-512:
 * pack_panel_bf16_avx8 (widened in registers, one pass); the columns it leaves (and other
 * chunks), NM_BF16_PC at a time: two vectorisable passes in L1, widen the rows' segments into
 * tile [bch][NM_BF16_PC], then pack_panel's transposes of the tile into dst. */
static void pack_panel_bf16(const uint16_t *X, int64_t ldx, int64_t B, int64_t C, int64_t b0, int64_t bch,
                            int64_t c0, int64_t c1, float *tile, float *dst)
{
#ifdef STEN_NM_X86
    if (b0 + bch <= B && bch % 8 == 0 && table()->vw >= 8) {   /* whole chunk: widened in registers */
        const int64_t c = pack_panel_bf16_avx8(X, ldx, b0, bch, c0, c1 < C ? c1 : C, C, dst);
        dst += (c - c0) * bch;
        c0 = c;
    }
#endif
    const int64_t nb = B - b0 < bch ? (B - b0 > 0 ? B - b0 : 0) : bch;
    for (; c0 < c1; c0 += NM_BF16_PC, dst += NM_BF16_PC * bch) {
        const int64_t cu = c0 + NM_BF16_PC < c1 ? c0 + NM_BF16_PC : c1;
        const int64_t ce = cu < C ? cu : C, nc = ce > c0 ? ce - c0 : 0;
        for (int64_t bi = 0; bi < nb; bi++) nm_widen_bf16(X + (b0 + bi) * ldx + c0, tile + bi * NM_BF16_PC, nc);
        pack_panel(tile, NM_BF16_PC, nb, nc, 0, bch, 0, cu - c0, dst);
    }
}
#endif
