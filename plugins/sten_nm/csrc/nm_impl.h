/* One ISA's kernel table. Included by nm_avx2.c / nm_avx512.c / nm_generic.c after
 * defining VW (floats per vector), SUF (suffix) and TABLE (table name). */
#include "nm_isa.h"

typedef float vf __attribute__((vector_size(VW * 4)));
/* Same vector, 4-byte alignment: loads and stores on caller memory (a tensor's data_ptr()
 * may sit at any float offset, e.g. a view), so never an aligned-move fault there. */
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));

#define NV 1
#include "nm_body.h"
#undef NV
#define NV 2
#include "nm_body.h"
#undef NV
#define NV 4
#include "nm_body.h"
#undef NV
#define NV 8
#include "nm_body.h"
#undef NV

#include "nm_grouped.h"
#include "nm_grouped_bf16.h"

#define NMT_CAT3_(a, b, c) a##_##b##_##c
#define NMT_CAT3(a, b, c) NMT_CAT3_(a, b, c)
#define NMT_ALL(name) { NMT_CAT3(name, SUF, 1), NMT_CAT3(name, SUF, 2), NMT_CAT3(name, SUF, 4), NMT_CAT3(name, SUF, 8) }
#define NMT_STR_(x) #x
#define NMT_STR(x) NMT_STR_(x)

#define NMT_CAT2_(a, b) a##_##b
#define NMT_CAT2(a, b) NMT_CAT2_(a, b)
const nm_isa_table TABLE = {NMT_STR(SUF), VW, NMT_ALL(gather), NMT_ALL(scatter), NMT_ALL(sddmm),
                            NMT_ALL(cgather), NMT_CAT2(ggather, SUF), NMT_CAT2(unperm, SUF),
                            NMT_CAT2(gsddmm, SUF), NMT_ALL(cgg), NMT_CAT2(gtgather, SUF),
                            NMT_CAT2(ggather16, SUF)};
