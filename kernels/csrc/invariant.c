/* Batch-invariant CPU kernels for deterministic mode (kernels/batch_invariant.py, docs/deterministic.md).
 *
 * Every value these kernels produce is fixed by the operands alone, by construction: each output is one chain of
 * IEEE float32 operations in a fixed order, and how the work is tiled, vectorized or split across threads only
 * decides which chains run together, never the order inside one. So a row's result does not depend on how many
 * other rows share a call, where it sits among them, the thread count, or which instruction set runs it (fma is
 * exactly rounded; the AVX-512, AVX2 and scalar builds perform the same operations on every lane):
 *
 * - GEMM: C[m, n] = fma chain over k = 0 .. K-1 in increasing order, starting from 0 (or from C when accumulating:
 *   a chain split over K and accumulated in order is the same chain). bf16 x bf16 chains take k in pairs (the
 *   order of AVX512_BF16's dot-product instruction, which the other builds reproduce with fma); on a CPU with AMX
 *   they take k 32 at a time, one tile dot-product instruction per chunk (amx_gemm): still one fixed computation
 *   per output from its own row and column, so every invariance above holds, but its rounding inside a chunk is
 *   the hardware's own, so an AMX build's bf16 GEMM bits are not the other builds'.
 * - attention: score(t, s) = (fma chain over d of q[t, d] k[s, d]) * scale (+ mask); m = max over the visible keys
 *   (exact in any order); p = ty_exp(score - m) (below); out = (fma chain over the visible keys s, increasing, of
 *   p(s) v[s]) / (sum over the same keys, increasing, of p(s)). A key outside a row's range is skipped, which is
 *   bitwise the same as a key with p = 0: a row decoded against keys 0 .. p and the same row in a masked prefill
 *   agree.
 * - exp / silu / sigmoid: one fixed sequence of fma, mul, add and integer operations per element (Cephes' expf
 *   polynomial, about 1 ulp), so an element's bits depend only on its value.
 *
 * Inputs are float32 or bfloat16 (widened exactly); outputs are float32. Threads: OpenMP, the process's (torch's)
 * runtime; the caller passes the thread count. Built by kernels/native.py with -ffp-contract=off (no fma the
 * source does not ask for).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TY_ISA "avx512"
typedef __m512 v16;
typedef __mmask16 vmask;
static inline v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, v16 a) { _mm512_storeu_ps(p, a); }
static inline v16 v_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
static inline v16 v_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
static inline v16 v_min(v16 a, v16 b) { return _mm512_min_ps(a, b); }
static inline v16 v_load_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
/* float whose bits are those of y (an integer-valued float near 2^23 + 2^22) shifted left by 23: 2^(n) for
 * y = n + 127 + 1.5 * 2^23 */
static inline v16 v_shl23(v16 y) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(y), 23)); }
static inline v16 v_select_lt(v16 x, float bound, v16 if_less, v16 otherwise) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, v_set1(bound), _CMP_LT_OQ), otherwise, if_less);
}
static inline v16 v_select_gt(v16 x, float bound, v16 if_greater, v16 otherwise) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, v_set1(bound), _CMP_GT_OQ), otherwise, if_greater);
}
#define TY_MR 12 /* GEMM micro-tile rows (the tiling never changes a result) */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TY_ISA "avx2"
typedef struct { __m256 lo, hi; } v16;
static inline v16 v_mk(__m256 lo, __m256 hi) { v16 r = {lo, hi}; return r; }
static inline v16 v_load(const float *p) { return v_mk(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void v_store(float *p, v16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline v16 v_set1(float x) { __m256 b = _mm256_set1_ps(x); return v_mk(b, b); }
static inline v16 v_zero(void) { return v_mk(_mm256_setzero_ps(), _mm256_setzero_ps()); }
#define TY_V2(name, op) static inline v16 name(v16 a, v16 b) { return v_mk(op(a.lo, b.lo), op(a.hi, b.hi)); }
TY_V2(v_add, _mm256_add_ps)
TY_V2(v_sub, _mm256_sub_ps)
TY_V2(v_mul, _mm256_mul_ps)
TY_V2(v_div, _mm256_div_ps)
TY_V2(v_max, _mm256_max_ps)
TY_V2(v_min, _mm256_min_ps)
static inline v16 v_fma(v16 a, v16 b, v16 c) {
    return v_mk(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline __m256 bf16x8(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline v16 v_load_bf16(const uint16_t *p) { return v_mk(bf16x8(p), bf16x8(p + 8)); }
static inline __m256 shl23(__m256 y) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(y), 23)); }
static inline v16 v_shl23(v16 y) { return v_mk(shl23(y.lo), shl23(y.hi)); }
static inline v16 v_select_lt(v16 x, float bound, v16 if_less, v16 otherwise) {
    __m256 b = _mm256_set1_ps(bound);
    return v_mk(_mm256_blendv_ps(otherwise.lo, if_less.lo, _mm256_cmp_ps(x.lo, b, _CMP_LT_OQ)),
                _mm256_blendv_ps(otherwise.hi, if_less.hi, _mm256_cmp_ps(x.hi, b, _CMP_LT_OQ)));
}
static inline v16 v_select_gt(v16 x, float bound, v16 if_greater, v16 otherwise) {
    __m256 b = _mm256_set1_ps(bound);
    return v_mk(_mm256_blendv_ps(otherwise.lo, if_greater.lo, _mm256_cmp_ps(x.lo, b, _CMP_GT_OQ)),
                _mm256_blendv_ps(otherwise.hi, if_greater.hi, _mm256_cmp_ps(x.hi, b, _CMP_GT_OQ)));
}
#define TY_MR 6
#else
#define TY_ISA "scalar"
typedef struct { float x[16]; } v16;
static inline v16 v_load(const float *p) { v16 r; memcpy(r.x, p, sizeof r.x); return r; }
static inline void v_store(float *p, v16 a) { memcpy(p, a.x, sizeof a.x); }
static inline v16 v_set1(float x) { v16 r; for (int i = 0; i < 16; i++) r.x[i] = x; return r; }
static inline v16 v_zero(void) { return v_set1(0.0f); }
#define TY_S2(name, expr) \
    static inline v16 name(v16 a, v16 b) { v16 r; for (int i = 0; i < 16; i++) r.x[i] = (expr); return r; }
TY_S2(v_add, a.x[i] + b.x[i])
TY_S2(v_sub, a.x[i] - b.x[i])
TY_S2(v_mul, a.x[i] * b.x[i])
TY_S2(v_div, a.x[i] / b.x[i])
TY_S2(v_max, b.x[i] > a.x[i] ? b.x[i] : a.x[i])
TY_S2(v_min, b.x[i] < a.x[i] ? b.x[i] : a.x[i])
static inline v16 v_fma(v16 a, v16 b, v16 c) { v16 r; for (int i = 0; i < 16; i++) r.x[i] = fmaf(a.x[i], b.x[i], c.x[i]); return r; }
static inline v16 v_load_bf16(const uint16_t *p) {
    v16 r;
    for (int i = 0; i < 16; i++) { uint32_t w = (uint32_t)p[i] << 16; memcpy(&r.x[i], &w, 4); }
    return r;
}
static inline v16 v_shl23(v16 y) {
    v16 r;
    for (int i = 0; i < 16; i++) { uint32_t w; memcpy(&w, &y.x[i], 4); w <<= 23; memcpy(&r.x[i], &w, 4); }
    return r;
}
static inline v16 v_select_lt(v16 x, float bound, v16 if_less, v16 otherwise) {
    v16 r; for (int i = 0; i < 16; i++) r.x[i] = x.x[i] < bound ? if_less.x[i] : otherwise.x[i]; return r;
}
static inline v16 v_select_gt(v16 x, float bound, v16 if_greater, v16 otherwise) {
    v16 r; for (int i = 0; i < 16; i++) r.x[i] = x.x[i] > bound ? if_greater.x[i] : otherwise.x[i]; return r;
}
#define TY_MR 4
#endif

#define TY_NR 32 /* GEMM micro-tile columns: two v16 */
#define TY_KC 256
#define TY_MC (TY_MR * 8)

const char *ty_isa(void) { return TY_ISA; }

static inline float bf16_to_f32(uint16_t h) { uint32_t w = (uint32_t)h << 16; float f; memcpy(&f, &w, 4); return f; }
static inline float load_elem(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Thread-local scratch, grown on demand and kept for the thread's life. */
static float *scratch(int slot, size_t floats) {
    static __thread float *buf[4];
    static __thread size_t cap[4];
    if (cap[slot] < floats) {
        free(buf[slot]);
        size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
        buf[slot] = aligned_alloc(64, bytes);
        cap[slot] = buf[slot] ? floats : 0;
    }
    return buf[slot];
}

/* ------------------------------------------------------------------------------------------------ exp / silu */

/* exp(x) for 16 lanes: n = round(x log2 e), r = x - n ln2 (two fma, Cody-Waite), Cephes' degree-7 polynomial, times
 * 2^n through the exponent bits. Below -87.3 (where the result would be subnormal) the result is 0, above 88.7
 * it is +inf. */
static inline v16 v_exp(v16 x) {
    const v16 magic = v_set1(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v16 xc = v_max(v_min(x, v_set1(88.0f)), v_set1(-87.0f));
    v16 n = v_sub(v_add(v_mul(xc, v_set1(1.44269504088896341f)), magic), magic);
    v16 r = v_fma(n, v_set1(-0.693359375f), xc);
    r = v_fma(n, v_set1(2.12194440e-4f), r);
    v16 p = v_set1(1.9875691500e-4f);
    p = v_fma(p, r, v_set1(1.3981999507e-3f));
    p = v_fma(p, r, v_set1(8.3334519073e-3f));
    p = v_fma(p, r, v_set1(4.1665795894e-2f));
    p = v_fma(p, r, v_set1(1.6666665459e-1f));
    p = v_fma(p, r, v_set1(5.0000001201e-1f));
    v16 r2 = v_mul(r, r);
    p = v_add(v_fma(p, r2, r), v_set1(1.0f));
    v16 scale = v_shl23(v_add(n, v_set1(12582912.0f + 127.0f)));
    v16 out = v_mul(p, scale);
    out = v_select_lt(x, -87.0f, v_zero(), out);
    return v_select_gt(x, 88.0f, v_set1(INFINITY), out);
}

/* op 0: exp, 1: sigmoid 1 / (1 + exp(-x)), 2: silu x / (1 + exp(-x)). x float32 or bf16, out float32. */
void ty_unary(int op, int64_t n, const void *x, int x_bf16, float *out, int nthreads) {
    const int64_t chunk = 4096;
    int64_t nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nchunks > 1)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t start = c * chunk, end = start + chunk < n ? start + chunk : n;
        for (int64_t i = start; i < end; i += 16) {
            float tmp[16];
            int64_t len = end - i < 16 ? end - i : 16;
            for (int64_t j = 0; j < 16; j++) tmp[j] = j < len ? load_elem(x, i + j, x_bf16) : 0.0f;
            v16 v = v_load(tmp), y;
            if (op == 0) {
                y = v_exp(v);
            } else {
                v16 denom = v_add(v_set1(1.0f), v_exp(v_sub(v_zero(), v)));
                y = v_div(op == 1 ? v_set1(1.0f) : v, denom);
            }
            v_store(tmp, y);
            memcpy(out + i, tmp, (size_t)len * sizeof(float));
        }
    }
}

/* ------------------------------------------------------------------------------------------------------ GEMM */

/* C[0:MR, 0:NR] (ldc) = (load ? C : 0) + a (kc x MR, packed) b (kc x NR, packed): per output one fma chain over k. */
static void micro_kernel(int64_t kc, const float *a, const float *b, float *c, int64_t ldc, int load) {
    v16 acc0[TY_MR], acc1[TY_MR];
#pragma GCC unroll 16
    for (int i = 0; i < TY_MR; i++) {
        acc0[i] = load ? v_load(c + i * ldc) : v_zero();
        acc1[i] = load ? v_load(c + i * ldc + 16) : v_zero();
    }
    for (int64_t k = 0; k < kc; k++) {
        v16 b0 = v_load(b + k * TY_NR), b1 = v_load(b + k * TY_NR + 16);
#pragma GCC unroll 16
        for (int i = 0; i < TY_MR; i++) {
            v16 ai = v_set1(a[k * TY_MR + i]);
            acc0[i] = v_fma(ai, b0, acc0[i]);
            acc1[i] = v_fma(ai, b1, acc1[i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < TY_MR; i++) {
        v_store(c + i * ldc, acc0[i]);
        v_store(c + i * ldc + 16, acc1[i]);
    }
}

#if defined(__AVX512BF16__)
#define TY_BF16_DOT "avx512_bf16"
/* bf16 x bf16: per output one vdpbf16ps chain over k pairs in increasing order; each instruction adds the odd
 * product, then the even one, each exactly rounded (the products of bf16 values are exact in float32), flushing
 * subnormals. a: [kc/2][MR] pairs, b: [kc/2][NR] pairs. */
static void micro_kernel_bf16(int64_t kc2, const uint32_t *a, const uint16_t *b, float *c, int64_t ldc, int load) {
    __m512 acc0[TY_MR], acc1[TY_MR];
#pragma GCC unroll 16
    for (int i = 0; i < TY_MR; i++) {
        acc0[i] = load ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps();
        acc1[i] = load ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < kc2; p++) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * 2 * TY_NR);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * 2 * TY_NR + 32);
#pragma GCC unroll 16
        for (int i = 0; i < TY_MR; i++) {
            __m512bh ai = (__m512bh)_mm512_set1_epi32((int)a[p * TY_MR + i]);
            acc0[i] = _mm512_dpbf16_ps(acc0[i], ai, b0);
            acc1[i] = _mm512_dpbf16_ps(acc1[i], ai, b1);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < TY_MR; i++) {
        _mm512_storeu_ps(c + i * ldc, acc0[i]);
        _mm512_storeu_ps(c + i * ldc + 16, acc1[i]);
    }
}
#else
#define TY_BF16_DOT "emulated"
#endif


/* The bf16 values src[k * stride], k < kc (zero from k = valid on), as lane `lane` of a [kc/2][width] panel of
 * bf16 pairs (k, k + 1): the layout of the bf16 dot-product micro-kernel. */
static void pack_pairs(const uint16_t *src, int64_t stride, int64_t kc, int64_t valid, uint16_t *dst, int64_t lane,
                       int64_t width) {
    if (stride == 1 && valid >= kc && ((uintptr_t)src & 3) == 0) { /* a pair is one aligned 32-bit word */
        const uint32_t *s32 = (const uint32_t *)src;
        uint32_t *d32 = (uint32_t *)dst;
        for (int64_t p = 0; p < kc / 2; p++) d32[p * width + lane] = s32[p];
        return;
    }
    for (int64_t k = 0; k < kc; k++) dst[(k >> 1) * 2 * width + 2 * lane + (k & 1)] = k < valid ? src[k * stride] : 0;
}

#if defined(__AVX512F__)
/* r[i] = column i of the 16 x 16 block whose rows are r[0..15] */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) { t[2*i] = _mm512_unpacklo_ps(r[2*i], r[2*i+1]); t[2*i+1] = _mm512_unpackhi_ps(r[2*i], r[2*i+1]); }
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[4*i]), b = _mm512_castps_pd(t[4*i+1]), c = _mm512_castps_pd(t[4*i+2]), d = _mm512_castps_pd(t[4*i+3]);
        r[4*i]   = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4*i+1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4*i+2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4*i+3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 4; i++) {
        t[i]      = _mm512_shuffle_f32x4(r[i], r[i+4], 0x88);
        t[i+4]    = _mm512_shuffle_f32x4(r[i], r[i+4], 0xdd);
        t[i+8]    = _mm512_shuffle_f32x4(r[i+8], r[i+12], 0x88);
        t[i+12]   = _mm512_shuffle_f32x4(r[i+8], r[i+12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i]      = _mm512_shuffle_f32x4(t[i], t[i+8], 0x88);
        r[i+8]    = _mm512_shuffle_f32x4(t[i], t[i+8], 0xdd);
        r[i+4]    = _mm512_shuffle_f32x4(t[i+4], t[i+12], 0x88);
        r[i+12]   = _mm512_shuffle_f32x4(t[i+4], t[i+12], 0xdd);
    }
}
#endif

/* ---------------------------------------------------------------------------------------------- AMX (bf16) */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define TY_AMX 1
/* Linux grants a process AMX's tile data only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
 * asked once, the answer kept: every call in a process takes the same path. TRAINYARD_INVARIANT_AMX=0 keeps a
 * process off AMX (the AVX512_BF16 path instead: what tests compare with the other builds). */
static int amx_usable(void) {
    static int state; /* 0 not asked yet, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        const char *env = getenv("TRAINYARD_INVARIANT_AMX");
        s = (env && strcmp(env, "0") == 0) ? -1 : syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) ty_tilecfg;

/* Every tile 16 rows of 64 bytes: C tiles 16 x 16 float32, operand tiles 16 x 32 bf16 (32 k of 16 outputs' weight
 * rows) or 16 pairs of k x 16 rows of the other operand (the instruction's pair layout). */
static void amx_config(void) {
    ty_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* One operand tile source per 16 columns n of B (the weight side): chunk c (k = 32c .. 32c + 31) of its 16 rows
 * of k at base + 32c with `stride` bytes between rows, for c < full; chunk `full` (the last, zero-padded) at tail. */
typedef struct {
    const uint16_t *base, *tail;
    int64_t stride, full;
} amx_src;

static inline const uint16_t *amx_chunk(const amx_src *s, int64_t c, int64_t *stride) {
    if (c < s->full) { *stride = s->stride; return s->base + 32 * c; }
    *stride = 64;
    return s->tail;
}

/* Rows (or columns) of a 16-wide tile starting at `start` that lie inside `total`: 0 .. 16. */
static inline int64_t tile_extent(int64_t total, int64_t start) {
    return start >= total ? 0 : total - start < 16 ? total - start : 16;
}

/* C tile (16 n x 16 m, float32) from / to C[m, n] (transposed; only m < rows, n < cols). */
static void amx_c_in(const float *C, int64_t ldc, int64_t rows, int64_t cols, float *t) {
    for (int64_t i = 0; i < 16; i++)
        for (int64_t j = 0; j < 16; j++) t[i * 16 + j] = j < rows && i < cols ? C[j * ldc + i] : 0.0f;
}
static void amx_c_out(const float *t, float *C, int64_t ldc, int64_t rows, int64_t cols) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(t + i * 16);
    transpose16(r);
    const __mmask16 valid = (__mmask16)((1u << cols) - 1);
    for (int64_t j = 0; j < rows; j++) _mm512_mask_storeu_ps(C + j * ldc, valid, r[j]);
}

/* C[m, n] for bf16 x bf16 through AMX's tile dot product: per output one chain over k in chunks of 32 in
 * increasing order, each chunk one TDPBF16PS (the instruction's own fixed order inside the chunk; it flushes
 * subnormals), a zero-padded chunk last when K is not a multiple of 32. The weight side (B's columns) is the
 * instruction's first operand, loaded in place when its k is contiguous; A's rows are packed into pairs once per
 * call. Which rows share a tile, a task or a thread never changes an output: each is computed from its own row and
 * column only. */
static void amx_gemm(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t a_rs, int64_t a_cs,
                     const uint16_t *B, int64_t b_rs, int64_t b_cs, float *C, int64_t ldc, int accumulate,
                     int nthreads) {
    const int64_t K32 = (K + 31) / 32 * 32, chunks = K32 / 32;
    const int64_t mtiles = (M + 15) / 16, ntiles = (N + 15) / 16;
    /* A's rows as pairs: per m-tile [K32 / 2][16] 32-bit words (row m of the tile in lane m) */
    uint16_t *ap = (uint16_t *)scratch(3, (size_t)mtiles * K32 * 8);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K > 65536)
    for (int64_t mt = 0; mt < mtiles; mt++)
        for (int64_t i = 0; i < 16; i++)
            pack_pairs(A + (mt * 16 + i) * a_rs, a_cs, K32, mt * 16 + i < M ? K : 0, ap + mt * K32 * 16, i, 16);
    const int direct = b_rs == 1; /* B[k, n] at B + n * b_cs + k: weight rows with contiguous k */
    const int64_t nb_tiles = M <= 16 ? 4 : 2, mb_tiles = M <= 16 ? 1 : 2; /* tiles of a task: 4 x 1 or 2 x 2 */
    const int64_t nblocks = (ntiles + nb_tiles - 1) / nb_tiles, mblocks = (mtiles + mb_tiles - 1) / mb_tiles;
    const int64_t tasks = nblocks * mblocks;
#pragma omp parallel num_threads(nthreads) if (tasks > 1 && M * N * K > 262144)
    {
        amx_config();
        float *t = scratch(0, 16 * 16 + 64 * K32 / 2 + 64 * 32 / 2);
        uint16_t *wbuf = (uint16_t *)(t + 256), *tails = wbuf + 64 * K32;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t nt0 = (task / mblocks) * nb_tiles, mt0 = (task % mblocks) * mb_tiles;
            amx_src src[4];
            for (int64_t a = 0; a < nb_tiles; a++) {
                int64_t n0 = (nt0 + a) * 16, cols = tile_extent(N, n0);
                uint16_t *tail = tails + a * 16 * 32;
                if (direct && cols == 16) {
                    src[a] = (amx_src){B + n0 * b_cs, tail, b_cs * 2, K / 32};
                    if (K % 32)
                        for (int64_t i = 0; i < 16; i++)
                            for (int64_t k = 0; k < 32; k++)
                                tail[i * 32 + k] = K / 32 * 32 + k < K ? B[(n0 + i) * b_cs + K / 32 * 32 + k] : 0;
                } else { /* packed: 16 rows of K32 (zeros past N and K) */
                    uint16_t *w = wbuf + a * 16 * K32;
                    for (int64_t i = 0; i < 16; i++)
                        for (int64_t k = 0; k < K32; k++)
                            w[i * K32 + k] = i < cols && k < K ? B[k * b_rs + (n0 + i) * b_cs] : 0;
                    src[a] = (amx_src){w, tail, K32 * 2, chunks};
                }
            }
            int64_t s0, s1, s2, s3;
/* C tile `tile` of n-tile a, m-tile b of the task: loaded from C (accumulate) or zeroed; stored where it is in C */
#define TY_C(a, b) (C + (mt0 + (b)) * 16 * ldc + (nt0 + (a)) * 16)
#define TY_EXTENTS(a, b) tile_extent(M, (mt0 + (b)) * 16), tile_extent(N, (nt0 + (a)) * 16)
#define TY_CIN(tile, a, b) do { if (!accumulate) { _tile_zero(tile); break; } \
        amx_c_in(TY_C(a, b), ldc, TY_EXTENTS(a, b), t); _tile_loadd(tile, t, 64); } while (0)
#define TY_COUT(tile, a, b) do { if (tile_extent(M, (mt0 + (b)) * 16) && tile_extent(N, (nt0 + (a)) * 16)) { \
        _tile_stored(tile, t, 64); amx_c_out(t, TY_C(a, b), ldc, TY_EXTENTS(a, b)); } } while (0)
            if (mb_tiles == 1) { /* 4 n-tiles x 1 m-tile: C in tmm0-3, rows of A in tmm4, weights in tmm5-7 */
                const uint16_t *x = ap + mt0 * K32 * 16;
                TY_CIN(0, 0, 0); TY_CIN(1, 1, 0); TY_CIN(2, 2, 0); TY_CIN(3, 3, 0);
                for (int64_t ch = 0; ch < chunks; ch++) {
                    _tile_loadd(4, x + ch * 16 * 32, 64);
                    const uint16_t *w0 = amx_chunk(&src[0], ch, &s0), *w1 = amx_chunk(&src[1], ch, &s1);
                    const uint16_t *w2 = amx_chunk(&src[2], ch, &s2), *w3 = amx_chunk(&src[3], ch, &s3);
                    _tile_loadd(5, w0, s0); _tile_dpbf16ps(0, 5, 4);
                    _tile_loadd(6, w1, s1); _tile_dpbf16ps(1, 6, 4);
                    _tile_loadd(7, w2, s2); _tile_dpbf16ps(2, 7, 4);
                    _tile_loadd(5, w3, s3); _tile_dpbf16ps(3, 5, 4);
                }
                TY_COUT(0, 0, 0); TY_COUT(1, 1, 0); TY_COUT(2, 2, 0); TY_COUT(3, 3, 0);
            } else { /* 2 n-tiles x 2 m-tiles: C in tmm0-3 (n-tile a, m-tile b at 2a + b), weights tmm4-5, A tmm6-7 */
                const uint16_t *x0 = ap + mt0 * K32 * 16, *x1 = x0 + (mt0 + 1 < mtiles ? K32 * 16 : 0);
                TY_CIN(0, 0, 0); TY_CIN(1, 0, 1); TY_CIN(2, 1, 0); TY_CIN(3, 1, 1);
                for (int64_t ch = 0; ch < chunks; ch++) {
                    const uint16_t *w0 = amx_chunk(&src[0], ch, &s0), *w1 = amx_chunk(&src[1], ch, &s1);
                    _tile_loadd(6, x0 + ch * 16 * 32, 64);
                    _tile_loadd(7, x1 + ch * 16 * 32, 64);
                    _tile_loadd(4, w0, s0);
                    _tile_loadd(5, w1, s1);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                TY_COUT(0, 0, 0); TY_COUT(1, 0, 1); TY_COUT(2, 1, 0); TY_COUT(3, 1, 1);
            }
#undef TY_C
#undef TY_EXTENTS
#undef TY_CIN
#undef TY_COUT
        }
        _tile_release();
    }
}
#endif

const char *ty_bf16_dot(void) {
#if defined(TY_AMX)
    if (amx_usable()) return "amx_bf16";
#endif
    return TY_BF16_DOT;
}


#if defined(__AVX512F__)
/* A 16 x 16 block whose rows are 16 panel columns' next 16 values (floats, or bf16 pairs as 32-bit words) into a
 * packed B panel: value i of row j at dst[i * TY_NR + j]. */
static inline void transpose_into_panel(__m512 r[16], float *dst) {
    transpose16(r);
    for (int64_t i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * TY_NR, r[i]);
}
#endif

/* Packing. B panel q (NR columns n0 + q*NR ..) of k-block k0 (kc rows) into dst: [kc][NR] floats, or with dot
 * [kc/2][NR] pairs of bf16; columns past ncols and k past K zero; with pairs (fp32 chains), position k holds k ^ 1. */
static void pack_b(const void *B, int64_t b_rs, int64_t b_cs, int b_bf16, int64_t K, int64_t k0, int64_t kc,
                   int64_t n0, int64_t ncols, int pairs, int dot, float *dst) {
    if (dot) {
#if defined(__AVX512F__)
        if (b_rs == 1 && ncols == TY_NR && kc <= K - k0) { /* weight rows with contiguous k: a pair is one 32-bit word
                                                             * of a row; 16 x 16 transposes of words */
            const int64_t pairs_n = kc / 2;
            uint32_t *d32 = (uint32_t *)dst;
            int64_t p = 0;
            for (; p + 16 <= pairs_n; p += 16)
                for (int64_t h = 0; h < TY_NR; h += 16) {
                    __m512 r[16];
                    for (int64_t j = 0; j < 16; j++)
                        r[j] = _mm512_castsi512_ps(_mm512_loadu_si512(
                            (const uint16_t *)B + (n0 + h + j) * b_cs + k0 + 2 * p));
                    transpose_into_panel(r, (float *)(d32 + p * TY_NR + h));
                }
            for (; p < pairs_n; p++)
                for (int64_t j = 0; j < TY_NR; j++)
                    memcpy(d32 + p * TY_NR + j, (const uint16_t *)B + (n0 + j) * b_cs + k0 + 2 * p, 4);
            return;
        }
#endif
        for (int64_t j = 0; j < TY_NR; j++)
            pack_pairs((const uint16_t *)B + k0 * b_rs + (n0 + j) * b_cs, b_rs, kc, j < ncols ? K - k0 : 0,
                       (uint16_t *)dst, j, TY_NR);
        return;
    }
    const int64_t flip = pairs ? 1 : 0;
#if defined(__AVX512F__)
    if (b_rs == 1 && !pairs && ncols == TY_NR) { /* columns with contiguous k (a weight [N, K]): 16 x 16 transposes */
        int64_t k = 0;
        for (; k + 16 <= kc; k += 16)
            for (int64_t h = 0; h < TY_NR; h += 16) {
                __m512 r[16];
                for (int64_t j = 0; j < 16; j++) {
                    int64_t at = (n0 + h + j) * b_cs + k0 + k;
                    r[j] = b_bf16 ? v_load_bf16((const uint16_t *)B + at) : _mm512_loadu_ps((const float *)B + at);
                }
                transpose_into_panel(r, dst + k * TY_NR + h);
            }
        for (; k < kc; k++)
            for (int64_t j = 0; j < TY_NR; j++) dst[k * TY_NR + j] = load_elem(B, (n0 + j) * b_cs + k0 + k, b_bf16);
        return;
    }
#endif
    if (b_cs == 1 && !pairs) {
        for (int64_t k = 0; k < kc; k++) {
            int64_t base = (k0 + k) * b_rs + n0;
            float *row = dst + k * TY_NR;
            if (!b_bf16) memcpy(row, (const float *)B + base, (size_t)ncols * sizeof(float));
            else for (int64_t j = 0; j < ncols; j++) row[j] = bf16_to_f32(((const uint16_t *)B)[base + j]);
            for (int64_t j = ncols; j < TY_NR; j++) row[j] = 0.0f;
        }
        return;
    }
    for (int64_t j = 0; j < TY_NR; j++) {
        if (j >= ncols) { for (int64_t k = 0; k < kc; k++) dst[k * TY_NR + j] = 0.0f; continue; }
        int64_t base = k0 * b_rs + (n0 + j) * b_cs;
        if (!b_bf16 && b_rs == 1 && !pairs) {
            const float *src = (const float *)B + base;
            for (int64_t k = 0; k < kc; k++) dst[k * TY_NR + j] = src[k];
        } else {
            for (int64_t k = 0; k < kc; k++) {
                int64_t kk = k ^ flip;
                dst[k * TY_NR + j] = k0 + kk < K ? load_elem(B, base + kk * b_rs, b_bf16) : 0.0f;
            }
        }
    }
}

/* A rows m0 .. m0 + rows - 1 (a panel of MR) of k-block k0 into dst: [kc][MR] floats or [kc/2][MR] bf16 pairs. */
static void pack_a(const void *A, int64_t a_rs, int64_t a_cs, int a_bf16, int64_t K, int64_t k0, int64_t kc,
                   int64_t m0, int64_t rows, int pairs, int dot, float *dst) {
    if (dot) {
        for (int i = 0; i < TY_MR; i++)
            pack_pairs((const uint16_t *)A + (m0 + i) * a_rs + k0 * a_cs, a_cs, kc, i < rows ? K - k0 : 0,
                       (uint16_t *)dst, i, TY_MR);
        return;
    }
    const int64_t flip = pairs ? 1 : 0;
    for (int i = 0; i < TY_MR; i++) {
        if (i >= rows) { for (int64_t k = 0; k < kc; k++) dst[k * TY_MR + i] = 0.0f; continue; }
        int64_t base = (m0 + i) * a_rs + k0 * a_cs;
        if (!a_bf16 && a_cs == 1) {
            const float *src = (const float *)A + base;
            for (int64_t k = 0; k < kc; k++) dst[k * TY_MR + i] = src[k];
        } else if (a_bf16 && a_cs == 1) {
            const uint16_t *src = (const uint16_t *)A + base;
            for (int64_t k = 0; k < kc; k++) {
                int64_t kk = k ^ flip;
                dst[k * TY_MR + i] = k0 + kk < K ? bf16_to_f32(src[kk]) : 0.0f;
            }
        } else {
            for (int64_t k = 0; k < kc; k++) {
                int64_t kk = k ^ flip;
                dst[k * TY_MR + i] = k0 + kk < K ? load_elem(A, base + kk * a_cs, a_bf16) : 0.0f;
            }
        }
    }
}

/* A[m, k] at A + m * a_rs + k * a_cs (elements), B[k, n] at B + k * b_rs + n * b_cs; C[m, n] at C + m * ldc.
 * When both operands are bf16 the chain takes k in pairs, the odd index first (k = 1, 0, 3, 2, ...; an odd K gets
 * a zero term): the order of AVX512_BF16's dot-product instruction, which builds with it use and the others
 * reproduce with fma.
 * Blocking (none of it changes a result): B is packed once per call, a chunk of columns at a time (at most about
 * 4 MB packed); then tasks of (MC rows, NC columns) pack their rows of A per k-block and run the micro-kernel. */
void ty_gemm(int64_t M, int64_t N, int64_t K, const void *A, int64_t a_rs, int64_t a_cs, int a_bf16, const void *B,
             int64_t b_rs, int64_t b_cs, int b_bf16, float *C, int64_t ldc, int accumulate, int nthreads) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (!accumulate)
            for (int64_t m = 0; m < M; m++) memset(C + m * ldc, 0, (size_t)N * sizeof(float));
        return;
    }
    const int pairs = a_bf16 && b_bf16;
#if defined(TY_AMX)
    if (pairs && amx_usable()) {
        amx_gemm(M, N, K, (const uint16_t *)A, a_rs, a_cs, (const uint16_t *)B, b_rs, b_cs, C, ldc, accumulate,
                 nthreads);
        return;
    }
#endif
    const int64_t Kp = pairs ? (K + 1) / 2 * 2 : K;
#if defined(__AVX512BF16__)
    const int dot = pairs;
#else
    const int dot = 0;
#endif
    const int64_t kblocks = (Kp + TY_KC - 1) / TY_KC;
    const int64_t panel_floats = Kp * TY_NR; /* one packed B panel, all k-blocks (bf16 pairs use half) */
    int64_t chunk_panels = (int64_t)(1 << 20) / panel_floats; /* ~4 MB of packed B per chunk */
    if (chunk_panels < 2 * nthreads) chunk_panels = 2 * nthreads;
    int64_t npanels_all = (N + TY_NR - 1) / TY_NR;
    if (chunk_panels > npanels_all) chunk_panels = npanels_all;
    float *bp_all = scratch(3, (size_t)chunk_panels * panel_floats);
    int64_t nm = (M + TY_MC - 1) / TY_MC;
    for (int64_t c0 = 0; c0 < N; c0 += chunk_panels * TY_NR) {
        int64_t cn = N - c0 < chunk_panels * TY_NR ? N - c0 : chunk_panels * TY_NR;
        int64_t cpanels = (cn + TY_NR - 1) / TY_NR;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (cpanels * Kp > 8192)
        for (int64_t q = 0; q < cpanels; q++) {
            int64_t ncols = cn - q * TY_NR < TY_NR ? cn - q * TY_NR : TY_NR;
            for (int64_t kb = 0; kb < kblocks; kb++) {
                int64_t k0 = kb * TY_KC, kc = Kp - k0 < TY_KC ? Kp - k0 : TY_KC;
                pack_b(B, b_rs, b_cs, b_bf16, K, k0, kc, c0 + q * TY_NR, ncols, pairs, dot,
                       bp_all + q * panel_floats + k0 * TY_NR);
            }
        }
        int64_t want = (2 * (int64_t)nthreads + nm - 1) / nm; /* column blocks per row block: >= 2 tasks a thread */
        int64_t pper = (cpanels + want - 1) / want;
        if (pper > 16) pper = 16;
        int64_t nn = (cpanels + pper - 1) / pper, tasks = nm * nn;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (tasks > 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t m0 = (task / nn) * TY_MC, q0 = (task % nn) * pper;
            int64_t q1 = q0 + pper < cpanels ? q0 + pper : cpanels;
            int64_t mc = M - m0 < TY_MC ? M - m0 : TY_MC, mpanels = (mc + TY_MR - 1) / TY_MR;
            float *ap = scratch(0, (size_t)mpanels * TY_MR * TY_KC);
            float tile[TY_MR * TY_NR];
            for (int64_t kb = 0; kb < kblocks; kb++) {
                int64_t k0 = kb * TY_KC, kc = Kp - k0 < TY_KC ? Kp - k0 : TY_KC; /* even when pairs */
                int load = accumulate || k0 > 0;
                for (int64_t p = 0; p < mpanels; p++) {
                    int64_t rows = mc - p * TY_MR < TY_MR ? mc - p * TY_MR : TY_MR;
                    pack_a(A, a_rs, a_cs, a_bf16, K, k0, kc, m0 + p * TY_MR, rows, pairs, dot, ap + p * TY_MR * kc);
                }
                for (int64_t q = q0; q < q1; q++) {
                    int64_t cols = cn - q * TY_NR < TY_NR ? cn - q * TY_NR : TY_NR;
                    const float *bq = bp_all + q * panel_floats + k0 * TY_NR;
                    for (int64_t p = 0; p < mpanels; p++) {
                        int64_t rows = mc - p * TY_MR < TY_MR ? mc - p * TY_MR : TY_MR;
                        float *c = C + (m0 + p * TY_MR) * ldc + c0 + q * TY_NR;
                        int full = rows == TY_MR && cols == TY_NR;
                        float *dstc = full ? c : tile;
                        int64_t ld = full ? ldc : TY_NR;
                        if (!full && load) { /* an edge tile: the same chains on a full tile in a buffer */
                            for (int64_t i = 0; i < TY_MR; i++)
                                for (int64_t j = 0; j < TY_NR; j++)
                                    tile[i * TY_NR + j] = i < rows && j < cols ? c[i * ldc + j] : 0.0f;
                        }
#if defined(__AVX512BF16__)
                        if (dot)
                            micro_kernel_bf16(kc / 2, (const uint32_t *)(ap + p * TY_MR * kc),
                                              (const uint16_t *)bq, dstc, ld, load);
                        else
#endif
                            micro_kernel(kc, ap + p * TY_MR * kc, bq, dstc, ld, load);
                        if (!full)
                            for (int64_t i = 0; i < rows; i++)
                                memcpy(c + i * ldc, tile + i * TY_NR, (size_t)cols * sizeof(float));
                    }
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------------- attention */

/* Attention over J sequences x Kh kv heads, G query heads per kv head (query head h = kh * G + g), T query
 * positions each. Query row (j, h, t) sees keys lo[j*T+t] .. hi[j*T+t]-1 of its sequence (and adds mask[j, h, t, s]
 * when mask is given; strides may be 0 to broadcast).
 *   q (j, h, t, d)   at q + j*q_js + h*q_hs + t*q_ts + d
 *   key s of (j, kh) at k + j*k_js + kh*k_hs + off(s) + d, off(s) = s*k_ss without a block table, else
 *                    table[j*table_js + s / block_size] * k_bs + (s % block_size) * k_ss (a paged KV pool)
 *   v likewise with its strides; out (j, h, t, dv) at out + j*o_js + h*o_hs + t*o_ts (float32).
 * A row with no visible key (or only -inf scores) gets zeros. */
#define TY_TQ 16 /* query positions per task (tiling only) */
void ty_attention(int64_t J, int64_t Kh, int64_t G, int64_t T, int64_t D, int64_t Dv,
                  const void *q, int q_bf16, int64_t q_js, int64_t q_hs, int64_t q_ts,
                  const void *k, const void *v, int kv_bf16,
                  int64_t k_js, int64_t k_hs, int64_t k_bs, int64_t k_ss,
                  int64_t v_js, int64_t v_hs, int64_t v_bs, int64_t v_ss,
                  const int64_t *table, int64_t table_js, int64_t block_size,
                  const int32_t *lo, const int32_t *hi,
                  const float *mask, int64_t m_js, int64_t m_hs, int64_t m_ts,
                  float scale, float *out, int64_t o_js, int64_t o_hs, int64_t o_ts, int nthreads) {
    int64_t ntiles = (T + TY_TQ - 1) / TY_TQ, tasks = J * Kh * ntiles;
    int64_t Dp = (D + 15) / 16 * 16, Dvp = (Dv + 15) / 16 * 16;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t j = task / (Kh * ntiles), kh = (task / ntiles) % Kh, t0 = (task % ntiles) * TY_TQ;
        int64_t t1 = t0 + TY_TQ < T ? t0 + TY_TQ : T, nt = t1 - t0, rows = nt * G;
        int64_t s_lo = INT64_MAX, s_hi = 0;
        for (int64_t t = t0; t < t1; t++) {
            int64_t a = lo[j * T + t], b = hi[j * T + t];
            if (b > a) { s_lo = a < s_lo ? a : s_lo; s_hi = b > s_hi ? b : s_hi; }
        }
        if (s_hi == 0) { /* no row of the tile sees a key */
            for (int64_t t = t0; t < t1; t++)
                for (int64_t g = 0; g < G; g++)
                    memset(out + j * o_js + (kh * G + g) * o_hs + t * o_ts, 0, (size_t)Dv * sizeof(float));
            continue;
        }
        int64_t span = (s_hi - s_lo + 15) / 16 * 16; /* scores of row r at sc + r * span, key s at s - s_lo */
        float *qf = scratch(0, (size_t)rows * Dp);
        float *sc = scratch(1, (size_t)rows * span);
        float *kt = scratch(2, (size_t)Dp * 16 + (size_t)Dvp);
        float *vrow = kt + Dp * 16;
        /* queries as float32 rows r = (t - t0) * G + g */
        for (int64_t t = t0; t < t1; t++)
            for (int64_t g = 0; g < G; g++) {
                float *dst = qf + ((t - t0) * G + g) * Dp;
                int64_t base = j * q_js + (kh * G + g) * q_hs + t * q_ts;
                for (int64_t d = 0; d < D; d++) dst[d] = load_elem(q, base + d, q_bf16);
            }
        /* scores, 16 keys at a time: key block transposed to kt[d][16] */
        for (int64_t s0 = s_lo; s0 < s_hi; s0 += 16) {
            int64_t nk = s_hi - s0 < 16 ? s_hi - s0 : 16;
            for (int64_t i = 0; i < 16; i++) {
                if (i >= nk) { for (int64_t d = 0; d < D; d++) kt[d * 16 + i] = 0.0f; continue; }
                int64_t s = s0 + i;
                int64_t off = table ? table[j * table_js + s / block_size] * k_bs + (s % block_size) * k_ss : s * k_ss;
                int64_t base = j * k_js + kh * k_hs + off;
                if (kv_bf16) { const uint16_t *src = (const uint16_t *)k + base; for (int64_t d = 0; d < D; d++) kt[d * 16 + i] = bf16_to_f32(src[d]); }
                else { const float *src = (const float *)k + base; for (int64_t d = 0; d < D; d++) kt[d * 16 + i] = src[d]; }
            }
            int64_t r = 0;
            for (; r + 4 <= rows; r += 4) {
                const float *q0 = qf + r * Dp, *q1 = q0 + Dp, *q2 = q1 + Dp, *q3 = q2 + Dp;
                v16 a0 = v_zero(), a1 = v_zero(), a2 = v_zero(), a3 = v_zero();
                for (int64_t d = 0; d < D; d++) {
                    v16 kv = v_load(kt + d * 16);
                    a0 = v_fma(v_set1(q0[d]), kv, a0);
                    a1 = v_fma(v_set1(q1[d]), kv, a1);
                    a2 = v_fma(v_set1(q2[d]), kv, a2);
                    a3 = v_fma(v_set1(q3[d]), kv, a3);
                }
                v_store(sc + r * span + (s0 - s_lo), a0);
                v_store(sc + (r + 1) * span + (s0 - s_lo), a1);
                v_store(sc + (r + 2) * span + (s0 - s_lo), a2);
                v_store(sc + (r + 3) * span + (s0 - s_lo), a3);
            }
            for (; r < rows; r++) {
                const float *q0 = qf + r * Dp;
                v16 a0 = v_zero();
                for (int64_t d = 0; d < D; d++) a0 = v_fma(v_set1(q0[d]), v_load(kt + d * 16), a0);
                v_store(sc + r * span + (s0 - s_lo), a0);
            }
        }
        /* per row: scale, mask, range; max; exp; then P V and the denominator over the visible keys */
        for (int64_t t = t0; t < t1; t++) {
            int64_t a = lo[j * T + t], b = hi[j * T + t];
            for (int64_t g = 0; g < G; g++) {
                int64_t r = (t - t0) * G + g, h = kh * G + g;
                float *row = sc + r * span - s_lo; /* row[s] for s in [s_lo, s_lo + span) */
                if (b <= a) { memset(out + j * o_js + h * o_hs + t * o_ts, 0, (size_t)Dv * sizeof(float)); continue; }
                const float *mrow = mask ? mask + j * m_js + h * m_hs + t * m_ts : NULL;
                float m = -INFINITY;
                for (int64_t s = a; s < b; s++) {
                    float x = row[s] * scale;
                    if (mrow) x = x + mrow[s];
                    row[s] = x;
                    m = x > m ? x : m;
                }
                if (m == -INFINITY) { /* every visible score is -inf: p = 0 everywhere, the output 0 */
                    for (int64_t s = a; s < b; s++) row[s] = 0.0f;
                    continue;
                }
                int64_t s = a;
                for (; s + 16 <= b; s += 16) v_store(row + s, v_exp(v_sub(v_load(row + s), v_set1(m))));
                if (s < b) {
                    float tmp[16];
                    for (int64_t i = 0; i < 16; i++) tmp[i] = s + i < b ? row[s + i] : -INFINITY;
                    v_store(tmp, v_exp(v_sub(v_load(tmp), v_set1(m))));
                    memcpy(row + s, tmp, (size_t)(b - s) * sizeof(float));
                }
            }
            /* P V: the G heads of position t share the key range; two heads at a time share each value load */
            for (int64_t g = 0; g < G; g++) {
                int64_t r0 = (t - t0) * G + g, two = g + 1 < G && b > a;
                if (b <= a) continue;
                const float *p0 = sc + r0 * span - s_lo, *p1 = two ? p0 + span : p0;
                float *o0 = out + j * o_js + (kh * G + g) * o_hs + t * o_ts;
                float *o1 = two ? o0 + o_hs : o0;
                float l0 = 0.0f, l1 = 0.0f;
                for (int64_t c0 = 0; c0 < Dvp; c0 += 128) {
                    int64_t nvec = (Dvp - c0) / 16 < 8 ? (Dvp - c0) / 16 : 8;
                    v16 acc0[8], acc1[8];
                    for (int i = 0; i < 8; i++) { acc0[i] = v_zero(); acc1[i] = v_zero(); }
                    float s0sum = 0.0f, s1sum = 0.0f;
                    for (int64_t s = a; s < b; s++) {
                        int64_t off = table ? table[j * table_js + s / block_size] * v_bs + (s % block_size) * v_ss : s * v_ss;
                        int64_t base = j * v_js + kh * v_hs + off + c0;
                        v16 pp0 = v_set1(p0[s]), pp1 = v_set1(p1[s]);
                        if (c0 + nvec * 16 > Dv) { /* a partial last vector: through a zero-padded row */
                            for (int64_t i = 0; i < nvec * 16; i++)
                                vrow[i] = c0 + i < Dv ? load_elem(v, base + i, kv_bf16) : 0.0f;
                            for (int i = 0; i < nvec; i++) {
                                v16 vv = v_load(vrow + 16 * i);
                                acc0[i] = v_fma(pp0, vv, acc0[i]);
                                acc1[i] = v_fma(pp1, vv, acc1[i]);
                            }
                        } else if (kv_bf16) {
                            const uint16_t *src = (const uint16_t *)v + base;
                            for (int i = 0; i < nvec; i++) {
                                v16 vv = v_load_bf16(src + 16 * i);
                                acc0[i] = v_fma(pp0, vv, acc0[i]);
                                acc1[i] = v_fma(pp1, vv, acc1[i]);
                            }
                        } else {
                            const float *src = (const float *)v + base;
                            for (int i = 0; i < nvec; i++) {
                                v16 vv = v_load(src + 16 * i);
                                acc0[i] = v_fma(pp0, vv, acc0[i]);
                                acc1[i] = v_fma(pp1, vv, acc1[i]);
                            }
                        }
                        if (c0 == 0) { s0sum = s0sum + p0[s]; s1sum = s1sum + p1[s]; }
                    }
                    if (c0 == 0) { l0 = s0sum; l1 = s1sum; }
                    for (int i = 0; i < nvec; i++) {
                        float tmp[16];
                        int64_t n = Dv - (c0 + 16 * i) < 16 ? Dv - (c0 + 16 * i) : 16;
                        if (n <= 0) break;
                        v_store(tmp, l0 > 0.0f ? v_div(acc0[i], v_set1(l0)) : v_zero());
                        memcpy(o0 + c0 + 16 * i, tmp, (size_t)n * sizeof(float));
                        if (two) {
                            v_store(tmp, l1 > 0.0f ? v_div(acc1[i], v_set1(l1)) : v_zero());
                            memcpy(o1 + c0 + 16 * i, tmp, (size_t)n * sizeof(float));
                        }
                    }
                }
                if (two) g++;
            }
        }
    }
}
