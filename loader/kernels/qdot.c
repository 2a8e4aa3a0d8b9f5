/* moeprep's expert kernels: a quantized matrix [N, K] times a few tokens [T, K], read from the bits as the codec
 * stores them (loader/codec.py), never decoded into a float copy.
 *
 * The activations are rounded to int8 per block (one float scale per block of 32 weights, 16 for 2-bit codes), so
 * the inner loops are integer dot products of codes and int8 activations; per group the float scale and zero of
 * the codec apply:
 *     y[t, n] = sum_j s[n, j] * (sum_{b in j} d[t, b] * sum_{k in b} q[t, k] * c[n, k]  -  z[n, j] * X[t, j])
 * with X[t, j] = sum_{b in j} d[t, b] * sum_{k in b} q[t, k]: exactly W @ x^ with x^ the rounded activations.
 * MXFP4 has no zero: its E2M1 codes are small signed integers (twice the value) and its E8M0 scale a power of two.
 *
 * Two paths with the same arithmetic: a portable one (any shape, any C compiler) and an AVX2 one chosen at run time
 * where the CPU has AVX2, FMA and F16C and the shape suits it. Rows are split over threads.
 * Built by loader/kernels/__init__.py with the system's C compiler; the loader falls back to its torch forms when
 * no compiler is found.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QDOT_X86 1
#else
#define QDOT_X86 0
#endif

#define KIND_MXFP4 1
#define MAX_THREADS 64
#define AHEAD 4096  /* bytes of codes prefetched ahead of the row computing */

typedef struct {
    int32_t kind;   /* bits per code: 2, 3, 4 or 8; KIND_MXFP4 (1) for MXFP4 */
    int32_t n, k;   /* rows (outputs), columns (inputs) */
    int32_t group;  /* weights per scale (32 for MXFP4) */
    int32_t meta;   /* 0: float16 scale and zero per group; > 0: uint8 per group, float16 (step, offset) per meta */
    const uint8_t *codes;
    const void *scale, *zero;             /* MXFP4: scale = E8M0 bytes, zero unused */
    const uint16_t *scale_meta, *zero_meta;
} qmat;

typedef struct {   /* the rounded activations of T tokens, laid out for one matrix kind */
    int32_t t, k, block, groups, xstride;
    int8_t *q;     /* [T, K], permuted within each chunk as the kind's unpacking orders codes */
    int16_t *q16;  /* [T, K] natural order, for 3- and 8-bit codes */
    float *d;      /* [T, K / block] */
    float *x;      /* [T, xstride]: X above, each token's groups padded with zeros to a multiple of 8 */
} acts;

/* ------------------------------------------------------------------------------------ shared arithmetic */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal */
            float f = ldexpf((float)man, -24);
            return sign ? -f : f;
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float E8M0_HALF[256];  /* 2 ** (e - 128): an E8M0 scale, halved */

__attribute__((constructor)) static void fill_tables(void) {
    for (int e = 0; e < 256; e++) E8M0_HALF[e] = ldexpf(1.0f, e - 128);
}

static const int8_t FP4_TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* activation block (weights per int8 scale): 64 where the groups allow, else 32; 16 for 2-bit codes and groups
 * of 16 */
static int block_of(const qmat *m) {
    if (m->kind == 2 || m->group % 32) return 16;
    return m->group % 64 ? 32 : 64;
}

/* the activations are laid out in chunks of this many weights, permuted as the kind's unpacking orders codes */
static int chunk_len(const qmat *m) {
    if (m->kind == 2) return 128;
    return m->kind == 4 && block_of(m) == 64 ? 64 : 32;
}

static int permuted(const qmat *m, int i) {
    int len = chunk_len(m);
    if (m->kind == 4 || m->kind == KIND_MXFP4) return i % 2 ? len / 2 + i / 2 : i / 2;  /* low nibbles, then high */
    if (m->kind == 2) return (i % 4) * 32 + i / 4;  /* every byte's shift-0 codes, then shift 2, ... */
    return i;
}

/* one matrix row's scale and zero per group, as floats */
static void row_params(const qmat *m, int row, float *s, float *z) {
    int groups = m->k / m->group;
    long base = (long)row * groups;
    for (int j = 0; j < groups; j++) {
        long g = base + j;
        if (m->kind == KIND_MXFP4) {
            s[j] = E8M0_HALF[((const uint8_t *)m->scale)[g]];  /* the codes hold twice the value */
            z[j] = 0.0f;
        } else if (!m->meta) {
            s[j] = half_to_float(((const uint16_t *)m->scale)[g]);
            z[j] = half_to_float(((const uint16_t *)m->zero)[g]);
        } else {
            long meta = g / m->meta;
            s[j] = ((const uint8_t *)m->scale)[g] * half_to_float(m->scale_meta[2 * meta])
                   + half_to_float(m->scale_meta[2 * meta + 1]);
            z[j] = ((const uint8_t *)m->zero)[g] * half_to_float(m->zero_meta[2 * meta])
                   + half_to_float(m->zero_meta[2 * meta + 1]);
        }
    }
}

static int code_at(const qmat *m, const uint8_t *row, int i) {
    switch (m->kind) {
        case 8: return row[i];
        case 4: case KIND_MXFP4: return (row[i / 2] >> (4 * (i % 2))) & 15;
        case 2: return (row[i / 4] >> (2 * (i % 4))) & 3;
        default: {  /* 3 bits: 8 codes per 3 bytes, little-endian */
            const uint8_t *t = row + 3 * (i / 8);
            uint32_t word = t[0] | (t[1] << 8) | ((uint32_t)t[2] << 16);
            return (word >> (3 * (i % 8))) & 7;
        }
    }
}

static long row_bytes(const qmat *m) { return m->kind == KIND_MXFP4 ? m->k / 2 : (long)m->k * m->kind / 8; }

/* ------------------------------------------------------------------------------------ activations */

static void round_acts(const qmat *m, const float *x, int t, acts *a) {
    int k = m->k, block = block_of(m), len = chunk_len(m);
    int groups = m->k / m->group;
    a->t = t; a->k = k; a->block = block; a->groups = groups; a->xstride = (groups + 7) / 8 * 8;
    int perm[128];  /* chunk position of each weight of a chunk (len <= 128) */
    for (int i = 0; i < len; i++) perm[i] = permuted(m, i);
    for (int r = 0; r < t; r++) {
        const float *xr = x + (long)r * k;
        int8_t *qr = a->q + (long)r * k;
        int16_t *q16 = a->q16 + (long)r * k;
        float *dr = a->d + (long)r * (k / block), *xs = a->x + (long)r * a->xstride;
        for (int j = 0; j < a->xstride; j++) xs[j] = 0.0f;
        for (int b = 0; b < k / block; b++) {
            float amax = 0.0f;
            for (int i = 0; i < block; i++) amax = fmaxf(amax, fabsf(xr[b * block + i]));
            float d = amax / 127.0f, inv = d > 0 ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < block; i++) {
                int kk = b * block + i, v = (int)lrintf(xr[kk] * inv);
                v = v > 127 ? 127 : (v < -127 ? -127 : v);
                int chunk = kk / len * len;
                qr[chunk + perm[kk - chunk]] = (int8_t)v;
                q16[kk] = (int16_t)v;
                sum += v;
            }
            dr[b] = d;
            xs[b * block / m->group] += d * (float)sum;
        }
    }
}

/* ------------------------------------------------------------------------------------ portable path */

static float row_dot_portable(const qmat *m, const uint8_t *row, const acts *a, int r, const float *s,
                              const float *z) {
    int block = a->block, k = m->k;
    const int16_t *q = a->q16 + (long)r * k;
    const float *d = a->d + (long)r * (k / block), *xs = a->x + (long)r * a->xstride;
    float y = 0.0f;
    for (int b = 0; b < k / block; b++) {
        int dot = 0;
        for (int i = b * block; i < (b + 1) * block; i++) {
            int c = code_at(m, row, i);
            dot += q[i] * (m->kind == KIND_MXFP4 ? FP4_TWICE[c] : c);
        }
        y += s[b * block / m->group] * d[b] * (float)dot;
    }
    for (int j = 0; j < a->groups; j++) y -= s[j] * z[j] * xs[j];
    return y;
}

/* ------------------------------------------------------------------------------------ AVX2 path */

#if QDOT_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* the int32 lanes of one 32-weight chunk's dot product with its activations */
AVX2 static inline __m256i chunk4(const uint8_t *c, const int8_t *q) {
    __m128i raw = _mm_loadu_si128((const __m128i *)c), low = _mm_set1_epi8(15);
    __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
    __m256i pairs = _mm256_maddubs_epi16(codes, _mm256_loadu_si256((const __m256i *)q));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

AVX2 static inline __m256i chunk_mx(const uint8_t *c, const int8_t *q) {
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    __m128i raw = _mm_loadu_si128((const __m128i *)c), low = _mm_set1_epi8(15);
    __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(raw, low));
    __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), low));
    __m256i v = _mm256_set_m128i(hi, lo), qa = _mm256_loadu_si256((const __m256i *)q);
    __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(qa, v));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

AVX2 static inline __m256i chunk8(const uint8_t *c, const int16_t *q) {
    __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)c));
    __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + 16)));
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)q)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + 16))));
}

/* 32 3-bit codes in 12 bytes: each code's two bytes into a 16-bit lane, shifted into place by a multiply */
AVX2 static inline __m256i chunk3(const uint8_t *c, const int16_t *q, int last) {
    __m128i raw;
    if (last) {  /* the matrix's last 12 bytes: do not read past them */
        uint8_t tmp[16] = {0};
        memcpy(tmp, c, 12);
        raw = _mm_loadu_si128((const __m128i *)tmp);
    } else {
        raw = _mm_loadu_si128((const __m128i *)c);
    }
    __m256i both = _mm256_broadcastsi128_si256(raw);
    const __m256i idx_a = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 1, 2, 1, 2, 1, 2, 2, -1, 2, -1,
                                           3, 4, 3, 4, 3, 4, 4, 5, 4, 5, 4, 5, 5, -1, 5, -1);
    const __m256i idx_b = _mm256_setr_epi8(6, 7, 6, 7, 6, 7, 7, 8, 7, 8, 7, 8, 8, -1, 8, -1,
                                           9, 10, 9, 10, 9, 10, 10, 11, 10, 11, 10, 11, 11, -1, 11, -1);
    const __m256i shift = _mm256_setr_epi16(1 << 13, 1 << 10, 1 << 7, 1 << 12, 1 << 9, 1 << 6, 1 << 11, 1 << 8,
                                            1 << 13, 1 << 10, 1 << 7, 1 << 12, 1 << 9, 1 << 6, 1 << 11, 1 << 8);
    __m256i a = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(both, idx_a), shift), 13);
    __m256i b = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(both, idx_b), shift), 13);
    return _mm256_add_epi32(_mm256_madd_epi16(a, _mm256_loadu_si256((const __m256i *)q)),
                            _mm256_madd_epi16(b, _mm256_loadu_si256((const __m256i *)(q + 16))));
}

/* 64 4-bit codes (32 bytes): low nibbles against the block's first 32 activations, high against the rest */
AVX2 static inline __m256i chunk4x2(const uint8_t *c, const int8_t *q) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)c), low = _mm256_set1_epi8(15);
    __m256i pairs = _mm256_add_epi16(
        _mm256_maddubs_epi16(_mm256_and_si256(raw, low), _mm256_loadu_si256((const __m256i *)q)),
        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), _mm256_loadu_si256((const __m256i *)(q + 32))));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* one row: each activation block's int32 lanes (LANES, of block `bb`) scaled by sd[bb] = s[its group] * d[bb],
 * two blocks at a time into two accumulators */
#define ROW_LOOP(LANES)                                                                                  \
    {                                                                                                    \
        int b = 0;                                                                                       \
        for (; b + 2 <= blocks; b += 2) {                                                                \
            __m256i l0, l1;                                                                              \
            { int bb = b; l0 = LANES; }                                                                  \
            { int bb = b + 1; l1 = LANES; }                                                              \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l0), _mm256_broadcast_ss(sd + b), acc);             \
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l1), _mm256_broadcast_ss(sd + b + 1), acc1);       \
        }                                                                                                \
        if (b < blocks) {                                                                                \
            int bb = b;                                                                                  \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(LANES), _mm256_broadcast_ss(sd + b), acc);          \
        }                                                                                                \
    }

/* one row's dot product for activation blocks of 32 or 64 (every kind but 2-bit); sd: scratch of k / 32 floats */
AVX2 static float row_dot32(const qmat *m, const uint8_t *row, const acts *a, int r, const float *s,
                           const float *z, float *sd, int last_row) {
    int k = m->k, block = a->block, groups = a->groups, per_group = m->group / block, blocks = k / block;
    const int8_t *q = a->q + (long)r * k;
    const int16_t *q16 = a->q16 + (long)r * k;
    const float *d = a->d + (long)r * blocks, *xs = a->x + (long)r * a->xstride;
    if (per_group == 1) {  /* s is padded to whole vectors; d has slack past its last row, sd room for it */
        for (int b = 0; b < blocks; b += 8) _mm256_storeu_ps(sd + b, _mm256_mul_ps(_mm256_loadu_ps(s + b), _mm256_loadu_ps(d + b)));
    } else {
        for (int b = 0; b < blocks; b++) sd[b] = s[b / per_group] * d[b];
    }
    __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    if (m->kind == 4 && block == 64) {
        ROW_LOOP(chunk4x2(row + 32 * bb, q + 64 * bb))
    } else if (m->kind == 4) {
        ROW_LOOP(chunk4(row + 16 * bb, q + 32 * bb))
    } else if (m->kind == KIND_MXFP4) {
        ROW_LOOP(chunk_mx(row + 16 * bb, q + 32 * bb))
    } else if (m->kind == 8 && block == 64) {
        ROW_LOOP(_mm256_add_epi32(chunk8(row + 64 * bb, q16 + 64 * bb), chunk8(row + 64 * bb + 32, q16 + 64 * bb + 32)))
    } else if (m->kind == 8) {
        ROW_LOOP(chunk8(row + 32 * bb, q16 + 32 * bb))
    } else if (block == 64) {
        int last = last_row ? k / 32 - 1 : -1;
        ROW_LOOP(_mm256_add_epi32(chunk3(row + 24 * bb, q16 + 64 * bb, 2 * bb == last),
                                  chunk3(row + 24 * bb + 12, q16 + 64 * bb + 32, 2 * bb + 1 == last)))
    } else {
        int last = last_row ? k / 32 - 1 : -1;
        ROW_LOOP(chunk3(row + 12 * bb, q16 + 32 * bb, bb == last))
    }
    acc = _mm256_add_ps(acc, acc1);
    __m256 zacc = _mm256_setzero_ps();  /* s and z are zero past the last group, and so is xs */
    for (int j = 0; j < groups; j += 8)
        zacc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + j), _mm256_loadu_ps(z + j)),
                               _mm256_loadu_ps(xs + j), zacc);
    return hsum8(acc) - hsum8(zacc);
}

/* one row of 2-bit codes, groups of 16: 128 weights (32 bytes) a chunk, one 16-weight block per int32 lane */
AVX2 static float row_dot2(const qmat *m, const uint8_t *row, const acts *a, int r, const float *s,
                          const float *z) {
    int k = m->k;
    const int8_t *q = a->q + (long)r * k;
    const float *d = a->d + (long)r * (k / 16), *xs = a->x + (long)r * a->xstride;
    const __m256i mask = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps(), zacc = _mm256_setzero_ps();
    for (int c = 0; c < k / 128; c++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(row + 32 * c));
        const int8_t *qc = q + 128 * c;
        __m256i sum = _mm256_maddubs_epi16(_mm256_and_si256(raw, mask), _mm256_loadu_si256((const __m256i *)qc));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 2), mask),
                                                         _mm256_loadu_si256((const __m256i *)(qc + 32))));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), mask),
                                                         _mm256_loadu_si256((const __m256i *)(qc + 64))));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 6), mask),
                                                         _mm256_loadu_si256((const __m256i *)(qc + 96))));
        __m256 lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones));
        __m256 sv = _mm256_loadu_ps(s + 8 * c);
        acc = _mm256_fmadd_ps(lanes, _mm256_mul_ps(sv, _mm256_loadu_ps(d + 8 * c)), acc);
        zacc = _mm256_fmadd_ps(_mm256_mul_ps(sv, _mm256_loadu_ps(z + 8 * c)), _mm256_loadu_ps(xs + 8 * c), zacc);
    }
    return hsum8(acc) - hsum8(zacc);
}

/* 8 bytes (or 8 half floats) of a matrix's parts from p, where `room` of them are left in the part (the lanes
 * past the row's groups are zeroed by the caller): a load, or a copy at the part's very end, never past it */
AVX2 static inline __m128i load8(const uint8_t *p, long room) {
    if (room >= 8) return _mm_loadl_epi64((const __m128i *)p);
    uint8_t tmp[8] = {0};
    for (long i = 0; i < room; i++) tmp[i] = p[i];
    return _mm_loadl_epi64((const __m128i *)tmp);
}

AVX2 static inline __m128i load8h(const uint16_t *p, long room) {
    if (room >= 8) return _mm_loadu_si128((const __m128i *)p);
    uint16_t tmp[8] = {0};
    for (long i = 0; i < room; i++) tmp[i] = p[i];
    return _mm_loadu_si128((const __m128i *)tmp);
}

/* scale and zero per group of one row, eight at a time, as floats; s and z are zero from the row's last group to
 * the next multiple of 8, so the row's loops over groups run whole vectors (a group of eight that crosses a meta
 * group's end, one at a time) */
AVX2 static void row_params_avx2(const qmat *m, int row, float *s, float *z) {
    int groups = m->k / m->group, j = 0;
    long base = (long)row * groups, total = (long)m->n * groups;
    if (m->kind == KIND_MXFP4) {  /* 2 ** (e - 128) as float bits: exponent field e - 1 (e < 2: from the table) */
        const uint8_t *e8 = (const uint8_t *)m->scale + base;
        for (; j < groups; j += 8) {
            int have = groups - j < 8 ? groups - j : 8;
            __m256i e = _mm256_cvtepu8_epi32(load8(e8 + j, total - base - j));
            __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
            _mm256_storeu_ps(s + j, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23)));
            if (_mm256_movemask_ps(_mm256_castsi256_ps(low)))
                for (int i = 0; i < have; i++) s[j + i] = E8M0_HALF[e8[j + i]];
            _mm256_storeu_ps(z + j, _mm256_setzero_ps());
        }
    } else if (!m->meta) {
        const uint16_t *sh = (const uint16_t *)m->scale + base, *zh = (const uint16_t *)m->zero + base;
        for (; j < groups; j += 8) {
            _mm256_storeu_ps(s + j, _mm256_cvtph_ps(load8h(sh + j, total - base - j)));
            _mm256_storeu_ps(z + j, _mm256_cvtph_ps(load8h(zh + j, total - base - j)));
        }
    } else {
        long meta = base / m->meta, end = (meta + 1) * m->meta;  /* the meta group of the row's first group */
        float ss = _cvtsh_ss(m->scale_meta[2 * meta]), so = _cvtsh_ss(m->scale_meta[2 * meta + 1]);
        float zs = _cvtsh_ss(m->zero_meta[2 * meta]), zo = _cvtsh_ss(m->zero_meta[2 * meta + 1]);
        const uint8_t *sq = (const uint8_t *)m->scale + base, *zq = (const uint8_t *)m->zero + base;
        for (; j < groups; j += 8) {
            int have = groups - j < 8 ? groups - j : 8;
            long g = base + j;
            if (g + have <= end) {
                __m256 sv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(sq + j, total - g)));
                __m256 zv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(zq + j, total - g)));
                _mm256_storeu_ps(s + j, _mm256_fmadd_ps(sv, _mm256_set1_ps(ss), _mm256_set1_ps(so)));
                _mm256_storeu_ps(z + j, _mm256_fmadd_ps(zv, _mm256_set1_ps(zs), _mm256_set1_ps(zo)));
                if (g + have == end && j + have < groups) {  /* the next group starts a meta group */
                    meta++;
                    end += m->meta;
                    ss = _cvtsh_ss(m->scale_meta[2 * meta]); so = _cvtsh_ss(m->scale_meta[2 * meta + 1]);
                    zs = _cvtsh_ss(m->zero_meta[2 * meta]); zo = _cvtsh_ss(m->zero_meta[2 * meta + 1]);
                }
                continue;
            }
            for (int i = 0; i < have; i++, g++) {  /* these eight cross a meta group's end */
                if (g >= end) {
                    meta++;
                    end += m->meta;
                    ss = _cvtsh_ss(m->scale_meta[2 * meta]); so = _cvtsh_ss(m->scale_meta[2 * meta + 1]);
                    zs = _cvtsh_ss(m->zero_meta[2 * meta]); zo = _cvtsh_ss(m->zero_meta[2 * meta + 1]);
                }
                s[j + i] = sq[j + i] * ss + so;
                z[j + i] = zq[j + i] * zs + zo;
            }
            if (g == end && j + have < groups) {
                meta++;
                end += m->meta;
                ss = _cvtsh_ss(m->scale_meta[2 * meta]); so = _cvtsh_ss(m->scale_meta[2 * meta + 1]);
                zs = _cvtsh_ss(m->zero_meta[2 * meta]); zo = _cvtsh_ss(m->zero_meta[2 * meta + 1]);
            }
        }
    }
    for (int i = groups; i < j; i++) s[i] = z[i] = 0.0f;  /* the padding lanes */
}

static int cpu_has_avx2(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return known;
}
#endif

/* whether the AVX2 path takes this matrix: 1 yes, 0 portable */
static int avx2_takes(const qmat *m) {
#if QDOT_X86
    if (!cpu_has_avx2()) return 0;
    if (m->kind == 2) return m->group == 16 && m->k % 128 == 0;
    return m->k % 32 == 0 && m->group % 32 == 0;
#else
    (void)m;
    return 0;
#endif
}

/* ------------------------------------------------------------------------------------ rows over threads */

#define MAX_SEGS 16  /* matrices one job computes: a product is one; both experts' gate_up (or down) are two */

typedef struct {   /* one matrix of a job: its rounded activations, its output [T, N], fast path or not */
    const qmat *m;
    const acts *a;
    float *y;
    int fast;
    int first;     /* the job's row number of this matrix's row 0 */
} seg;

typedef struct {
    seg segs[MAX_SEGS];
    int nseg, rows;  /* the job's rows: every segment's, one after the other */
    int chunk;
    int next;  /* the next unclaimed row: threads claim `chunk` rows at a time, so one preempted thread (a reader
                  woken on its core) delays the product by one chunk, not by its whole share */
    int failed;
} job;

static void seg_rows(const seg *sg, int row0, int row1, float *s, float *z, float *sd) {
    const qmat *m = sg->m;
    long stride = row_bytes(m);
    for (int n = row0; n < row1; n++) {
        const uint8_t *row = m->codes + stride * n;
#if QDOT_X86
        if (n + 1 < m->n) {  /* the codes AHEAD bytes on, into the cache while this row computes */
            const uint8_t *ahead = row + AHEAD, *end = m->codes + stride * m->n;
            for (long c = 0; c < stride && ahead + c < end; c += 64) _mm_prefetch((const char *)(ahead + c), _MM_HINT_T0);
        }
        if (sg->fast) {
            row_params_avx2(m, n, s, z);
            for (int r = 0; r < sg->a->t; r++)
                sg->y[(long)r * m->n + n] = m->kind == 2 ? row_dot2(m, row, sg->a, r, s, z)
                                                         : row_dot32(m, row, sg->a, r, s, z, sd, n == m->n - 1);
            continue;
        }
#endif
        row_params(m, n, s, z);
        for (int r = 0; r < sg->a->t; r++) sg->y[(long)r * m->n + n] = row_dot_portable(m, row, sg->a, r, s, z);
    }
}

static void rows_of(job *jb, float *s, float *z, float *sd) {
    for (;;) {
        int row0 = __atomic_fetch_add(&jb->next, jb->chunk, __ATOMIC_RELAXED);
        if (row0 >= jb->rows) return;
        int row1 = row0 + jb->chunk < jb->rows ? row0 + jb->chunk : jb->rows;
        for (int i = 0; i < jb->nseg && row0 < row1; i++) {  /* the claimed rows, segment by segment */
            const seg *sg = &jb->segs[i];
            int end = sg->first + sg->m->n;
            if (row0 >= end) continue;
            int stop = row1 < end ? row1 : end;
            seg_rows(sg, row0 - sg->first, stop - sg->first, s, z, sd);
            row0 = stop;
        }
    }
}

static void run_job(job *jb) {
    int groups = 0, blocks = 0;
    for (int i = 0; i < jb->nseg; i++) {
        const qmat *m = jb->segs[i].m;
        if (m->k / m->group > groups) groups = m->k / m->group;
        if (m->k / 16 > blocks) blocks = m->k / 16;
    }
    float *s = malloc(sizeof(float) * (groups + 8)), *z = malloc(sizeof(float) * (groups + 8));
    float *sd = malloc(sizeof(float) * (blocks + 8));
    if (s && z && sd) rows_of(jb, s, z, sd);
    else __atomic_store_n(&jb->failed, 1, __ATOMIC_RELAXED);
    free(s);
    free(z);
    free(sd);
}

/* A pool of worker threads started once and kept: a product is a few hundred microseconds, too short to start
 * threads for. After a job a worker spins briefly for the next (a decode step's products come back to back),
 * then sleeps on a condition variable. */
#define SPIN_ROUNDS 20000
static struct {
    pthread_mutex_t lock, dispatch;
    pthread_cond_t wake;
    int workers;            /* started */
    long generation;        /* bumped per job */
    int active;             /* workers that take part in the current job */
    int finished;           /* of those, done */
    job *current;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL};

static void pause_briefly(void) {
#if QDOT_X86
    _mm_pause();
#endif
}

static void *worker(void *arg) {
    int index = (int)(long)arg;
    long seen = 0;
    for (;;) {
        long now = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
        for (int i = 0; now == seen && i < SPIN_ROUNDS; i++) {
            pause_briefly();
            now = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
        }
        if (now == seen) {
            pthread_mutex_lock(&pool.lock);
            while ((now = pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = now;
        if (index < __atomic_load_n(&pool.active, __ATOMIC_ACQUIRE)) {
            run_job(pool.current);
            __atomic_fetch_add(&pool.finished, 1, __ATOMIC_ACQ_REL);
        }
    }
    return NULL;
}

static void forget_pool(void) {  /* in a forked child: the parent's workers do not exist there */
    pool.workers = 0;
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.dispatch, NULL);
    pthread_cond_init(&pool.wake, NULL);
}

/* run `jb` on the calling thread and `helpers` pool workers (started on first need) */
static void run_pooled(job *jb, int helpers) {
    static int registered = 0;
    pthread_mutex_lock(&pool.dispatch);  /* one job at a time: callers on several threads queue here */
    if (!registered) {
        pthread_atfork(NULL, NULL, forget_pool);
        registered = 1;
    }
    while (pool.workers < helpers) {
        pthread_t id;
        if (pthread_create(&id, NULL, worker, (void *)(long)pool.workers)) break;
        pthread_detach(id);
        pool.workers++;
    }
    if (helpers > pool.workers) helpers = pool.workers;
    pool.current = jb;
    __atomic_store_n(&pool.finished, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.active, helpers, __ATOMIC_RELEASE);
    if (helpers > 0) {
        pthread_mutex_lock(&pool.lock);
        __atomic_add_fetch(&pool.generation, 1, __ATOMIC_ACQ_REL);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    run_job(jb);
    while (__atomic_load_n(&pool.finished, __ATOMIC_ACQUIRE) < helpers) pause_briefly();
    __atomic_store_n(&pool.active, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&pool.dispatch);
}

/* ------------------------------------------------------------------------------------ entry points */

/* 0 when the matrix is one this library computes; else a code naming what is wrong */
int qdot_check(const qmat *m) {
    if (m->n <= 0 || m->k <= 0 || m->group <= 0 || m->k % m->group) return 1;
    if (m->kind == KIND_MXFP4) return m->group == 32 ? 0 : 2;
    if (m->kind != 2 && m->kind != 3 && m->kind != 4 && m->kind != 8) return 3;
    if (m->group % 16) return 4;
    if (m->kind == 3 && m->k % 8) return 5;
    return 0;
}

static void free_acts(acts *a) {
    free(a->q); free(a->q16); free(a->d); free(a->x);
    a->q = NULL; a->q16 = NULL; a->d = NULL; a->x = NULL;
}

/* `x` [T, K] rounded for matrix `m` into `a` (allocated here; free_acts frees it); 0, or 2 when out of memory */
static int make_acts(const qmat *m, const float *x, int t, acts *a) {
    int k = m->k, len = chunk_len(m);
    long padded = ((long)k + len - 1) / len * len;
    a->q = malloc((size_t)t * padded + 64);
    a->q16 = malloc(sizeof(int16_t) * (size_t)t * k + 64);
    a->d = malloc(sizeof(float) * (size_t)t * (k / block_of(m)) + 64);
    a->x = malloc(sizeof(float) * ((size_t)t * ((k / m->group + 7) / 8 * 8) + 8));
    if (!a->q || !a->q16 || !a->d || !a->x) { free_acts(a); return 2; }
    round_acts(m, x, t, a);
    return 0;
}

/* whether activations rounded for `a` serve `b` too: the same kind, width and group */
static int same_acts(const qmat *a, const qmat *b) {
    return a->kind == b->kind && a->k == b->k && a->group == b->group;
}

/* run the segments of `jb` (their rows, activations and outputs set) over `threads` threads */
static int run_segments(job *jb, int t, int threads) {
    long work = 0;
    jb->rows = 0;
    for (int i = 0; i < jb->nseg; i++) {
        jb->segs[i].first = jb->rows;
        jb->rows += jb->segs[i].m->n;
        work += (long)jb->segs[i].m->n * jb->segs[i].m->k * t;
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (work < (1L << 18)) threads = 1;  /* too little to pay for a thread */
    if (threads > jb->rows) threads = jb->rows;
    int chunk = jb->rows / (threads * 8);
    jb->chunk = chunk < 16 ? 16 : chunk;
    jb->next = 0;
    jb->failed = 0;
    run_pooled(jb, threads - 1);
    return jb->failed ? 2 : 0;
}

/* y [T, N] float32 = x [T, K] float32 (rounded to int8 per block) times the matrix's transpose; 0 on success.
 * simd 0 keeps to the portable path (the tests compare the two). */
int qdot_matmul(const qmat *m, const float *x, int t, float *y, int threads, int simd) {
    if (qdot_check(m) || t <= 0) return 1;
    acts a;
    if (make_acts(m, x, t, &a)) return 2;
    job jb;
    jb.nseg = 1;
    jb.segs[0] = (seg){m, &a, y, simd && avx2_takes(m), 0};
    int status = run_segments(&jb, t, threads);
    free_acts(&a);
    return status;
}

/* One token through `n` gated experts (n <= MAX_SEGS): y [H] = sum_e w[e] * down_e(silu(g_e) * u_e), where
 * gate_up_e [2I, K] times x gives g_e (its first I rows) and u_e (the rest) and down_e is [H, I]. The gate_up
 * products of every expert are one job over the threads, the down products another; the activations are rounded
 * once per kind of matrix. Each expert's output is added in the order given, as a sum of weighted outputs would.
 * 0 on success, 1 for matrices that do not fit together, 2 out of memory. */
int qdot_experts(const qmat *const *gate_up, const qmat *const *down, const float *w, int n, const float *x,
                 float *y, int threads, int simd) {
    if (n < 1 || n > MAX_SEGS) return 1;
    int h = down[0]->n;
    for (int e = 0; e < n; e++) {
        const qmat *gu = gate_up[e], *dn = down[e];
        if (qdot_check(gu) || qdot_check(dn) || gu->n % 2 || dn->k != gu->n / 2 || dn->n != h || gu->k != gate_up[0]->k)
            return 1;
    }
    acts in[MAX_SEGS], mid[MAX_SEGS];
    int owner_in[MAX_SEGS];  /* the expert whose rounded activations an expert's gate_up shares */
    float *hidden[MAX_SEGS] = {0}, *gated[MAX_SEGS] = {0}, *outs[MAX_SEGS] = {0};
    memset(in, 0, sizeof(in));
    memset(mid, 0, sizeof(mid));
    int status = 0;
    job jb;
    jb.nseg = n;
    for (int e = 0; e < n && !status; e++) {
        owner_in[e] = e;
        for (int f = 0; f < e; f++)
            if (same_acts(gate_up[f], gate_up[e])) { owner_in[e] = f; break; }
        if (owner_in[e] == e) status = make_acts(gate_up[e], x, 1, &in[e]);
        hidden[e] = malloc(sizeof(float) * gate_up[e]->n);
        if (!hidden[e]) status = 2;
        if (!status) jb.segs[e] = (seg){gate_up[e], &in[owner_in[e]], hidden[e], simd && avx2_takes(gate_up[e]), 0};
    }
    if (!status) status = run_segments(&jb, 1, threads);
    for (int e = 0; e < n && !status; e++) {  /* silu(gate) * up, as x / (1 + exp(-x)) * up */
        int half = gate_up[e]->n / 2;
        gated[e] = malloc(sizeof(float) * half);
        outs[e] = malloc(sizeof(float) * h);
        if (!gated[e] || !outs[e]) { status = 2; break; }
        for (int i = 0; i < half; i++) {
            float g = hidden[e][i];
            gated[e][i] = g / (1.0f + expf(-g)) * hidden[e][half + i];
        }
    }
    for (int e = 0; e < n && !status; e++) {  /* each expert's own gated activations: rounded per expert */
        status = make_acts(down[e], gated[e], 1, &mid[e]);
        if (!status) jb.segs[e] = (seg){down[e], &mid[e], outs[e], simd && avx2_takes(down[e]), 0};
    }
    if (!status) status = run_segments(&jb, 1, threads);
    if (!status) {
        for (int j = 0; j < h; j++) y[j] = 0.0f;
        for (int e = 0; e < n; e++)
            for (int j = 0; j < h; j++) y[j] += w[e] * outs[e][j];
    }
    for (int e = 0; e < n; e++) {
        free_acts(&in[e]);  /* zeroed where shared or never made */
        free_acts(&mid[e]);
        free(hidden[e]); free(gated[e]); free(outs[e]);
    }
    return status;
}

/* which path a matrix takes here: 1 AVX2, 0 portable */
int qdot_path(const qmat *m) { return avx2_takes(m); }

/* ------------------------------------------------------------------------------------ read bandwidth probe */

typedef struct {
    const uint8_t *p;
    long n;
    uint64_t sum;
} span;

#if QDOT_X86
AVX2 static uint64_t read_avx2(const uint8_t *p, long n) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    long i = 0;
    for (; i + 128 <= n; i += 128) {
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(p + i)));
        b = _mm256_xor_si256(b, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        c = _mm256_xor_si256(c, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        d = _mm256_xor_si256(d, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    __m256i x = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, x);
    for (; i < n; i++) out[0] ^= p[i];
    return out[0] ^ out[1] ^ out[2] ^ out[3];
}
#endif

static void *read_span(void *arg) {
    span *s = arg;
#if QDOT_X86
    if (cpu_has_avx2()) {
        s->sum = read_avx2(s->p, s->n);
        return NULL;
    }
#endif
    uint64_t x = 0;
    for (long i = 0; i < s->n; i++) x ^= (uint64_t)s->p[i] << (8 * (i % 8));
    s->sum = x;
    return NULL;
}

/* every byte of p[0, n) read once on `threads` threads (the bench's measure of read bandwidth); an xor of them */
uint64_t qdot_read(const uint8_t *p, long n, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    span spans[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    for (int i = 0; i < threads; i++) spans[i] = (span){p + n * i / threads, n * (i + 1) / threads - n * i / threads, 0};
    int started = 0;
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&ids[i], NULL, read_span, &spans[i])) break;
        started = i;
    }
    read_span(&spans[0]);
    for (int i = 1; i <= started; i++) pthread_join(ids[i], NULL);
    for (int i = started + 1; i < threads; i++) read_span(&spans[i]);
    uint64_t x = 0;
    for (int i = 0; i < threads; i++) x ^= spans[i].sum;
    return x;
}
