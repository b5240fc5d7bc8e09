/* caffepar's compiled kernels: every *.inc file is compiled once per element type, T = float
 * (names ending _f32) and T = double (_f64). Built by caffepar/nn/native/__init__.py, the two
 * types side by side (-DONLY_F32, -DONLY_F64) and linked into one library. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

typedef int64_t i64;

#define FN_(name, suffix) name##_##suffix
#define FN2(name, suffix) FN_(name, suffix)
#define FN(name) FN2(name, SUFFIX)

/* The vector width and register count the kernels are built for, from the target the compiler
 * is given (-march=native: the host's): AVX-512 has 32 registers of 64 bytes, AVX2/FMA 16 of 32
 * bytes, SSE 16 of 16. Register tiles are sized from these: GCC keeps a vector wider than the
 * target's registers, or more live vectors than it has, in memory (the stack) rather than in
 * registers. -DNATIVE_BYTES=32 builds 256-bit code for an AVX-512 host (32 registers still,
 * with AVX-512VL), for scripts/bench_vector_width.py to compare: on Zen 4, whose 512-bit
 * units are two 256-bit halves, its convolutions measured 7-32% slower than 64-byte vectors. */
#ifndef NATIVE_BYTES
#if defined(__AVX512F__)
#define NATIVE_BYTES 64
#elif defined(__AVX__)
#define NATIVE_BYTES 32
#else
#define NATIVE_BYTES 16
#endif
#endif
#if defined(__AVX512F__)
#define NATIVE_REGS 32
#else
#define NATIVE_REGS 16
#endif

/* Explicit vectors of NATIVE_BYTES (VL elements) where the compiler's own vectoriser falls
 * short; TI is the integer of T's width, the type of a comparison's lanes. */
#define VEC_TYPES                                                 \
    enum { VL = NATIVE_BYTES / sizeof(T) };                       \
    typedef T vec __attribute__((vector_size(NATIVE_BYTES)));     \
    typedef TI ivec __attribute__((vector_size(NATIVE_BYTES)));

#define MIN_(a, b) ((a) < (b) ? (a) : (b))
/* Before every loop over a register tile: unrolled in full, so that each element of the tile's
 * array becomes a register (GCC replaces an array by registers only where every index is a
 * constant). */
#define TILE_LOOP _Pragma("GCC unroll 32")
/* v loaded into a register once, where the compiler would otherwise read it from memory again
 * for every multiply-add that uses it (a load each, which the load ports cannot keep up with). */
#if defined(__x86_64__) || defined(__i386__)
#define IN_REG(v) __asm__("" : "+v"(v))
#else
#define IN_REG(v) ((void)0)
#endif
/* A vector of VL copies of s: s - 0 is s for every s (0 + s would turn -0 into +0, an add
 * the compiler must keep). */
#define BCAST(s) ((s) - (vec){})

/* The images a pass's threads share out one at a time: each call of a kernel given a claim
 * counter (zero before the pass) takes the next image no thread has taken yet, so the threads
 * end within one image of each other whatever their speed, with one call per thread; without
 * one, a call takes its images in turn. Images are independent, so who takes which does not
 * change a bit of the result. */
static inline i64 claim_first(i64 *claim)
{
    return claim ? __atomic_fetch_add(claim, 1, __ATOMIC_RELAXED) : 0;
}

static inline i64 claim_next(i64 *claim, i64 n)
{
    return claim ? __atomic_fetch_add(claim, 1, __ATOMIC_RELAXED) : n + 1;
}

/* Another layer's work on images first .. first + count of the batch, which a kernel looping
 * over images runs inside its loop, while those images are in cache: a MAX pooling's forward
 * right after a convolution wrote them, its backward right before the convolution's weight
 * gradient reads them (pool.inc's *_images). args holds the step's own arguments. Returns
 * >= 0 (what the step counts), or -1: no memory. */
typedef i64 (*image_step)(const i64 *args, i64 first, i64 count);

/* What the library was built with, for the Python side's layouts and reports. */
#ifndef ONLY_F64
i64 native_bytes(void) { return NATIVE_BYTES; }
i64 native_regs(void) { return NATIVE_REGS; }
#include "sync.inc"
#endif

/* The other kernels repeat the NumPy code's roundings exactly (the build passes
 * -ffp-contract=off); the convolution kernels sum in their own order anyway, so they may fuse
 * multiply-adds. */
#ifndef ONLY_F64
#define T float
#define TI int32_t
#define SQRT sqrtf
#define POW powf
#define SUFFIX f32
#include "lanes.inc"
#include "pool.inc"
#include "update.inc"
#include "lrn.inc"
#include "batch_norm.inc"
#include "winograd.inc"
#include "neuron.inc"
#include "im2col.inc"
#include "detection.inc"
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#include "conv.inc"
#include "conv_rows.inc"
#include "group.inc"
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
#include "lanes.inc"
#include "pool.inc"
#include "update.inc"
#include "lrn.inc"
#include "batch_norm.inc"
#include "winograd.inc"
#include "neuron.inc"
#include "im2col.inc"
#include "detection.inc"
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#include "conv.inc"
#include "conv_rows.inc"
#include "group.inc"
#include "inner_product.inc"
#pragma GCC pop_options
#undef T
#undef TI
#undef SQRT
#undef POW
#undef SUFFIX
#endif
