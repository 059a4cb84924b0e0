/* Fused decode attention over the stored cache, on the CPU: one new query token per sequence.
 *
 * Reads one layer's cache where it lies -- the page table of serving/pages.py (per page: position, rows, then
 * for K and for V the data address and strides, scale / zero addresses and strides, outlier counts, their exclusive
 * prefix sum, indices, values; addresses in elements of each tensor) and the fp16 sink and residual rows -- and,
 * per tile of TILE rows of one (sequence, kv head): unpacks the b-bit codes (little-endian bit stream, code j at
 * bits [j*b, (j+1)*b)), maps them through the codebook (nuq) or code * scale + zero (uniform; per token, per channel
 * group, or static per channel), or fp8 bytes through their 256-entry table times the per-head scale, puts the
 * sparse outliers of each row back, multiplies keys by the SmoothAttention lambda, rotates pre-RoPE keys at their
 * positions (rotate-half, cos / sin from the caller's table), computes the scores of every query head of the GQA
 * group against the tile (each kv head's rows read once for its group), an online softmax in float32 and the value
 * sum. Work items (sequence, kv head, run of rows) run in parallel (OpenMP, the process's runtime: torch's), each
 * leaving (max, sum, accumulator) partials that one pass merges by the same rule. With split_v (rotated values:
 * encoded value rows are stored rotated, fp16 rows are not) the merge writes the value sum of the fp16 rows' items
 * and that of the pages' items apart, both under the same max and sum; the caller un-rotates the second and adds.
 *
 * Built by serving/cpu_attention.py (cc -O3 -march=native -fopenmp -ffp-contract=off); called through ctypes.
 * The wrapper checks every buffer against the shapes it states (serving/cpu_attention.py); what an index read from
 * data could still make out of bounds is refused here with a negative return code, never read or written: shapes
 * beyond MAX_D / MAX_G / MAX_ROW_ENTRIES, page rows past the RoPE table, a negative stored outlier count,
 * list offset or index.
 * The attention's arithmetic is the oracle's (runtime_check/reference.py) up to float32 rounding (summation order);
 * the encoder's (kvcalib_encode, at the end) is the codec's to the bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

enum { FMT_FP16 = 0, FMT_FP8 = 1, FMT_UNIFORM = 2, FMT_NUQ = 3 };
enum { SC_NONE = 0, SC_TOKEN = 1, SC_GROUP = 2, SC_STATIC = 3, SC_HEAD = 4 };
#define N_SIDE 15
#define N_PAGE (2 + 2 * N_SIDE)
#define TILE 16
#define MAX_D 256
#define MAX_G 32
#define MAX_ROW_ENTRIES 32767   /* int16 outlier indices h * D + d: H * D at most this (exporters/layout.py's,
                                   compared by tests/serving/test_untrusted_binding.py) */
#define KVCALIB_ABI 5

typedef _Float16 half;

typedef struct {
    int32_t fmt, bits, smode, group, outliers;
    const float *scale;  /* SC_HEAD: [H_kv] fp8 scale; SC_STATIC: range [H_kv, D] */
    const float *zero;   /* SC_STATIC: zero [H_kv, D] */
    const float *lut;    /* FMT_NUQ: codebook [2^bits]; FMT_FP8: the value of each byte [256] */
} Side;

typedef struct {
    const half *k, *v;   /* [B, H_kv, n, D] fp16 post-RoPE, element strides below; NULL: none */
    int64_t ks[4], vs[4];
    int64_t n;
    int64_t first, ring; /* ring > 0: row i lies at row (first + i) % ring of the strided rows (a ring buffer read in
                            place: the vLLM plugin's recent window); 0: at row i */
} Rows;

typedef struct {
    int64_t b, h;        /* sequence, kv head */
    int64_t kind;        /* -1: sink rows, -2: residual rows, >= 0: page index */
    int64_t r0, r1;      /* run of rows */
} Item;

typedef struct {
    const int64_t *pages; int64_t n_pages;
    const float *q; int64_t B, H_kv, G, D;   /* q [B, H_kv * G, D] contiguous */
    float scaling;
    const float *lam;    /* [H_kv, D] or NULL */
    const float *rope;   /* [N, 2, D / 2]: cos then sin of each position's D / 2 frequencies, or NULL */
    int64_t rope_n;
    Rows sink, recent;
    Side ks, vs;
    float klut16[16], vlut16[16];   /* the codebooks padded to 16 (filled by kvcalib_decode) */
    int32_t split_v;     /* 1: out holds [2, B, H_kv * G, D], the fp16 rows' part then the pages' part */
    const int64_t *page_b;        /* NULL: every page holds rows of all B sequences (b-strided); else per page the
                                     one sequence it belongs to (a page of its own: b-stride unused, outlier rows
                                     page-local) -- the vLLM plugin's pages, every decoding sequence in one call */
    const Rows *sinks, *recents;  /* NULL: sink / recent above (b-strided); else [B], each sequence's own rows */
    const int64_t *byte_f, *half_f;  /* NULL: the page table's addresses are absolute; else [N_PAGE] 0/1 per field:
                                        field + byte_f * base + half_f * (base / 2) (a table relative to one
                                        layer's cache, shared by the layers of a step: the vLLM plugin's) */
    int64_t base;
} Call;

int kvcalib_abi(void) { return KVCALIB_ABI; }
int kvcalib_tile(void) { return TILE; }
int kvcalib_max_d(void) { return MAX_D; }
int kvcalib_max_g(void) { return MAX_G; }
int kvcalib_max_row_entries(void) { return MAX_ROW_ENTRIES; }

int kvcalib_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* 3-bit codes, D % 8 == 0: every 8 codes fill 3 bytes exactly (code j is bits 3j..3j+2 of the row's little-endian
 * bit string), so each group of 3 bytes is read once as one 24-bit word and cut with fixed shifts -- no per-code
 * byte index, no bounds test. */
static inline __attribute__((always_inline)) void unpack3(const uint8_t *p, int64_t D, uint8_t *c) {
    for (int64_t g = 0; g < D / 8; g++) {
        const uint8_t *q = p + 3 * g;
        const uint32_t w = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16;
        for (int k = 0; k < 8; k++) c[8 * g + k] = (uint8_t)((w >> (3 * k)) & 7);
    }
}

/* Codes of one packed row: D codes of `bits` bits -> c[0..D-1]. */
static inline void unpack(const uint8_t *p, int bits, int64_t D, uint8_t *c) {
    if (bits == 3 && D % 8 == 0) {
        unpack3(p, D, c);
    } else if (bits == 4) {
        for (int64_t j = 0; j < D / 2; j++) {
            uint8_t x = p[j];
            c[2 * j] = x & 15;
            c[2 * j + 1] = x >> 4;
        }
        if (D & 1) c[D - 1] = p[D / 2] & 15;
    } else if (bits == 2) {
        for (int64_t j = 0; j < D; j++) c[j] = (p[j >> 2] >> ((j & 3) * 2)) & 3;
    } else if (bits == 8) {
        memcpy(c, p, (size_t)D);
    } else {
        const int64_t n_bytes = (D * bits + 7) / 8;
        const int mask = (1 << bits) - 1;
        for (int64_t j = 0; j < D; j++) {
            int64_t bit = j * bits, i = bit >> 3;
            int w = p[i] | (i + 1 < n_bytes ? p[i + 1] << 8 : 0);
            c[j] = (uint8_t)((w >> (bit & 7)) & mask);
        }
    }
}

/* The levels of one packed row of codes: nuq's codebook entry or uniform's code as a float -> lv[0..D-1]. With
 * AVX-512, 2- and 4-bit rows of D % 32 == 0 channels are unpacked 32 codes at a time and 3-bit rows of D % 16 == 0
 * 16 at a time (6 bytes: with VBMI by one byte permutation, else as one 48-bit word), and mapped through the codebook held in one register (permutexvar); everything
 * else code by code. lut16: the codebook padded to 16. */
static inline __attribute__((always_inline)) void levels_row(const Side *sd, const float *lut16, const uint8_t *p, int64_t D, float *lv) {
#ifdef __AVX512F__
    if ((sd->bits == 4 || sd->bits == 2) && D % 32 == 0) {
        const __m512 book = _mm512_loadu_ps(lut16);
        const int nuq = sd->fmt == FMT_NUQ;
        for (int64_t j = 0; j < D; j += 32) {
            __m128i c0, c1;   /* codes j..j+15, j+16..j+31 as bytes */
            if (sd->bits == 4) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(p + j / 2));
                const __m128i m = _mm_set1_epi8(15);
                const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
                c0 = _mm_unpacklo_epi8(lo, hi);
                c1 = _mm_unpackhi_epi8(lo, hi);
            } else {
                const __m128i b = _mm_loadl_epi64((const __m128i *)(p + j / 4));   /* 8 bytes, 32 codes */
                const __m128i m = _mm_set1_epi8(3);
                const __m128i e0 = _mm_and_si128(b, m), e1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
                const __m128i e2 = _mm_and_si128(_mm_srli_epi16(b, 4), m), e3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
                const __m128i a01 = _mm_unpacklo_epi8(e0, e1), a23 = _mm_unpacklo_epi8(e2, e3);  /* per byte i: e0 e1 / e2 e3 */
                c0 = _mm_unpacklo_epi16(a01, a23);   /* bytes 0..3: e0 e1 e2 e3 each */
                c1 = _mm_unpackhi_epi16(a01, a23);   /* bytes 4..7 */
            }
            const __m512i i0 = _mm512_cvtepu8_epi32(c0), i1 = _mm512_cvtepu8_epi32(c1);
            _mm512_storeu_ps(lv + j, nuq ? _mm512_permutexvar_ps(i0, book) : _mm512_cvtepi32_ps(i0));
            _mm512_storeu_ps(lv + j + 16, nuq ? _mm512_permutexvar_ps(i1, book) : _mm512_cvtepi32_ps(i1));
        }
        return;
    }
#ifdef __AVX512VBMI__
    if (sd->bits == 3 && D % 16 == 0) {
        /* 16 codes are 6 bytes: one masked load (nothing read past them), lane k's two bytes -- those holding bits
         * 3k..3k+2 -- put in its low half by one byte permutation (VBMI), shifted right by 3k % 8 and masked; a
         * third of the instructions of the path below (no word through a general register, no broadcasts) */
        const __m512 book = _mm512_loadu_ps(lut16);
        const int nuq = sd->fmt == FMT_NUQ;
        const __m512i pick = _mm512_set_epi32(0x0605, 0x0605, 0x0504, 0x0504, 0x0504, 0x0403, 0x0403, 0x0403,
                                              0x0302, 0x0302, 0x0201, 0x0201, 0x0201, 0x0100, 0x0100, 0x0100);
        const __m512i shift = _mm512_set_epi32(5, 2, 7, 4, 1, 6, 3, 0, 5, 2, 7, 4, 1, 6, 3, 0);
        const __m512i seven = _mm512_set1_epi32(7);
        for (int64_t j = 0; j < D; j += 16) {
            const __m512i b = _mm512_maskz_loadu_epi8((__mmask64)0x3F, p + 3 * j / 8);
            const __m512i i0 = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi8(pick, b), shift), seven);
            _mm512_storeu_ps(lv + j, nuq ? _mm512_permutexvar_ps(i0, book) : _mm512_cvtepi32_ps(i0));
        }
        return;
    }
#endif
    if (sd->bits == 3 && D % 16 == 0) {
        /* 16 codes are 6 bytes: read as one 48-bit word (memcpy of exactly 6: nothing past the row), its low and
         * high 24 bits broadcast to lanes 0-7 and 8-15, each lane shifted by 3 * (lane % 8) and masked */
        const __m512 book = _mm512_loadu_ps(lut16);
        const int nuq = sd->fmt == FMT_NUQ;
        const __m512i shift = _mm512_set_epi32(21, 18, 15, 12, 9, 6, 3, 0, 21, 18, 15, 12, 9, 6, 3, 0);
        const __m512i seven = _mm512_set1_epi32(7);
        for (int64_t j = 0; j < D; j += 16) {
            uint64_t w = 0;
            memcpy(&w, p + 3 * j / 8, 6);   /* little-endian: byte 0 in the low bits, as the packer wrote them */
            const __m512i both = _mm512_mask_blend_epi32((__mmask16)0xFF00, _mm512_set1_epi32((int)(w & 0xFFFFFF)),
                                                         _mm512_set1_epi32((int)(w >> 24)));
            const __m512i i0 = _mm512_and_si512(_mm512_srlv_epi32(both, shift), seven);
            _mm512_storeu_ps(lv + j, nuq ? _mm512_permutexvar_ps(i0, book) : _mm512_cvtepi32_ps(i0));
        }
        return;
    }
#endif
    uint8_t c[MAX_D];
    unpack(p, sd->bits, D, c);
    if (sd->fmt == FMT_NUQ)
        for (int64_t d = 0; d < D; d++) lv[d] = sd->lut[c[d]];
    else
        for (int64_t d = 0; d < D; d++) lv[d] = (float)c[d];
}

/* The sparse outliers of one stored row (page-relative row t of sequence b) that fall in kv head h, put back into
 * its decoded values out[0..D-1]. Returns 0, or 1 for a negative outlier count, list offset or index (a corrupt
 * list: nothing read or written for it). */
static inline __attribute__((always_inline)) int put_outliers(const Side *sd, const int64_t *f, int64_t B, int64_t D,
                                                            int64_t b, int64_t h, int64_t t, float *out) {
    const int64_t r = t * B + b;   /* token row t of sequence b: outlier row t * B + b */
    const int n = ((const int16_t *)(intptr_t)(f[11] * 2))[r];
    /* outliers 1: the list offsets int64 (f[12] in int64 elements); 2: int16 (f[12] in int16 elements) -- a
       page's own pool, the vLLM plugin's (exporters/vllm_slots.py) */
    const int64_t first = sd->outliers == 2 ? (int64_t)((const int16_t *)(intptr_t)(f[12] * 2))[r]
                                            : ((const int64_t *)(intptr_t)(f[12] * 8))[r];
    if (n < 0 || first < 0) return 1;   /* counts from the data: never a list read before its start */
    const int16_t *idx = (const int16_t *)(intptr_t)(f[13] * 2) + first;
    const half *val = (const half *)(intptr_t)(f[14] * 2) + first;
    for (int i = 0; i < n; i++) {   /* entries hold h' * D + d within the row, ascending (store's order;
                                       a fixed-capacity list ends in entries beyond every row): this head's only */
        const int64_t e = idx[i], eh = e / D;
        if (e < 0) return 1;   /* e / D would round toward 0 and e % D be negative: a write before the row */
        if (eh > h) break;
        if (eh == h) out[e % D] = (float)val[i];
    }
    return 0;
}

/* One stored row (page-relative row t of sequence b, kv head h) of one side -> out[0..D-1] float32, outliers in.
 * Returns 0, or 1 for a negative outlier count, list offset or index (a corrupt list: nothing read or written
 * for it). */
static inline __attribute__((always_inline)) int decode_row(const Side *sd, const float *lut16, const int64_t *f, int64_t B, int64_t D,
                              int64_t b, int64_t h, int64_t t, float *out) {
    const int64_t off = b * f[1] + h * f[2] + t * f[3];
    const int64_t dc = f[4];
    if (sd->fmt == FMT_FP16) {
        const half *p = (const half *)(intptr_t)(f[0] * 2) + off;
        if (dc == 1)
            for (int64_t d = 0; d < D; d++) out[d] = (float)p[d];
        else
            for (int64_t d = 0; d < D; d++) out[d] = (float)p[d * dc];
    } else if (sd->fmt == FMT_FP8) {
        const uint8_t *p = (const uint8_t *)(intptr_t)f[0] + off;
        const float s = sd->scale[h];
        for (int64_t d = 0; d < D; d++) out[d] = sd->lut[p[d * dc]] * s;
    } else {
        const uint8_t *p = (const uint8_t *)(intptr_t)f[0] + off;   /* codes: last stride 1 (checked by the host) */
        float lv[MAX_D];
        levels_row(sd, lut16, p, D, lv);
        if (sd->smode == SC_TOKEN) {
            const int64_t so = b * f[7] + h * f[8] + t * f[9];
            const float s = (float)((const half *)(intptr_t)(f[5] * 2))[so];
            const float z = (float)((const half *)(intptr_t)(f[6] * 2))[so];
            for (int64_t d = 0; d < D; d++) out[d] = lv[d] * s + z;
        } else if (sd->smode == SC_GROUP) {
            const int64_t so = b * f[7] + h * f[8] + (t / sd->group) * f[9];
            const half *s = (const half *)(intptr_t)(f[5] * 2) + so;
            const half *z = (const half *)(intptr_t)(f[6] * 2) + so;
            const int64_t sc = f[10];
            if (sc == 1)
                for (int64_t d = 0; d < D; d++) out[d] = lv[d] * (float)s[d] + (float)z[d];
            else
                for (int64_t d = 0; d < D; d++) out[d] = lv[d] * (float)s[d * sc] + (float)z[d * sc];
        } else { /* SC_STATIC */
            const float *s = sd->scale + h * D, *z = sd->zero + h * D;
            for (int64_t d = 0; d < D; d++) out[d] = lv[d] * s[d] + z[d];
        }
    }
    return sd->outliers ? put_outliers(sd, f, B, D, b, h, t, out) : 0;
}

typedef struct {
    float m[MAX_G], l[MAX_G];
    float *acc;          /* [G, D] */
} State;

/* e^x for x <= 0 (scores minus their running max), vectorizable: x = k ln2 + r with |r| <= ln2 / 2 (ln2 in two
 * parts), e^r by its degree-7 Taylor polynomial (relative error below 2e-8 there), times 2^k from the exponent
 * bits. About 1 ulp of expf. Below x = -64 it returns 0: the weight of such a row is under 2e-28 of the largest
 * (whose weight is 1), far below float32 resolution of the sum, and a product of it with a value would be a
 * subnormal float, which the CPU computes a hundred times slower. */
static inline float exp_neg(float x) {
    const float zero = x < -64.f ? 0.f : 1.f;
    x = x < -64.f ? -64.f : x;
    const float k = nearbyintf(x * 1.44269504088896341f);
    float r = x - k * 0.693145751953125f;
    r = r - k * 1.42860682030941723212e-6f;
    const float p = 1.f + r * (1.f + r * (0.5f + r * (0.166666666666666667f + r * (0.0416666666666666667f +
                    r * (0.00833333333333333333f + r * (0.00138888888888888889f + r * 0.000198412698412698413f))))));
    union { int32_t i; float f; } u = {.i = ((int32_t)k + 127) << 23};
    return p * u.f * zero;
}

/* q . k over D channels: with AVX-512, 16 lanes of fused multiply-adds and one tree reduction (the order differs
 * from the oracle's by float32 rounding only); else 8 partial sums. */
static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t D) {
#ifdef __AVX512F__
    if (D % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float part[8] = {0.f};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        for (int j = 0; j < 8; j++) part[j] += a[d + j] * b[d + j];
    float s = 0.f;
    for (; d < D; d++) s += a[d] * b[d];
    for (int j = 0; j < 8; j++) s += part[j];
    return s;
}

#ifdef __AVX512F__
/* The 16 horizontal sums of v[0..15] as one vector (lane t: the sum of v[t]'s lanes), by a tree of adds: halves of
 * pairs, then quarters, then within 128-bit blocks; lane 4j + k then holds the sum of v[4k + j], put in order by
 * one permutation. Each sum is a different order of the same float32 adds as a lane-by-lane reduction. */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, s);
}
#endif

static inline __attribute__((always_inline)) void tile_values(State *st, float (*s)[TILE], const float *V, int nt,
                                                            int64_t G, int64_t D);

/* One tile of nt keys K [nt, D] and values V [nt, D] into the running state of the G query heads qs [G, D]
 * (already multiplied by the scaling): the tile's scores (each key row read once for the G heads), their max and
 * weights, then each head's accumulator read and written once per tile -- acc * alpha + sum_t p_t V[t], the rows
 * summed in two interleaved chains (with AVX-512, 16 channels at a time in registers). */
static inline __attribute__((always_inline)) void tile_update(State *st, const float *qs, const float *K, const float *V, int nt, int64_t G,
                               int64_t D) {
    float s[MAX_G][TILE];
#ifdef __AVX512F__
    if (D % 16 == 0 && TILE == 16) {   /* 16 rows' dots at once: 16 lane-wise accumulators, one tree of sums */
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qs + g * D;
            __m512 acc[16];
            for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) {
                const __m512 qd = _mm512_loadu_ps(qg + d);
                for (int t = 0; t < nt; t++) acc[t] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(K + t * D + d), acc[t]);
            }
            _mm512_storeu_ps(s[g], hsum16(acc));
        }
    } else
#endif
    for (int t = 0; t < nt; t++) {
        const float *k = K + t * D;
        for (int64_t g = 0; g < G; g++) s[g][t] = dot(qs + g * D, k, D);
    }
    tile_values(st, s, V, nt, G, D);
}

/* The rest of a tile once its scores s [G][nt] are known: each head's max and weights, then its accumulator read
 * and written once -- acc * alpha + sum_t p_t V[t] (tile_update's second half; the fused path's too). */
#ifdef __AVX512F__
/* The value sums of G heads (G a constant: the accumulators in registers) over a tile of nt rows of head_dim 64:
 * per head and 16 channels, acc * alpha + sum_t p_t V[t] in the two interleaved chains of tile_values -- the same
 * operations, in the same order, for each head -- with each value row's 16 channels loaded once for all G heads,
 * where the head-by-head loop loads them G times. Channels in passes of 32 (G <= 4) or 16 (more heads). */
static inline __attribute__((always_inline)) void values64(State *st, float (*p)[TILE], const float *alpha,
                                                         const float *V, int nt, const int G) {
    const int W = G <= 4 ? 2 : 1;   /* 16-channel vectors per pass */
    for (int c0 = 0; c0 < 4; c0 += W) {
        __m512 a0[8][2], a1[8][2];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < W; j++) {
                a0[g][j] = _mm512_mul_ps(_mm512_loadu_ps(st->acc + g * 64 + 16 * (c0 + j)), _mm512_set1_ps(alpha[g]));
                a1[g][j] = _mm512_setzero_ps();
            }
        int t = 0;
        for (; t + 1 < nt; t += 2) {
            __m512 ve[2], vo[2];
            for (int j = 0; j < W; j++) {
                ve[j] = _mm512_loadu_ps(V + t * 64 + 16 * (c0 + j));
                vo[j] = _mm512_loadu_ps(V + (t + 1) * 64 + 16 * (c0 + j));
            }
            for (int g = 0; g < G; g++) {
                const __m512 pe = _mm512_set1_ps(p[g][t]), po = _mm512_set1_ps(p[g][t + 1]);
                for (int j = 0; j < W; j++) {
                    a0[g][j] = _mm512_fmadd_ps(pe, ve[j], a0[g][j]);
                    a1[g][j] = _mm512_fmadd_ps(po, vo[j], a1[g][j]);
                }
            }
        }
        if (t < nt)
            for (int g = 0; g < G; g++)
                for (int j = 0; j < W; j++)
                    a0[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][t]), _mm512_loadu_ps(V + t * 64 + 16 * (c0 + j)),
                                               a0[g][j]);
        for (int g = 0; g < G; g++)
            for (int j = 0; j < W; j++)
                _mm512_storeu_ps(st->acc + g * 64 + 16 * (c0 + j), _mm512_add_ps(a0[g][j], a1[g][j]));
    }
}
#endif

static inline __attribute__((always_inline)) void tile_values(State *st, float (*s)[TILE], const float *V, int nt,
                                                            int64_t G, int64_t D) {
    float alphas[MAX_G];
    for (int64_t g = 0; g < G; g++) {   /* each head's max, weights and sum; the accumulators below */
        float mt = s[g][0];
        for (int t = 1; t < nt; t++) mt = s[g][t] > mt ? s[g][t] : mt;
        const float m_new = st->m[g] > mt ? st->m[g] : mt;
        /* exp_neg(0) is exactly 1 (k = 0, r = 0, p = 1): the common tile, whose max is not a new one, skips it */
        const float alpha = st->m[g] == -INFINITY ? 0.f : st->m[g] == m_new ? 1.f : exp_neg(st->m[g] - m_new);
        float sum = 0.f;
        float *p = s[g];
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < nt; t++) {
            p[t] = exp_neg(p[t] - m_new);
            sum += p[t];
        }
        st->l[g] = st->l[g] * alpha + sum;
        st->m[g] = m_new;
        alphas[g] = alpha;
    }
#ifdef __AVX512F__
    if (D == 64 && G <= 8) {
        switch (G) {
        case 1: values64(st, s, alphas, V, nt, 1); return;
        case 2: values64(st, s, alphas, V, nt, 2); return;
        case 3: values64(st, s, alphas, V, nt, 3); return;
        case 4: values64(st, s, alphas, V, nt, 4); return;
        case 5: values64(st, s, alphas, V, nt, 5); return;
        case 6: values64(st, s, alphas, V, nt, 6); return;
        case 7: values64(st, s, alphas, V, nt, 7); return;
        default: values64(st, s, alphas, V, nt, 8); return;
        }
    }
#endif
    for (int64_t g = 0; g < G; g++) {
        const float alpha = alphas[g];
        const float *p = s[g];
        float *acc = st->acc + g * D;
#ifdef __AVX512F__
        if (D % 16 == 0) {
            const __m512 al = _mm512_set1_ps(alpha);
            for (int64_t d = 0; d < D; d += 16) {
                __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + d), al), a1 = _mm512_setzero_ps();
                int t = 0;
                for (; t + 1 < nt; t += 2) {
                    a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(V + t * D + d), a0);
                    a1 = _mm512_fmadd_ps(_mm512_set1_ps(p[t + 1]), _mm512_loadu_ps(V + (t + 1) * D + d), a1);
                }
                if (t < nt) a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(V + t * D + d), a0);
                _mm512_storeu_ps(acc + d, _mm512_add_ps(a0, a1));
            }
            continue;
        }
#endif
        for (int64_t d = 0; d < D; d++) {
            float a0 = acc[d] * alpha, a1 = 0.f;
            int t = 0;
            for (; t + 1 < nt; t += 2) {
                a0 += p[t] * V[t * D + d];
                a1 += p[t + 1] * V[(t + 1) * D + d];
            }
            if (t < nt) a0 += p[t] * V[t * D + d];
            acc[d] = a0 + a1;
        }
    }
}

static inline __attribute__((always_inline)) void run_rows_d(const Call *c, const Rows *rw, const Item *it,
                                                           const int64_t b, const float *qs, State *st, float *K,
                                                           float *V, const int64_t D) {
    for (int64_t r = it->r0; r < it->r1; r += TILE) {
        const int nt = (int)(it->r1 - r < TILE ? it->r1 - r : TILE);
        for (int t = 0; t < nt; t++) {
            const int64_t row = rw->ring ? (rw->first + r + t) % rw->ring : r + t;
            const half *k = rw->k + b * rw->ks[0] + it->h * rw->ks[1] + row * rw->ks[2];
            const half *v = rw->v + b * rw->vs[0] + it->h * rw->vs[1] + row * rw->vs[2];
            for (int64_t d = 0; d < D; d++) {
                K[t * D + d] = (float)k[d * rw->ks[3]];
                V[t * D + d] = (float)v[d * rw->vs[3]];
            }
        }
        tile_update(st, qs, K, V, nt, c->G, D);
    }
}

static inline __attribute__((always_inline)) int run_page_d(const Call *c, const Item *it, const float *qs,
                                                          State *st, float *K, float *V, const int64_t D) {
    int bad = 0;
    const int64_t half_d = D / 2;
    const int64_t *pg = c->pages + it->kind * N_PAGE;
    const int64_t start = pg[0];
    const int64_t *fk = pg + 2, *fv = pg + 2 + N_SIDE;
    const float *lam = c->lam ? c->lam + it->h * D : NULL;
    const int64_t pB = c->page_b ? 1 : c->B, pb = c->page_b ? 0 : it->b;   /* the page's own rows: page-local */
    for (int64_t r = it->r0; r < it->r1; r += TILE) {
        const int nt = (int)(it->r1 - r < TILE ? it->r1 - r : TILE);
        for (int t = 0; t < nt; t++) {
            float *__restrict k = K + t * D;
            bad |= decode_row(&c->ks, c->klut16, fk, pB, D, pb, it->h, r + t, k);
            if (lam)
                for (int64_t d = 0; d < D; d++) k[d] *= lam[d];
            if (c->rope) {   /* rotate-half at the row's position: x1 cos - x2 sin, x2 cos + x1 sin */
                const float *__restrict cs = c->rope + (start + r + t) * D, *__restrict sn = cs + half_d;
                for (int64_t d = 0; d < half_d; d++) {
                    const float x1 = k[d], x2 = k[d + half_d];
                    k[d] = x1 * cs[d] - x2 * sn[d];
                    k[d + half_d] = x2 * cs[d] + x1 * sn[d];
                }
            }
            bad |= decode_row(&c->vs, c->vlut16, fv, pB, D, pb, it->h, r + t, V + t * D);
        }
        if (bad) return 1;
        tile_update(st, qs, K, V, nt, c->G, D);
    }
    return 0;
}

static int use_fast = 1;
void kvcalib_set_fast(int on) { use_fast = on; }   /* 0: every page through run_page_d (the tests' comparison) */

#ifdef __AVX512F__
/* ---- the fused path of the common page (head_dim 64: SmolLM2's, Llama-3.2-1B's; AVX-512) --------------------
 * The arithmetic of run_page_d, operation for operation, so its output is bit for bit the general path's (the
 * tests compare the two, kvcalib_set_fast(0)), with less work around it:
 * - one work item per run of a page covers every kv head of the sequence (run_column), so each row's outlier
 *   lists are scanned once (put_outliers_heads) where run_page_d scans them per head -- the scan's branches were a
 *   third of the time of a 1%-outlier page;
 * - a key row without outliers goes from its codes to its scores in registers: levels, scale and zero, lambda,
 *   RoPE and the dots with the group's query heads (the same fused multiply-adds in the same order, kept as the
 *   16-lane partials hsum16 sums), where run_page_d stores and reloads the row at each step; value rows, and key
 *   rows with outliers, go to the tiles once.
 * Taken when both sides are nuq or uniform codes of 2 or 4 bits (3 with VBMI) with scales static per channel or
 * per token, at most FAST_MAX_H kv heads of FAST_MAX_G query heads (fast_heads_ok); everything else, and the
 * fp16 sink and recent rows, through run_item. */

static int fast_side_ok(const Side *sd) {
    if (sd->fmt != FMT_NUQ && sd->fmt != FMT_UNIFORM) return 0;
    if (sd->smode != SC_STATIC && sd->smode != SC_TOKEN) return 0;
#ifdef __AVX512VBMI__
    return sd->bits == 2 || sd->bits == 3 || sd->bits == 4;
#else
    return sd->bits == 2 || sd->bits == 4;
#endif
}

static int fast_ok(const Call *c) {
    return use_fast && c->D == 64 && fast_side_ok(&c->ks) && fast_side_ok(&c->vs);
}

/* One packed row of 64 codes -> its levels in 4 vectors: levels_row's instructions, kept in registers. */
static inline __attribute__((always_inline)) void levels64(int bits, int nuq, __m512 book, const uint8_t *p,
                                                         __m512 *lv) {
    __m512i c[4];
    if (bits == 4) {
        const __m128i m = _mm_set1_epi8(15);
        for (int j = 0; j < 2; j++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(p + 16 * j));
            const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
            c[2 * j] = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
            c[2 * j + 1] = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));
        }
    } else if (bits == 2) {
        const __m128i m = _mm_set1_epi8(3);
        for (int j = 0; j < 2; j++) {
            const __m128i b = _mm_loadl_epi64((const __m128i *)(p + 8 * j));
            const __m128i e0 = _mm_and_si128(b, m), e1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
            const __m128i e2 = _mm_and_si128(_mm_srli_epi16(b, 4), m), e3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
            const __m128i a01 = _mm_unpacklo_epi8(e0, e1), a23 = _mm_unpacklo_epi8(e2, e3);
            c[2 * j] = _mm512_cvtepu8_epi32(_mm_unpacklo_epi16(a01, a23));
            c[2 * j + 1] = _mm512_cvtepu8_epi32(_mm_unpackhi_epi16(a01, a23));
        }
    } else {
#ifdef __AVX512VBMI__
        const __m512i pick = _mm512_set_epi32(0x0605, 0x0605, 0x0504, 0x0504, 0x0504, 0x0403, 0x0403, 0x0403,
                                              0x0302, 0x0302, 0x0201, 0x0201, 0x0201, 0x0100, 0x0100, 0x0100);
        const __m512i shift = _mm512_set_epi32(5, 2, 7, 4, 1, 6, 3, 0, 5, 2, 7, 4, 1, 6, 3, 0);
        const __m512i seven = _mm512_set1_epi32(7);
        for (int j = 0; j < 4; j++) {
            const __m512i b = _mm512_maskz_loadu_epi8((__mmask64)0x3F, p + 6 * j);
            c[j] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi8(pick, b), shift), seven);
        }
#else
        for (int j = 0; j < 4; j++) c[j] = _mm512_setzero_si512();   /* not reached: fast_side_ok */
#endif
    }
    for (int j = 0; j < 4; j++) lv[j] = nuq ? _mm512_permutexvar_ps(c[j], book) : _mm512_cvtepi32_ps(c[j]);
}

/* One stored row of one side -> x[4] (decode_row's values: levels * scale + zero, outliers put back). Returns 1
 * for a corrupt outlier list (as decode_row). s, z: the head's static scale and zero vectors (SC_STATIC). */
static inline __attribute__((always_inline)) int row64(const Side *sd, __m512 book, const int64_t *f, int64_t B,
                                                     int64_t b, int64_t h, int64_t t, const __m512 *s,
                                                     const __m512 *z, __m512 *x) {
    const uint8_t *p = (const uint8_t *)(intptr_t)f[0] + b * f[1] + h * f[2] + t * f[3];
    __m512 lv[4];
    levels64(sd->bits, sd->fmt == FMT_NUQ, book, p, lv);
    if (sd->smode == SC_TOKEN) {
        const int64_t so = b * f[7] + h * f[8] + t * f[9];
        const __m512 sv = _mm512_set1_ps((float)((const half *)(intptr_t)(f[5] * 2))[so]);
        const __m512 zv = _mm512_set1_ps((float)((const half *)(intptr_t)(f[6] * 2))[so]);
        for (int j = 0; j < 4; j++) x[j] = _mm512_add_ps(_mm512_mul_ps(lv[j], sv), zv);
    } else {
        for (int j = 0; j < 4; j++) x[j] = _mm512_add_ps(_mm512_mul_ps(lv[j], s[j]), z[j]);
    }
    return 0;
}

#define FAST_MAX_H 8
#define FAST_MAX_G 16

/* The fused path for a whole column of heads (run_column): fast_ok, and at most FAST_MAX_H kv heads of at most
 * FAST_MAX_G query heads each (its tiles live on the worker's stack). */
static int fast_heads_ok(const Call *c) {
    return fast_ok(c) && c->H_kv <= FAST_MAX_H && c->G <= FAST_MAX_G;
}

/* Head h's static scale and zero vectors (SC_STATIC; zeros otherwise, unused). */
static inline __attribute__((always_inline)) void load_static(const Side *sd, int64_t h, __m512 *s, __m512 *z) {
    for (int j = 0; j < 4; j++) {
        s[j] = sd->smode == SC_STATIC ? _mm512_loadu_ps(sd->scale + h * 64 + 16 * j) : _mm512_setzero_ps();
        z[j] = sd->smode == SC_STATIC ? _mm512_loadu_ps(sd->zero + h * 64 + 16 * j) : _mm512_setzero_ps();
    }
}

/* put_outliers for every kv head of a row at once: out is head 0's row, head h's at out + h * TILE * 64. One scan of
 * the row's list where put_outliers scans it once per head: the same entries land (a head's scan takes the
 * entries before the first of a later head; this scan those before the first past the last head -- for a list in
 * store's ascending order, the same), a negative one among them refused. */
static inline __attribute__((always_inline)) int put_outliers_heads(const Side *sd, const int64_t *f, int64_t B,
                                                                  int64_t b, int64_t H, int64_t t, float *out) {
    const int64_t r = t * B + b;
    const int n = ((const int16_t *)(intptr_t)(f[11] * 2))[r];
    const int64_t first = sd->outliers == 2 ? (int64_t)((const int16_t *)(intptr_t)(f[12] * 2))[r]
                                            : ((const int64_t *)(intptr_t)(f[12] * 8))[r];
    if (n < 0 || first < 0) return 1;
    const int16_t *idx = (const int16_t *)(intptr_t)(f[13] * 2) + first;
    const half *val = (const half *)(intptr_t)(f[14] * 2) + first;
    for (int i = 0; i < n; i++) {
        const int e = idx[i];
        if (e < 0) return 1;
        if ((e >> 6) >= H) break;
        out[(e >> 6) * TILE * 64 + (e & 63)] = (float)val[i];
    }
    return 0;
}

/* Key row k[4] (decoded, outliers in) -> lambda, RoPE at position pos, and its dot with each query head kept as
 * the 16-lane partials part[g] (tile_update's fused multiply-adds, in its order). */
static inline __attribute__((always_inline)) void score64(const Call *c, const __m512 *lam, int64_t pos,
                                                        const float *qs, int64_t G, __m512 *k, __m512 *part) {
    if (c->lam)
        for (int j = 0; j < 4; j++) k[j] = _mm512_mul_ps(k[j], lam[j]);
    if (c->rope) {   /* rotate-half: x1 cos - x2 sin, x2 cos + x1 sin (run_page_d's products and sums) */
        const float *cs = c->rope + pos * 64, *sn = cs + 32;
        for (int j = 0; j < 2; j++) {
            const __m512 x1 = k[j], x2 = k[j + 2];
            const __m512 cj = _mm512_loadu_ps(cs + 16 * j), sj = _mm512_loadu_ps(sn + 16 * j);
            k[j] = _mm512_sub_ps(_mm512_mul_ps(x1, cj), _mm512_mul_ps(x2, sj));
            k[j + 2] = _mm512_add_ps(_mm512_mul_ps(x2, cj), _mm512_mul_ps(x1, sj));
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const float *qg = qs + g * 64;
        __m512 a = _mm512_setzero_ps();
        for (int j = 0; j < 4; j++) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), k[j], a);
        part[g * TILE] = a;
    }
}

#endif

/* The head dimensions of the models we serve as compile-time constants (the loops over D unrolled, the running
 * accumulator in registers); any other even D through the same code with D at run time. */
/* b: the rows' sequence index (0 for a sequence's own Rows, it->b for b-strided ones) */
static void run_rows(const Call *c, const Rows *rw, const Item *it, int64_t b, const float *qs, State *st, float *K,
                     float *V) {
    switch (c->D) {
    case 64: run_rows_d(c, rw, it, b, qs, st, K, V, 64); break;
    case 128: run_rows_d(c, rw, it, b, qs, st, K, V, 128); break;
    case 256: run_rows_d(c, rw, it, b, qs, st, K, V, 256); break;
    default: run_rows_d(c, rw, it, b, qs, st, K, V, c->D);
    }
}

static int run_page(const Call *c, const Item *it, const float *qs, State *st, float *K, float *V) {
    switch (c->D) {
    case 64: return run_page_d(c, it, qs, st, K, V, 64);
    case 128: return run_page_d(c, it, qs, st, K, V, 128);
    case 256: return run_page_d(c, it, qs, st, K, V, 256);
    default: return run_page_d(c, it, qs, st, K, V, c->D);
    }
}

/* One work item into its partials part[i] = (max [G], sum [G], accumulator [G, D]). Returns 1 for a corrupt
 * outlier list. */
static int run_item(const Call *c, const Item *items, int64_t i, float *part) {
    const int64_t H = c->H_kv, G = c->G, D = c->D;
    const Item *it = &items[i];
    float qs[MAX_G * MAX_D];
    float K[TILE * MAX_D], V[TILE * MAX_D];
    float *pm = part + i * G * (D + 2), *pl = pm + G, *pacc = pl + G;
    State st;
    int bad = 0;
    st.acc = pacc;
    for (int64_t g = 0; g < G; g++) {
        st.m[g] = -INFINITY;
        st.l[g] = 0.f;
        const float *qg = c->q + ((it->b * H + it->h) * G + g) * D;
        for (int64_t d = 0; d < D; d++) qs[g * D + d] = qg[d] * c->scaling;
    }
    memset(pacc, 0, sizeof(float) * (size_t)(G * D));
    if (it->kind == -1)
        run_rows(c, c->sinks ? &c->sinks[it->b] : &c->sink, it, c->sinks ? 0 : it->b, qs, &st, K, V);
    else if (it->kind == -2)
        run_rows(c, c->recents ? &c->recents[it->b] : &c->recent, it, c->recents ? 0 : it->b, qs, &st, K, V);
    else if (it->kind >= 0)
        bad = run_page(c, it, qs, &st, K, V);
    for (int64_t g = 0; g < G; g++) { pm[g] = st.m[g]; pl[g] = st.l[g]; }
    return bad;
}

#ifdef __AVX512F__
/* The k-th items of one sequence's H (b, h) groups -- the same run of one page, one per kv head -- through the
 * fused path together: per tile, each row's codes decoded head by head, its outlier lists scanned once for all
 * heads (put_outliers_heads), then each head's scores and values (bit for bit run_page_d's: the same operations per
 * head). firsts: the H groups' first items. */
static int run_column(const Call *c, const Item *items, const int64_t *firsts, int64_t k, float *part) {
    const int64_t H = c->H_kv, G = c->G;
    const Item *it0 = &items[firsts[0] + k];
    const int64_t *pg = c->pages + it0->kind * N_PAGE;
    const int64_t start = pg[0];
    const int64_t *fk = pg + 2, *fv = pg + 2 + N_SIDE;
    const int64_t pB = c->page_b ? 1 : c->B, pb = c->page_b ? 0 : it0->b;
    const __m512 kbook = _mm512_loadu_ps(c->klut16), vbook = _mm512_loadu_ps(c->vlut16);
    float qs[FAST_MAX_H * FAST_MAX_G * 64];
    float K[FAST_MAX_H * TILE * 64], V[FAST_MAX_H * TILE * 64];
    __m512 part16[FAST_MAX_G * TILE];
    float s[MAX_G][TILE];
    State st[FAST_MAX_H];
    for (int64_t h = 0; h < H; h++) {
        float *pm = part + (firsts[h] + k) * G * (64 + 2);
        st[h].acc = pm + 2 * G;
        for (int64_t g = 0; g < G; g++) {
            st[h].m[g] = -INFINITY;
            st[h].l[g] = 0.f;
            const float *qg = c->q + ((it0->b * H + h) * G + g) * 64;
            for (int64_t d = 0; d < 64; d++) qs[(h * G + g) * 64 + d] = qg[d] * c->scaling;
        }
        memset(st[h].acc, 0, sizeof(float) * (size_t)(G * 64));
    }
    for (int64_t r = it0->r0; r < it0->r1; r += TILE) {
        const int nt = (int)(it0->r1 - r < TILE ? it0->r1 - r : TILE);
        if (c->ks.outliers)   /* every head's key rows into K, then each row's outliers once */
            for (int t = 0; t < nt; t++) {
                for (int64_t h = 0; h < H; h++) {
                    __m512 kk[4], zz[4], x[4];
                    load_static(&c->ks, h, kk, zz);
                    row64(&c->ks, kbook, fk, pB, pb, h, r + t, kk, zz, x);
                    for (int j = 0; j < 4; j++) _mm512_storeu_ps(K + (h * TILE + t) * 64 + 16 * j, x[j]);
                }
                if (put_outliers_heads(&c->ks, fk, pB, pb, H, r + t, K + t * 64)) return 1;
            }
        for (int t = 0; t < nt; t++) {   /* every head's value rows into V, then each row's outliers once */
            for (int64_t h = 0; h < H; h++) {
                __m512 vv[4], zz[4], x[4];
                load_static(&c->vs, h, vv, zz);
                row64(&c->vs, vbook, fv, pB, pb, h, r + t, vv, zz, x);
                for (int j = 0; j < 4; j++) _mm512_storeu_ps(V + (h * TILE + t) * 64 + 16 * j, x[j]);
            }
            if (c->vs.outliers && put_outliers_heads(&c->vs, fv, pB, pb, H, r + t, V + t * 64)) return 1;
        }
        for (int64_t h = 0; h < H; h++) {
            __m512 lam[4], kk[4], zz[4];
            for (int j = 0; j < 4; j++) lam[j] = c->lam ? _mm512_loadu_ps(c->lam + h * 64 + 16 * j) : _mm512_set1_ps(1.f);
            load_static(&c->ks, h, kk, zz);
            for (int t = 0; t < nt; t++) {
                __m512 x[4];
                if (c->ks.outliers)
                    for (int j = 0; j < 4; j++) x[j] = _mm512_loadu_ps(K + (h * TILE + t) * 64 + 16 * j);
                else
                    row64(&c->ks, kbook, fk, pB, pb, h, r + t, kk, zz, x);
                score64(c, lam, start + r + t, qs + h * G * 64, G, x, part16 + t);
            }
            for (int64_t g = 0; g < G; g++) {
                for (int t = nt; t < TILE; t++) part16[g * TILE + t] = _mm512_setzero_ps();
                _mm512_storeu_ps(s[g], hsum16(part16 + g * TILE));
            }
            tile_values(&st[h], s, V + h * TILE * 64, nt, G, 64);
        }
    }
    for (int64_t h = 0; h < H; h++) {
        float *pm = part + (firsts[h] + k) * G * (64 + 2), *pl = pm + G;
        for (int64_t g = 0; g < G; g++) { pm[g] = st[h].m[g]; pl[g] = st[h].l[g]; }
    }
    return 0;
}
#endif

/* The attention of every sequence's new token over the layer's cache -> out [B, H_kv * G, D], or with c->split_v
 * out [2, B, H_kv * G, D]: the sink and residual rows' part of the value sum, then the pages' part (each divided by
 * the whole softmax's sum; their sum is the attention output when the pages' values need no un-rotation).
 * chunk: rows per work item (a page's rows are cut into runs of at most chunk). Returns 0, or a negative code:
 * -1 shapes out of range (D, G, H, B, chunk, rows), -2 out of memory, -4 a page's positions past the RoPE table,
 * -5 a negative stored outlier count, list offset or index. */
static int decode_call(Call *c, int64_t chunk, int n_threads, float *out);

int kvcalib_decode(Call *c, int64_t chunk, int n_threads, float *out) {
    if (c->D > MAX_D || c->D < 2 || c->D % 2 || c->G > MAX_G || c->G < 1 || c->H_kv < 1 || c->B < 0 || chunk < 1
        || c->sink.n < 0 || c->recent.n < 0 || c->n_pages < 0)
        return -1;
    for (int64_t b = 0; b < (c->sinks || c->recents ? c->B : 1); b++)
        for (int w = 0; w < 2; w++) {   /* a ring: its start within it, at most its rows */
            const Rows *rw = w ? (c->recents ? &c->recents[b] : &c->recent) : (c->sinks ? &c->sinks[b] : &c->sink);
            if (rw->ring < 0 || rw->first < 0 || (rw->ring > 0 && (rw->first >= rw->ring || rw->n > rw->ring)))
                return -1;
        }
    const int64_t *given = c->pages;
    int64_t *own = NULL;   /* the table made absolute for this call (byte_f / half_f); the caller's left as given */
    if (c->byte_f && c->n_pages > 0) {
        own = (int64_t *)malloc(sizeof(int64_t) * (size_t)(c->n_pages * N_PAGE));
        if (!own) return -2;
        for (int64_t i = 0; i < c->n_pages; i++)
            for (int j = 0; j < N_PAGE; j++)
                own[i * N_PAGE + j] = given[i * N_PAGE + j] + c->byte_f[j] * c->base + c->half_f[j] * (c->base / 2);
        c->pages = own;
    }
    const int rc = decode_call(c, chunk, n_threads, out);
    c->pages = given;
    free(own);
    return rc;
}

static int decode_call(Call *c, int64_t chunk, int n_threads, float *out) {
    for (int64_t i = 0; i < c->n_pages; i++) {   /* positions come from the table: every one within the RoPE's */
        const int64_t start = c->pages[i * N_PAGE], rows = c->pages[i * N_PAGE + 1];
        if (rows < 0) return -1;
        if (c->rope && (start < 0 || start + rows > c->rope_n)) return -4;
    }
    for (int i = 0; i < 16; i++) {
        c->klut16[i] = c->ks.fmt == FMT_NUQ && c->ks.bits <= 4 && i < (1 << c->ks.bits) ? c->ks.lut[i] : 0.f;
        c->vlut16[i] = c->vs.fmt == FMT_NUQ && c->vs.bits <= 4 && i < (1 << c->vs.bits) ? c->vs.lut[i] : 0.f;
    }
    const int64_t B = c->B, H = c->H_kv, G = c->G, D = c->D;
    if (c->page_b)
        for (int64_t i = 0; i < c->n_pages; i++)
            if (c->page_b[i] < 0 || c->page_b[i] >= B) return -1;
    /* work items, grouped by (sequence, kv head) so that the merge reads each group's partials in a run: the group
     * of (b, h) is items [first[b * H + h], first[b * H + h + 1]) (at least one: an empty item when nothing is held) */
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B * H + 1));
    if (!first) return -2;
    int64_t n_items = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t per = 0;
        if ((c->sinks ? c->sinks[b].n : c->sink.n) > 0) per++;
        if ((c->recents ? c->recents[b].n : c->recent.n) > 0) per++;
        for (int64_t i = 0; i < c->n_pages; i++)
            if (!c->page_b || c->page_b[i] == b) per += (c->pages[i * N_PAGE + 1] + chunk - 1) / chunk;
        if (per == 0) per = 1;
        for (int64_t h = 0; h < H; h++) { first[b * H + h] = n_items; n_items += per; }
    }
    first[B * H] = n_items;
    Item *items = (Item *)malloc(sizeof(Item) * (size_t)(n_items ? n_items : 1));
    float *part = (float *)malloc(sizeof(float) * (size_t)((n_items ? n_items : 1) * G * (D + 2)));
    if (!items || !part) { free(items); free(part); free(first); return -2; }
    int64_t k = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t ns = c->sinks ? c->sinks[b].n : c->sink.n, nr = c->recents ? c->recents[b].n : c->recent.n;
            if (ns > 0) items[k++] = (Item){b, h, -1, 0, ns};
            for (int64_t i = 0; i < c->n_pages; i++) {
                if (c->page_b && c->page_b[i] != b) continue;
                const int64_t n = c->pages[i * N_PAGE + 1];
                for (int64_t a = 0; a < n; a += chunk) items[k++] = (Item){b, h, i, a, a + chunk < n ? a + chunk : n};
            }
            if (nr > 0) items[k++] = (Item){b, h, -2, 0, nr};
            while (k < first[b * H + h + 1]) items[k++] = (Item){b, h, -3, 0, 0};   /* nothing held: an empty item */
        }
    int corrupt = 0;
#ifdef __AVX512F__
    if (fast_heads_ok(c)) {
        /* the fused path: one work item per run of a page for every kv head of its sequence (the k-th item of each
         * (b, h) group covers the same rows), so that a row's outlier lists are scanned once, not per head */
        int64_t n_cols = 0;
        for (int64_t b = 0; b < B; b++) n_cols += first[b * H + 1] - first[b * H];
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
        for (int64_t ci = 0; ci < n_cols; ci++) {
            int64_t b = 0, k = ci;
            while (k >= first[b * H + 1] - first[b * H]) { k -= first[b * H + 1] - first[b * H]; b++; }
            if (items[first[b * H] + k].kind >= 0) {
                if (run_column(c, items, first + b * H, k, part)) {
#pragma omp atomic write
                    corrupt = 1;
                }
            } else {
                for (int64_t h = 0; h < H; h++) run_item(c, items, first[b * H + h] + k, part);
            }
        }
    } else
#endif
    {
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
        for (int64_t i = 0; i < n_items; i++)
            if (run_item(c, items, i, part)) {
#pragma omp atomic write
                corrupt = 1;
            }
    }
    if (corrupt) { free(items); free(part); free(first); return -5; }
    /* merge each (sequence, kv head)'s items: out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i */
#pragma omp parallel for num_threads(n_threads)
    for (int64_t bh = 0; bh < B * H; bh++) {
        for (int64_t g = 0; g < G; g++) {
            float M = -INFINITY;
            for (int64_t j = first[bh]; j < first[bh + 1]; j++) {
                const float m = part[j * G * (D + 2) + g];
                M = m > M ? m : M;
            }
            float *o = out + (bh * G + g) * D;
            float *o_enc = c->split_v ? o + B * H * G * D : o;   /* where the pages' items add */
            for (int64_t d = 0; d < D; d++) o[d] = o_enc[d] = 0.f;
            float L = 0.f;
            for (int64_t j = first[bh]; j < first[bh + 1]; j++) {
                const float *pm = part + j * G * (D + 2);
                if (pm[g] == -INFINITY) continue;
                const float w = expf(pm[g] - M);
                L += w * pm[G + g];
                const float *acc = pm + 2 * G + g * D;
                float *dst = items[j].kind >= 0 ? o_enc : o;
                for (int64_t d = 0; d < D; d++) dst[d] += w * acc[d];
            }
            for (int64_t d = 0; d < D; d++) o[d] /= L;
            if (c->split_v)
                for (int64_t d = 0; d < D; d++) o_enc[d] /= L;
        }
    }
    free(items);
    free(part);
    free(first);
    return 0;
}


/* ---- encoding new rows: exporters.codec.encode + exporters.layout.store, byte for byte ----------------------
 *
 * For uniform and nuq rows (the formats whose encode is more than a cast): optional inverse RoPE at the rows'
 * positions (x cos + rotate_half(x) (-sin), each product and the sum rounded apart, as torch computes it: this file
 * is compiled with -ffp-contract=off) and division by lambda, then the sparse outliers split off (static
 * per-channel bounds, or per-(sequence, token) bounds given by the caller -- codec.token_outlier_bounds, torch's
 * quantile), the codes (nuq: nearest codebook level of the clamped (x - zero) / range, a tie to the lower level;
 * uniform: round half to even of (x - min) / scale) with fp16 per-token or per-group scales, packed little-endian;
 * outliers in store's order (token row t * B + b, then h * D + d). Returns the number of outliers written, or -1
 * when they exceed the capacity given. */
typedef struct {
    const void *x; int32_t x_half; int64_t xs[4];   /* rows [B, H, n, D]: fp16 (x_half) or float32, element strides */
    int64_t B, H, n, D, start;
    const float *rope; const float *lam;           /* [N, 2, D / 2] (inverse RoPE at start..), [H, D]; or NULL */
    int32_t fmt, bits, token_axis, group;          /* token_axis: per-token scales; else channel (group > 0:
                                                      uniform per-channel groups of `group` rows; 0: nuq static) */
    const float *mids;                             /* nuq: the L - 1 midpoints between sorted levels */
    const float *zero, *range;                     /* nuq channel: [H, D] */
    int32_t outliers;                              /* 0: none, 1: static bounds [H, D], 2: per (b, t) bounds [B, n]
                                                      given, 3: per (b, t) bounds computed here (quantiles q_lo,
                                                      q_hi of the token's H * D entries, as torch.quantile) */
    float q_lo, q_hi;
    const float *lower, *upper;
    uint8_t *codes;                                /* [B, H, n, n_bytes] */
    half *scale, *zero_out;                        /* token: [B, H, n]; group: [B, H, n / group, D] */
    int16_t *out_count; int16_t *out_index; half *out_value; int64_t out_cap;
    int32_t n_threads;                             /* OpenMP threads for a large batch of rows (prefill) */
} Enc;

static inline float to_half_float(float v) { return (float)(half)v; }

/* torch.bucketize(x, mids) (right=False): the number of midpoints strictly below each x, i.e. the nearest level
 * with a tie to the lower one. */
static inline void bucketize(const float *x, const float *mids, int64_t n_mids, int64_t D, uint8_t *c) {
    int32_t k[MAX_D];
    for (int64_t d = 0; d < D; d++) k[d] = 0;
    for (int64_t j = 0; j < n_mids; j++) {
        const float m = mids[j];
        for (int64_t d = 0; d < D; d++) k[d] += m < x[d];
    }
    for (int64_t d = 0; d < D; d++) c[d] = (uint8_t)k[d];
}

static void pack(const uint8_t *c, int bits, int64_t D, uint8_t *p) {
    const int64_t n_bytes = (D * bits + 7) / 8;
    memset(p, 0, (size_t)n_bytes);
    for (int64_t j = 0; j < D; j++) {
        const int64_t bit = j * bits, i = bit >> 3;
        const int w = c[j] << (bit & 7);
        p[i] |= (uint8_t)(w & 255);
        if ((w >> 8) && i + 1 < n_bytes) p[i + 1] |= (uint8_t)(w >> 8);
    }
}


/* The k-th smallest of a[0..n-1] (0-based; a is reordered: smaller ones before k, larger after), by Hoare's
 * selection with a median-of-three pivot. */
static float select_kth(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (hi > lo) {
        const int64_t mid = lo + (hi - lo) / 2;
        float x = a[lo], y = a[mid], z = a[hi];
        const float pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i <= j) { const float t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else return a[k];
    }
    return a[k];
}

/* torch.quantile(row, q) with linear interpolation, for float32 q: rank = q (n - 1) in float32, the values of
 * sorted order at floor and ceil of it, lerp(below, above, rank - floor) in ATen's form (weight < 0.5: below +
 * weight (above - below), else above - (above - below)(1 - weight)). a: the row (reordered). */
static float quantile(float *a, int64_t n, float q) {
    const float rank = q * (float)(n - 1);
    const int64_t below = (int64_t)rank, above = (int64_t)ceilf(rank);
    const float lo = select_kth(a, n, below);
    float hi = lo;
    if (above != below) {   /* the next smallest: the least of what selection left after `below` */
        hi = a[below + 1];
        for (int64_t i = below + 2; i < n; i++) hi = a[i] < hi ? a[i] : hi;
    }
    const float w = rank - (float)below, diff = hi - lo;
    return fabsf(w) < 0.5f ? lo + w * diff : hi - diff * (1.f - w);
}

/* -> the outliers written; -1 beyond out_cap, -2 out of memory, -3 non-finite rows, -4 shapes out of range (D
 * beyond MAX_D or odd with RoPE, bits outside 1..8, rows not whole groups, an unknown outlier mode, H * D beyond
 * MAX_ROW_ENTRIES with outliers: their int16 indices and counts would wrap). */
int64_t kvcalib_encode(const Enc *e) {
    if (e->D < 1 || e->D > MAX_D || (e->rope && e->D % 2) || e->bits < 1 || e->bits > 8 || e->B < 1 || e->H < 1
        || e->n < 1 || e->group < 0 || (e->group > 0 && e->n % e->group) || e->outliers < 0 || e->outliers > 3
        || (e->outliers && e->H * e->D > MAX_ROW_ENTRIES) || e->out_cap < 0)
        return -4;
    const int64_t B = e->B, H = e->H, n = e->n, D = e->D, hd = D / 2;
    const int64_t n_bytes = (D * e->bits + 7) / 8, levels = (1 << e->bits) - 1;
    const int64_t nm = (int64_t)1 << e->bits;
    float *x = (float *)malloc(sizeof(float) * (size_t)(B * H * n * D));     /* prepared rows, [B, H, n, D] */
    float *in = (float *)malloc(sizeof(float) * (size_t)(B * H * n * D));    /* inliers (clamped) */
    uint8_t *out = (uint8_t *)malloc((size_t)(B * H * n * D));               /* is an outlier */
    if (!x || !in || !out) { free(x); free(in); free(out); return -2; }
    const int par = B * H * n * D >= (1 << 15);   /* threads only where the rows pay for them (a prefill chunk) */
#pragma omp parallel for collapse(3) if (par) num_threads(e->n_threads)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < n; t++) {
                float *r = x + ((b * H + h) * n + t) * D;
                const int64_t o = b * e->xs[0] + h * e->xs[1] + t * e->xs[2];
                if (e->x_half)
                    for (int64_t d = 0; d < D; d++) r[d] = (float)((const half *)e->x)[o + d * e->xs[3]];
                else
                    for (int64_t d = 0; d < D; d++) r[d] = ((const float *)e->x)[o + d * e->xs[3]];
                if (e->rope) {
                    const float *cs = e->rope + (e->start + t) * D, *sn = cs + hd;
                    float tmp[MAX_D];
                    for (int64_t d = 0; d < hd; d++) {
                        const float x1 = r[d], x2 = r[d + hd];
                        const float a = x1 * cs[d], bb = x2 * sn[d];   /* (-x2) (-sin) */
                        tmp[d] = a + bb;
                        const float c2 = x2 * cs[d], d2 = x1 * -sn[d];
                        tmp[d + hd] = c2 + d2;
                    }
                    memcpy(r, tmp, sizeof(float) * (size_t)D);
                }
                if (e->lam)
                    for (int64_t d = 0; d < D; d++) r[d] = r[d] / e->lam[h * D + d];
            }
    for (int64_t i = 0; i < B * H * n * D; i++)
        if (!isfinite(x[i])) { free(x); free(in); free(out); return -3; }
    float *tlo = NULL, *thi = NULL;
    if (e->outliers == 3) {   /* per (sequence, token) quantiles over its H * D entries */
        tlo = (float *)malloc(sizeof(float) * (size_t)(2 * B * n));
        float *row = (float *)malloc(sizeof(float) * (size_t)(H * D));
        if (!tlo || !row) { free(tlo); free(row); free(x); free(in); free(out); return -2; }
        thi = tlo + B * n;
        free(row);
#pragma omp parallel if (par) num_threads(e->n_threads)
        {
            float *own = (float *)malloc(sizeof(float) * (size_t)(H * D));
#pragma omp for collapse(2)
            for (int64_t b = 0; b < B; b++)
                for (int64_t t = 0; t < n; t++) {
                    for (int64_t h = 0; h < H; h++)
                        memcpy(own + h * D, x + ((b * H + h) * n + t) * D, sizeof(float) * (size_t)D);
                    tlo[b * n + t] = quantile(own, H * D, e->q_lo);
                    thi[b * n + t] = quantile(own, H * D, e->q_hi);
                }
            free(own);
        }
    }
    /* outliers: static per-channel bounds, or per (sequence, token) over every head */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < n; t++)
                for (int64_t d = 0; d < D; d++) {
                    const int64_t i = ((b * H + h) * n + t) * D + d;
                    float v = x[i], lo, hi;
                    int is_out = 0;
                    if (e->outliers == 1) { lo = e->lower[h * D + d]; hi = e->upper[h * D + d]; }
                    else if (e->outliers == 2) { lo = e->lower[b * n + t]; hi = e->upper[b * n + t]; }
                    else if (e->outliers == 3) { lo = tlo[b * n + t]; hi = thi[b * n + t]; }
                    if (e->outliers) {
                        is_out = v < lo || v > hi;
                        v = v > lo ? v : lo;          /* torch.minimum(torch.maximum(x, lo), hi) */
                        v = v < hi ? v : hi;
                    }
                    in[i] = v;
                    out[i] = (uint8_t)is_out;
                }
    free(tlo);
    if (e->token_axis) {
#pragma omp parallel for collapse(3) if (par) num_threads(e->n_threads)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t t = 0; t < n; t++) {
                    uint8_t c[MAX_D];
                    float lv[MAX_D];
                    const float *r = in + ((b * H + h) * n + t) * D;
                    float mn = r[0], mx = r[0];
                    for (int64_t d = 1; d < D; d++) { mn = r[d] < mn ? r[d] : mn; mx = r[d] > mx ? r[d] : mx; }
                    float sc, z;
                    if (e->fmt == FMT_NUQ) {
                        z = to_half_float((mx + mn) / 2);
                        sc = to_half_float((mx - mn) / 2);
                        for (int64_t d = 0; d < D; d++) {
                            float xn = sc > 0 ? (r[d] - z) / sc : 0.f;
                            lv[d] = xn < -1.f ? -1.f : (xn > 1.f ? 1.f : xn);
                        }
                        bucketize(lv, e->mids, nm - 1, D, c);
                    } else {
                        sc = to_half_float((mx - mn) / (float)levels);
                        z = to_half_float(mn);
                        for (int64_t d = 0; d < D; d++) {
                            float q = sc > 0 ? nearbyintf((r[d] - z) / sc) : 0.f;
                            q = q < 0.f ? 0.f : (q > (float)levels ? (float)levels : q);
                            c[d] = (uint8_t)q;
                        }
                    }
                    e->scale[(b * H + h) * n + t] = (half)sc;
                    e->zero_out[(b * H + h) * n + t] = (half)z;
                    pack(c, e->bits, D, e->codes + ((b * H + h) * n + t) * n_bytes);
                }
    } else if (e->group > 0) {   /* uniform per-channel groups of `group` rows: n a multiple of it */
        const int64_t g = e->group, ng = n / g;
#pragma omp parallel for collapse(3) if (par) num_threads(e->n_threads)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t k = 0; k < ng; k++) {
                    uint8_t c[MAX_D];
                    half *so = e->scale + ((b * H + h) * ng + k) * D, *zo = e->zero_out + ((b * H + h) * ng + k) * D;
                    for (int64_t d = 0; d < D; d++) {
                        float mn = in[((b * H + h) * n + k * g) * D + d], mx = mn;
                        for (int64_t t = 1; t < g; t++) {
                            const float v = in[((b * H + h) * n + k * g + t) * D + d];
                            mn = v < mn ? v : mn;
                            mx = v > mx ? v : mx;
                        }
                        so[d] = (half)((mx - mn) / (float)levels);
                        zo[d] = (half)mn;
                    }
                    for (int64_t t = 0; t < g; t++) {
                        const float *r = in + ((b * H + h) * n + k * g + t) * D;
                        for (int64_t d = 0; d < D; d++) {
                            const float sc = (float)so[d], z = (float)zo[d];
                            float q = sc > 0 ? nearbyintf((r[d] - z) / sc) : 0.f;
                            q = q < 0.f ? 0.f : (q > (float)levels ? (float)levels : q);
                            c[d] = (uint8_t)q;
                        }
                        pack(c, e->bits, D, e->codes + ((b * H + h) * n + k * g + t) * n_bytes);
                    }
                }
    } else {   /* nuq, static per-channel zero / range */
#pragma omp parallel for collapse(3) if (par) num_threads(e->n_threads)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t t = 0; t < n; t++) {
                    uint8_t c[MAX_D];
                    float lv[MAX_D];
                    const float *r = in + ((b * H + h) * n + t) * D;
                    const float *z = e->zero + h * D, *rg = e->range + h * D;
                    for (int64_t d = 0; d < D; d++) {
                        float xn = rg[d] > 0 ? (r[d] - z[d]) / rg[d] : 0.f;
                        lv[d] = xn < -1.f ? -1.f : (xn > 1.f ? 1.f : xn);
                    }
                    bucketize(lv, e->mids, nm - 1, D, c);
                    pack(c, e->bits, D, e->codes + ((b * H + h) * n + t) * n_bytes);
                }
    }
    int64_t m = 0;
    if (e->outliers) {   /* store's order: token row t * B + b, then h * D + d within it */
        for (int64_t t = 0; t < n; t++)
            for (int64_t b = 0; b < B; b++) {
                int64_t cnt = 0;
                for (int64_t h = 0; h < H; h++)
                    for (int64_t d = 0; d < D; d++) {
                        const int64_t i = ((b * H + h) * n + t) * D + d;
                        if (!out[i]) continue;
                        if (m >= e->out_cap) { free(x); free(in); free(out); return -1; }
                        e->out_index[m] = (int16_t)(h * D + d);
                        e->out_value[m] = (half)x[i];
                        m++;
                        cnt++;
                    }
                e->out_count[t * B + b] = (int16_t)cnt;
            }
    }
    free(x); free(in); free(out);
    return m;
}
