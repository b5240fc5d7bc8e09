/* caffepar's compiled kernels: every *.inc file is compiled once per element type, T = float
 * (names ending _f32) and T = double (_f64). Built by caffepar/nn/native/__init__.py, the two
 * types side by side (-DONLY_F32, -DONLY_F64) and linked into one library. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

#define FN_(name, suffix) name##_##suffix
#define FN2(name, suffix) FN_(name, suffix)
#define FN(name) FN2(name, SUFFIX)

/* Explicit vectors of 64 bytes (VL elements; two instructions each on AVX2 hosts, one with
 * AVX-512) where the compiler's own vectoriser falls short; TI is the integer of T's width, the
 * type of a comparison's lanes. */
#define VL_OF(type) (64 / (i64)sizeof(type))
#define VEC_TYPES                                                 \
    enum { VL = 64 / sizeof(T) };                                 \
    typedef T vec __attribute__((vector_size(64)));               \
    typedef TI ivec __attribute__((vector_size(64)));

/* The other kernels repeat the NumPy code's roundings exactly (the build passes
 * -ffp-contract=off); the convolution kernels sum in their own order anyway, so they may fuse
 * multiply-adds. */
#ifndef ONLY_F64
#define T float
#define TI int32_t
#define SQRT sqrtf
#define POW powf
#define SUFFIX f32
#include "pool.inc"
#include "update.inc"
#include "lrn.inc"
#include "winograd.inc"
#include "neuron.inc"
#include "im2col.inc"
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#include "conv.inc"
#include "inner_product.inc"
#pragma GCC pop_options
#undef T
#undef TI
#undef SQRT
#undef POW
#undef SUFFIX
#endif

#ifndef ONLY_F32
#define T double
#define TI int64_t
#define SQRT sqrt
#define POW pow
#define SUFFIX f64
#include "pool.inc"
#include "update.inc"
#include "lrn.inc"
#include "winograd.inc"
#include "neuron.inc"
#include "im2col.inc"
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#include "conv.inc"
#include "inner_product.inc"
#pragma GCC pop_options
#undef T
#undef TI
#undef SQRT
#undef POW
#undef SUFFIX
#endif
