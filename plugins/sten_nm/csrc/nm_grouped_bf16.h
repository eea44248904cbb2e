/* Grouped n:m forward with bf16 stored values, widened in the load path (included once per
 * ISA by nm_impl.h; needs VW, SUF, vf).
 *
 * ggather's kernel (nm_ggather_body.h: the same 6 x 16 register block and arguments), but
 * W->vals points to bfloat16 bits ([Q][G*n][16] uint16_t): each slot's 16 values are one
 * half-width load, zero-extended and shifted into float32 (exact) in registers, so there is
 * no scratch buffer and half the weight bytes move. Unaligned loads (any data_ptr()). */
#define NMGB_CAT_(a, b) a##_##b
#define NMGB_CAT(a, b) NMGB_CAT_(a, b)
#define NVR (NM_GR / VW)

typedef uint16_t NMGB_CAT(vh, SUF) __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint32_t NMGB_CAT(vu, SUF) __attribute__((vector_size(VW * 4)));

/* A vector of VW bf16 values at p (any alignment) widened to float32: zero-extended and shifted
 * into the high half (exact) */
static inline vf NMGB_CAT(widen, SUF)(const uint16_t *p)
{
    NMGB_CAT(vh, SUF) h;
    __builtin_memcpy(&h, p, sizeof h);
    const NMGB_CAT(vu, SUF) b = __builtin_convertvector(h, NMGB_CAT(vu, SUF)) << 16;
    vf w;
    __builtin_memcpy(&w, &b, sizeof b);
    return w;
}

#define GG_FN NMGB_CAT(ggather16, SUF)
#define GG_VT uint16_t
#define GG_LOAD(p) NMGB_CAT(widen, SUF)(p)
#include "nm_ggather_body.h"

#undef NVR
#undef NMGB_CAT
#undef NMGB_CAT_
