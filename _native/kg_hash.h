/* Java hashCode() and Flink key-group kernels over raw buffers.
 *
 * Every function here is pure C over pointers and lengths, so the Cython layer can call it without the GIL.
 * Integer arithmetic that Java does on `int` is done on uint32_t here: C leaves signed overflow undefined,
 * Java defines it as two's-complement wrap-around, and unsigned arithmetic gives exactly those bits.
 */
#ifndef KEYGROUPS_KG_HASH_H
#define KEYGROUPS_KG_HASH_H

#include <stdint.h>
#include <string.h>
#include <Python.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* One build serves every x86-64 machine: the loader picks the AVX2 clone where the CPU has it. */
#define KG_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KG_VECTOR_CLONES
#endif

/* Flink's KeyGroupRangeAssignment.UPPER_BOUND_MAX_PARALLELISM (2^15): key groups fit an int16, and kg_mod relies on
 * a divisor of at most this. keygroups.UPPER_BOUND_MAX_PARALLELISM is derived from it. */
#define KG_UPPER_BOUND_MAX_PARALLELISM 32768

#define KG_BOOLEAN_TRUE_HASH 1231
#define KG_BOOLEAN_FALSE_HASH 1237

static inline uint32_t kg_rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

/* MurmurHash3_x86_32's multipliers of a block (C1, C2), its per-block addend (C3) and its finalizer's multipliers
 * (F1, F2); the vector kernels below use them too. */
#define KG_MURMUR_C1 0xcc9e2d51u
#define KG_MURMUR_C2 0x1b873593u
#define KG_MURMUR_C3 0xe6546b64u
#define KG_MURMUR_F1 0x85ebca6bu
#define KG_MURMUR_F2 0xc2b2ae35u

/* Flink's MathUtils.murmurHash(int): one MurmurHash3_x86_32 block with seed 0 and length 4, made non-negative. */
static inline int32_t kg_murmur(int32_t code) {
    uint32_t h = (uint32_t)code;
    h *= KG_MURMUR_C1;
    h = kg_rotl32(h, 15);
    h *= KG_MURMUR_C2;
    h = kg_rotl32(h, 13);
    h = h * 5u + KG_MURMUR_C3;
    h ^= 4u;
    h ^= h >> 16;
    h *= KG_MURMUR_F1;
    h ^= h >> 13;
    h *= KG_MURMUR_F2;
    h ^= h >> 16;
    /* Flink returns code if >= 0, -code otherwise, and 0 for Integer.MIN_VALUE. Branch-free: |code| as unsigned is
     * below 2^31 except for MIN_VALUE, where it is exactly 2^31, which the mask turns into 0. */
    uint32_t sign = (uint32_t)((int32_t)h >> 31);
    return (int32_t)(((h ^ sign) - sign) & 0x7fffffffu);
}

/* x mod d for 0 <= x < 2^31 and 1 <= d <= 2^15, without a division instruction: the double quotient is at most one
 * off, and the two corrections make it exact. Written branch-free so that the compiler can vectorize loops over it. */
static inline int32_t kg_mod(int32_t x, int32_t d, double inv_d) {
    int32_t q = (int32_t)((double)x * inv_d);
    int32_t r = x - q * d;
    r += (r >> 31) & d;
    r -= d & -(int32_t)(r >= d);
    return r;
}

static inline int32_t kg_key_group(int32_t java_hash, int32_t max_parallelism, double inv_max_parallelism) {
    return kg_mod(kg_murmur(java_hash), max_parallelism, inv_max_parallelism);
}

static inline int32_t kg_hash_long(int64_t v) { return (int32_t)(uint32_t)((uint64_t)v ^ ((uint64_t)v >> 32)); }

/* Double.hashCode(): doubleToLongBits folds every NaN to the canonical 0x7ff8000000000000. */
static inline int32_t kg_hash_double(double d) {
    uint64_t bits;
    if (d != d) bits = 0x7ff8000000000000ull;
    else memcpy(&bits, &d, 8);
    return (int32_t)(uint32_t)(bits ^ (bits >> 32));
}

/* Float.hashCode(): floatToIntBits, NaN canonical 0x7fc00000. */
static inline int32_t kg_hash_float(float f) {
    uint32_t bits;
    if (f != f) bits = 0x7fc00000u;
    else memcpy(&bits, &f, 4);
    return (int32_t)bits;
}

/* 31^k mod 2^32, for folding eight bytes at once without a chain of eight dependent multiplies. */
#define KG_P1 31u
#define KG_P2 961u
#define KG_P3 29791u
#define KG_P4 923521u
#define KG_P5 28629151u
#define KG_P6 887503681u
#define KG_P7 0x67e12cdfu /* 31^7 mod 2^32 */
#define KG_P8 0x94446f01u /* 31^8 mod 2^32 */

/* The 31-polynomial of eight bytes (b0 first) in a little-endian word, as b0*31^7 + ... + b7, by SWAR: adjacent bytes
 * pair up in 16-bit lanes (b*31 + b' < 2^16), pairs into 32-bit lanes (p*961 + p' < 2^32), so three multiplies do
 * the work of eight and no lane carries into the next. */
static inline uint32_t kg_poly8(uint64_t w) {
    uint64_t pairs = (w & 0x00FF00FF00FF00FFull) * 31u + ((w >> 8) & 0x00FF00FF00FF00FFull);
    uint64_t quads = (pairs & 0x0000FFFF0000FFFFull) * 961u + ((pairs >> 16) & 0x0000FFFF0000FFFFull);
    return (uint32_t)quads * KG_P4 + (uint32_t)(quads >> 32);
}

static inline uint32_t kg_poly4(uint32_t w) {
    uint32_t pairs = (w & 0x00FF00FFu) * 31u + ((w >> 8) & 0x00FF00FFu);
    return (pairs & 0xFFFFu) * 961u + (pairs >> 16);
}

static inline uint64_t kg_load8(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

static inline uint32_t kg_fold8(uint32_t h, const uint8_t *p, int is_signed) {
    uint64_t w = kg_load8(p);
    uint32_t poly = kg_poly8(w);
    /* A signed byte is its unsigned value minus 256 when the top bit is set. */
    if (is_signed) poly -= 256u * kg_poly8((w >> 7) & 0x0101010101010101ull);
    return h * KG_P8 + poly;
}

/* java.util.Arrays.hashCode(byte[]): starts at 1, bytes are signed. */
static inline int32_t kg_hash_bytes(const uint8_t *p, int64_t len) {
    uint32_t h = 1;
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) h = kg_fold8(h, p + i, 1);
    for (; i < len; i++) h = h * 31u + (uint32_t)(int32_t)(int8_t)p[i];
    return (int32_t)h;
}

/* String.hashCode() of the string whose UTF-8 encoding is p[0:len], over its UTF-16 code units. Returns 0 on
 * success and -1 where the bytes are not well-formed UTF-8 (overlong forms, encoded surrogates and code points past
 * U+10FFFF included); it never reads past p + len. */
static inline int kg_hash_utf8(const uint8_t *p, int64_t len, int32_t *out) {
    uint32_t h = 0;
    int64_t i = 0;
    /* ASCII fast path: whole 8- and 4-byte words fold with precomputed powers of 31, a short dependency chain. */
    for (; i + 8 <= len; i += 8) {
        uint64_t w = kg_load8(p + i);
        if (w & 0x8080808080808080ull) goto general;
        h = h * KG_P8 + kg_poly8(w);
    }
    if (i + 4 <= len) {
        uint32_t w;
        memcpy(&w, p + i, 4);
        if (w & 0x80808080u) goto general;
        h = h * KG_P4 + kg_poly4(w);
        i += 4;
    }
general:
    while (i < len) {
        uint32_t c = p[i];
        if (c < 0x80) {
            h = h * 31u + c;
            i += 1;
            continue;
        }
        uint32_t cp;
        int n;
        uint32_t lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) { n = 2; cp = c & 0x1F; }
        else if (c >= 0xE0 && c <= 0xEF) {
            n = 3; cp = c & 0x0F;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 4; cp = c & 0x07;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        } else return -1;
        if (len - i < n) return -1;
        for (int k = 1; k < n; k++) {
            uint32_t cc = p[i + k];
            if (k == 1 ? (cc < lo || cc > hi) : (cc < 0x80 || cc > 0xBF)) return -1;
            cp = (cp << 6) | (cc & 0x3F);
        }
        i += n;
        if (cp >= 0x10000) {
            cp -= 0x10000;
            h = h * 31u + (0xD800u + (cp >> 10));
            h = h * 31u + (0xDC00u + (cp & 0x3FF));
        } else {
            h = h * 31u + cp;
        }
    }
    *out = (int32_t)h;
    return 0;
}

/* String.hashCode() over UCS-4 code points (numpy 'U' arrays, Python's 4-byte strings); astral code points count as
 * their surrogate pair, lone surrogates as themselves, as in Java. */
static inline int32_t kg_hash_ucs4(const uint32_t *p, int64_t len) {
    uint32_t h = 0;
    for (int64_t i = 0; i < len; i++) {
        uint32_t cp = p[i];
        if (cp >= 0x10000) {
            cp -= 0x10000;
            h = h * 31u + (0xD800u + (cp >> 10));
            h = h * 31u + (0xDC00u + (cp & 0x3FF));
        } else {
            h = h * 31u + cp;
        }
    }
    return (int32_t)h;
}

static inline int32_t kg_hash_ucs2(const uint16_t *p, int64_t len) {
    uint32_t h = 0;
    for (int64_t i = 0; i < len; i++) h = h * 31u + p[i];
    return (int32_t)h;
}

static inline int32_t kg_hash_latin1(const uint8_t *p, int64_t len) {
    uint32_t h = 0;
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) h = kg_fold8(h, p + i, 0);
    for (; i < len; i++) h = h * 31u + p[i];
    return (int32_t)h;
}

/* ---- loops over whole buffers ---------------------------------------------------------------------------------- */

/* The scalar loops: the reference the vector kernels below must match bit for bit, their tails, and the whole path
 * where the CPU has no AVX2 (or the build has KG_NO_SIMD). */
static void kg_groups_from_int64_scalar(const int64_t *in, Py_ssize_t n, int32_t maxp, int16_t *out) {
    if ((maxp & (maxp - 1)) == 0) { /* murmur is non-negative, so a mask is the modulo (the default 128 is here) */
        uint32_t mask = (uint32_t)maxp - 1;
        for (Py_ssize_t i = 0; i < n; i++) out[i] = (int16_t)((uint32_t)kg_murmur(kg_hash_long(in[i])) & mask);
        return;
    }
    double inv = 1.0 / (double)maxp;
    for (Py_ssize_t i = 0; i < n; i++) out[i] = (int16_t)kg_key_group(kg_hash_long(in[i]), maxp, inv);
}

/* Also the int32 path: Integer.hashCode() (and Short's, Byte's) is the value itself. */
static void kg_groups_from_hashes_scalar(const int32_t *hashes, Py_ssize_t n, int32_t maxp, int16_t *out) {
    if ((maxp & (maxp - 1)) == 0) {
        uint32_t mask = (uint32_t)maxp - 1;
        for (Py_ssize_t i = 0; i < n; i++) out[i] = (int16_t)((uint32_t)kg_murmur(hashes[i]) & mask);
        return;
    }
    double inv = 1.0 / (double)maxp;
    for (Py_ssize_t i = 0; i < n; i++) out[i] = (int16_t)kg_key_group(hashes[i], maxp, inv);
}

KG_VECTOR_CLONES
static void kg_operators_from_groups(const int16_t *groups, Py_ssize_t n, int32_t maxp, int32_t parallelism,
                                     int32_t *out) {
    /* Flink: keyGroup * parallelism / maxParallelism; the product stays below 2^30. */
    double inv = 1.0 / (double)maxp;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t x = (int32_t)groups[i] * parallelism;
        int32_t q = (int32_t)((double)x * inv);
        int32_t r = x - q * maxp;
        q -= (int32_t)(r < 0);
        q += (int32_t)(r - maxp * (int32_t)(r < 0) >= maxp);
        out[i] = q;
    }
}

/* One Arrow variable-length value, data[start, end), after checking its offsets against the data buffer: 0 when
 * hashed into *out, 1 for offsets outside the buffer, 2 for a string that is not UTF-8. */
static inline int kg_hash_var_value(const uint8_t *data, int64_t data_len, int64_t start, int64_t end, int utf8,
                                    int32_t *out) {
    if (start < 0 || start > end || end > data_len) return 1;
    if (utf8) return kg_hash_utf8(data + start, end - start, out) != 0 ? 2 : 0;
    *out = kg_hash_bytes(data + start, end - start);
    return 0;
}

/* Values from..to-1 one by one: -1 when all are hashed, else the index of the first bad one (*status says why). */
#define KG_DEFINE_SCALAR_RUN(NAME, OFFSET_T)                                                                         \
    static inline Py_ssize_t NAME(const OFFSET_T *offsets, Py_ssize_t from, Py_ssize_t to, const uint8_t *data,      \
                                  int64_t data_len, int utf8, int32_t *out, int *status) {                           \
        for (Py_ssize_t j = from; j < to; j++) {                                                                     \
            *status = kg_hash_var_value(data, data_len, (int64_t)offsets[j], (int64_t)offsets[j + 1], utf8, &out[j]); \
            if (*status) return j;                                                                                   \
        }                                                                                                            \
        return -1;                                                                                                   \
    }
KG_DEFINE_SCALAR_RUN(kg_scalar_run32, int32_t)
KG_DEFINE_SCALAR_RUN(kg_scalar_run64, int64_t)

/* ---- eight (AVX-512) or four (AVX2) short ASCII strings at a time ------------------------------------------------
 * Keys are mostly short ASCII strings (ids, names, "user-1234567"), and their hash is a handful of multiplies, so
 * the scalar loop is bound by its own instructions. A string of at most 16 bytes is two 8-byte words: its first
 * eight bytes (head) and its last eight (tail, loaded so that it ends where the string ends, bytes the head already
 * holds, or that belong to the previous value, shifted out). Its hash is poly8(head) * 31^(len-8) + poly8(tail),
 * computed here for eight strings in the lanes of one register. Groups where any value is longer, not ASCII, ends
 * before byte 8 of the buffer or has offsets out of bounds go through the scalar code, value by value. Every load
 * stays inside [0, data_len): head needs len >= 8 (masked gather), tail needs end >= 8 and end <= data_len. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(KG_NO_SIMD)
#define KG_HAVE_SIMD 1
#include <immintrin.h>

/* The widest vector path allowed (Arrow strings and integer key groups alike): 2 AVX-512, 1 AVX2, 0 none. Tests lower
 * it (keygroups._native.hashing._set_simd) to check every narrower path against the others on a CPU that has the
 * widest. */
static int kg_simd_allowed = 2;

/* The vector path that runs: the widest the CPU has, capped by kg_simd_allowed. */
static int kg_simd_available(void) {
    static int cpu = -1;
    if (cpu < 0) cpu = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    return cpu < kg_simd_allowed ? cpu : kg_simd_allowed;
}

/* kg_poly8 of each 64-bit lane, in the lane's low 32 bits. a * 31 = (a << 5) - a stays inside each 16-bit lane. */
__attribute__((target("avx512f"))) static inline __m512i kg_poly8_x8(__m512i w) {
    const __m512i bytes = _mm512_set1_epi64(0x00FF00FF00FF00FFll), pairs_mask = _mm512_set1_epi64(0x0000FFFF0000FFFFll);
    __m512i a = _mm512_and_si512(w, bytes), b = _mm512_and_si512(_mm512_srli_epi64(w, 8), bytes);
    __m512i pairs = _mm512_add_epi64(_mm512_sub_epi64(_mm512_slli_epi64(a, 5), a), b);
    __m512i c = _mm512_and_si512(pairs, pairs_mask), d = _mm512_and_si512(_mm512_srli_epi64(pairs, 16), pairs_mask);
    __m512i quads = _mm512_add_epi32(_mm512_mullo_epi32(c, _mm512_set1_epi32(961)), d);
    return _mm512_add_epi32(_mm512_mullo_epi32(quads, _mm512_set1_epi32((int)KG_P4)), _mm512_srli_epi64(quads, 32));
}

#define KG_DEFINE_UTF8_X8(NAME, OFFSET_T, LOAD_OFFSETS, SCALAR_RUN)                                                  \
    __attribute__((target("avx512f"))) static Py_ssize_t NAME(const OFFSET_T *offsets, Py_ssize_t n,                 \
                                                             Py_ssize_t readable, const uint8_t *data,               \
                                                             int64_t data_len, int32_t *out, int *status) {          \
        const __m512i pow_lo = _mm512_setr_epi64(1, 31, 961, 29791, 923521, 28629151, 887503681, KG_P7);             \
        const __m512i pow_hi = _mm512_set1_epi64(KG_P8);                                                             \
        const __m512i high_bits = _mm512_set1_epi64((long long)0x8080808080808080ull);                               \
        const __m512i zero = _mm512_setzero_si512(), eight = _mm512_set1_epi64(8);                                   \
        const __m512i sixteen = _mm512_set1_epi64(16), limit = _mm512_set1_epi64(data_len);                          \
        Py_ssize_t i = 0;                                                                                            \
        for (; i + 8 <= n; i += 8) {                                                                                 \
            if (i + 256 <= readable) { /* the hardware prefetcher does not keep up with gathers: 256 values on */    \
                int64_t ahead = (int64_t)offsets[i + 256];                                                           \
                if (ahead >= 0 && ahead < data_len) {                                                                \
                    _mm_prefetch((const char *)(data + ahead), _MM_HINT_T0);                                         \
                    _mm_prefetch((const char *)(data + ahead) + 64, _MM_HINT_T0);                                    \
                }                                                                                                    \
            }                                                                                                        \
            __m512i start = LOAD_OFFSETS(offsets + i), end = LOAD_OFFSETS(offsets + i + 1);                          \
            __m512i len = _mm512_sub_epi64(end, start);                                                              \
            __mmask8 ok = _mm512_cmpge_epi64_mask(start, zero) & _mm512_cmpge_epi64_mask(len, zero) &                \
                          _mm512_cmple_epi64_mask(end, limit) & _mm512_cmpge_epi64_mask(end, eight) &                \
                          _mm512_cmple_epi64_mask(len, sixteen);                                                     \
            if (ok == 0xFF) {                                                                                        \
                __mmask8 long8 = _mm512_cmpge_epi64_mask(len, eight);                                                \
                __m512i head = _mm512_mask_i64gather_epi64(zero, long8, start, data, 1);                             \
                __m512i tail = _mm512_i64gather_epi64(_mm512_sub_epi64(end, eight), data, 1);                        \
                /* bytes of tail not in this value's tail part: 16 - len (in head) or 8 - len (before start) */      \
                __m512i drop = _mm512_mask_sub_epi64(_mm512_sub_epi64(eight, len), long8, sixteen, len);             \
                __m512i bits = _mm512_slli_epi64(drop, 3); /* up to 64: vector shifts by >= 64 give 0 */             \
                tail = _mm512_sllv_epi64(_mm512_srlv_epi64(tail, bits), bits);                                       \
                if (!_mm512_test_epi64_mask(_mm512_or_si512(head, tail), high_bits)) {                               \
                    __m512i power = _mm512_permutex2var_epi64(pow_lo, _mm512_maskz_sub_epi64(long8, len, eight),     \
                                                              pow_hi);                                               \
                    __m512i h = _mm512_add_epi32(_mm512_mullo_epi32(kg_poly8_x8(head), power), kg_poly8_x8(tail));   \
                    _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi64_epi32(h));                             \
                    continue;                                                                                        \
                }                                                                                                    \
            }                                                                                                        \
            Py_ssize_t failed = SCALAR_RUN(offsets, i, i + 8, data, data_len, 1, out, status);                       \
            if (failed >= 0) return failed;                                                                          \
        }                                                                                                            \
        return SCALAR_RUN(offsets, i, n, data, data_len, 1, out, status);                                            \
    }
#define KG_LOAD_OFFSETS32(p) _mm512_cvtepi32_epi64(_mm256_loadu_si256((const __m256i *)(p)))
#define KG_LOAD_OFFSETS64(p) _mm512_loadu_si512((const void *)(p))
KG_DEFINE_UTF8_X8(kg_hashes_utf8_x8_32, int32_t, KG_LOAD_OFFSETS32, kg_scalar_run32)
KG_DEFINE_UTF8_X8(kg_hashes_utf8_x8_64, int64_t, KG_LOAD_OFFSETS64, kg_scalar_run64)

/* The same for four strings at a time with AVX2 (no mask registers: lane masks are all-ones lanes). */
__attribute__((target("avx2"))) static inline __m256i kg_poly8_x4(__m256i w) {
    const __m256i bytes = _mm256_set1_epi64x(0x00FF00FF00FF00FFll);
    const __m256i pairs_mask = _mm256_set1_epi64x(0x0000FFFF0000FFFFll);
    __m256i a = _mm256_and_si256(w, bytes), b = _mm256_and_si256(_mm256_srli_epi64(w, 8), bytes);
    __m256i pairs = _mm256_add_epi64(_mm256_sub_epi64(_mm256_slli_epi64(a, 5), a), b);
    __m256i c = _mm256_and_si256(pairs, pairs_mask), d = _mm256_and_si256(_mm256_srli_epi64(pairs, 16), pairs_mask);
    __m256i quads = _mm256_add_epi32(_mm256_mullo_epi32(c, _mm256_set1_epi32(961)), d);
    return _mm256_add_epi32(_mm256_mullo_epi32(quads, _mm256_set1_epi32((int)KG_P4)), _mm256_srli_epi64(quads, 32));
}

static const long long kg_pow31_table[9] = {1, 31, 961, 29791, 923521, 28629151, 887503681, KG_P7, KG_P8};

#define KG_DEFINE_UTF8_X4(NAME, OFFSET_T, LOAD_OFFSETS, SCALAR_RUN)                                                  \
    __attribute__((target("avx2"))) static Py_ssize_t NAME(const OFFSET_T *offsets, Py_ssize_t n,                    \
                                                          Py_ssize_t readable, const uint8_t *data,                  \
                                                          int64_t data_len, int32_t *out, int *status) {             \
        const __m256i high_bits = _mm256_set1_epi64x((long long)0x8080808080808080ull);                              \
        const __m256i zero = _mm256_setzero_si256(), eight = _mm256_set1_epi64x(8), seven = _mm256_set1_epi64x(7);   \
        const __m256i sixteen = _mm256_set1_epi64x(16), limit = _mm256_set1_epi64x(data_len);                        \
        const __m256i low_words = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);                                         \
        const long long *words = (const long long *)(const void *)data;                                              \
        Py_ssize_t i = 0;                                                                                            \
        for (; i + 4 <= n; i += 4) {                                                                                 \
            if (i + 256 <= readable) {                                                                               \
                int64_t ahead = (int64_t)offsets[i + 256];                                                           \
                if (ahead >= 0 && ahead < data_len) _mm_prefetch((const char *)(data + ahead), _MM_HINT_T0);         \
            }                                                                                                        \
            __m256i start = LOAD_OFFSETS(offsets + i), end = LOAD_OFFSETS(offsets + i + 1);                          \
            __m256i len = _mm256_sub_epi64(end, start);                                                              \
            __m256i bad = _mm256_or_si256(_mm256_or_si256(_mm256_cmpgt_epi64(zero, start),                           \
                                                          _mm256_cmpgt_epi64(zero, len)),                            \
                                          _mm256_or_si256(_mm256_cmpgt_epi64(end, limit),                            \
                                                          _mm256_cmpgt_epi64(eight, end)));                          \
            bad = _mm256_or_si256(bad, _mm256_cmpgt_epi64(len, sixteen));                                            \
            if (_mm256_testz_si256(bad, bad)) {                                                                      \
                __m256i long8 = _mm256_cmpgt_epi64(len, seven);                                                      \
                __m256i head = _mm256_mask_i64gather_epi64(zero, words, start, long8, 1);                            \
                __m256i tail = _mm256_i64gather_epi64(words, _mm256_sub_epi64(end, eight), 1);                       \
                __m256i drop = _mm256_blendv_epi8(_mm256_sub_epi64(eight, len), _mm256_sub_epi64(sixteen, len),      \
                                                  long8);                                                            \
                __m256i bits = _mm256_slli_epi64(drop, 3);                                                           \
                tail = _mm256_sllv_epi64(_mm256_srlv_epi64(tail, bits), bits);                                       \
                if (_mm256_testz_si256(_mm256_or_si256(head, tail), high_bits)) {                                    \
                    __m256i index = _mm256_and_si256(_mm256_sub_epi64(len, eight), long8);                           \
                    __m256i power = _mm256_i64gather_epi64(kg_pow31_table, index, 8);                                \
                    __m256i h = _mm256_add_epi32(_mm256_mullo_epi32(kg_poly8_x4(head), power), kg_poly8_x4(tail));   \
                    _mm_storeu_si128((__m128i *)(out + i),                                                           \
                                     _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(h, low_words)));             \
                    continue;                                                                                        \
                }                                                                                                    \
            }                                                                                                        \
            Py_ssize_t failed = SCALAR_RUN(offsets, i, i + 4, data, data_len, 1, out, status);                       \
            if (failed >= 0) return failed;                                                                          \
        }                                                                                                            \
        return SCALAR_RUN(offsets, i, n, data, data_len, 1, out, status);                                            \
    }
#define KG_LOAD4_OFFSETS32(p) _mm256_cvtepi32_epi64(_mm_loadu_si128((const __m128i *)(p)))
#define KG_LOAD4_OFFSETS64(p) _mm256_loadu_si256((const __m256i *)(p))
KG_DEFINE_UTF8_X4(kg_hashes_utf8_x4_32, int32_t, KG_LOAD4_OFFSETS32, kg_scalar_run32)
KG_DEFINE_UTF8_X4(kg_hashes_utf8_x4_64, int64_t, KG_LOAD4_OFFSETS64, kg_scalar_run64)
/* `readable`: how many values offsets[] describes from here on (more than n inside a block), for the prefetch. */
#define KG_TRY_SIMD_UTF8(WIDTH, offsets, n, readable, data, data_len, out, status)                                   \
    switch (kg_simd_available()) {                                                                                   \
    case 2: return kg_hashes_utf8_x8_##WIDTH(offsets, n, readable, data, data_len, out, status);                     \
    case 1: return kg_hashes_utf8_x4_##WIDTH(offsets, n, readable, data, data_len, out, status);                     \
    default: break;                                                                                                  \
    }

/* ---- key groups of int64 keys and of Java hashes: sixteen at a time (AVX-512, or AVX2 in two halves) --------------
 * The scalar loop runs near the speed of memory while the data is in cache, but on arrays larger than the cache the
 * compiler's own vectorization (64-bit loads, then 32-bit lanes) leaves it short. These kernels do the same arithmetic
 * in 32-bit lanes: Long.hashCode folds each 64-bit key with one shift and one xor, then one permute packs sixteen
 * folded keys into one register; murmur, the sign rule and the modulo follow lane by lane, exactly as kg_murmur and
 * kg_mod do (the modulo's double quotient is the same IEEE product, truncated the same way), and sixteen int16 key
 * groups are stored at once. The last n % 16 keys go through the scalar loop. */
__attribute__((target("avx512f"))) static inline __m512i kg_murmur_x16(__m512i h) {
    h = _mm512_rol_epi32(_mm512_mullo_epi32(h, _mm512_set1_epi32((int)KG_MURMUR_C1)), 15);
    h = _mm512_rol_epi32(_mm512_mullo_epi32(h, _mm512_set1_epi32((int)KG_MURMUR_C2)), 13);
    /* h * 5 + C3, as (h << 2) + h + C3 */
    h = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(h, 2), h), _mm512_set1_epi32((int)KG_MURMUR_C3));
    h = _mm512_xor_si512(h, _mm512_set1_epi32(4));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)KG_MURMUR_F1));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)KG_MURMUR_F2));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    /* Flink's sign rule: |h|, where |MIN_VALUE| wraps to 2^31 and the mask makes it 0 */
    return _mm512_and_si512(_mm512_abs_epi32(h), _mm512_set1_epi32(0x7fffffff));
}

/* kg_mod of sixteen lanes (0 <= x < 2^31), for a max parallelism that is not a power of two. */
__attribute__((target("avx512f"))) static inline __m512i kg_mod_x16(__m512i x, __m512i d, __m512d inv) {
    __m256i q_lo = _mm512_cvttpd_epi32(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(x)), inv));
    __m256i q_hi = _mm512_cvttpd_epi32(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(x, 1)), inv));
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q_lo), q_hi, 1);
    __m512i r = _mm512_sub_epi32(x, _mm512_mullo_epi32(q, d));
    r = _mm512_mask_add_epi32(r, _mm512_cmplt_epi32_mask(r, _mm512_setzero_si512()), r, d);
    return _mm512_mask_sub_epi32(r, _mm512_cmpge_epi32_mask(r, d), r, d);
}

/* Sixteen 64-bit keys from p as their sixteen Long.hashCode()s: (v ^ v >> 32), the low half of each lane. */
__attribute__((target("avx512f"))) static inline __m512i kg_hash_long_x16(const int64_t *p) {
    const __m512i low_halves = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    __m512i a = _mm512_loadu_si512((const void *)p), b = _mm512_loadu_si512((const void *)(p + 8));
    a = _mm512_xor_si512(a, _mm512_srli_epi64(a, 32));
    b = _mm512_xor_si512(b, _mm512_srli_epi64(b, 32));
    return _mm512_permutex2var_epi32(a, low_halves, b);
}

#define KG_DEFINE_GROUPS_X16(NAME, IN_T, LOAD16, SCALAR)                                                             \
    __attribute__((target("avx512f"))) static void NAME(const IN_T *in, Py_ssize_t n, int32_t maxp, int16_t *out) {  \
        const __m512i d = _mm512_set1_epi32(maxp), mask = _mm512_set1_epi32(maxp - 1);                              \
        const __m512d inv = _mm512_set1_pd(1.0 / (double)maxp);                                                     \
        const int power_of_two = (maxp & (maxp - 1)) == 0;                                                           \
        Py_ssize_t i = 0;                                                                                            \
        for (; i + 16 <= n; i += 16) {                                                                               \
            __m512i m = kg_murmur_x16(LOAD16(in + i));                                                               \
            m = power_of_two ? _mm512_and_si512(m, mask) : kg_mod_x16(m, d, inv);                                    \
            _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(m));                                     \
        }                                                                                                            \
        SCALAR(in + i, n - i, maxp, out + i);                                                                        \
    }
#define KG_LOAD16_HASHES(p) _mm512_loadu_si512((const void *)(p))
KG_DEFINE_GROUPS_X16(kg_groups_from_int64_x16, int64_t, kg_hash_long_x16, kg_groups_from_int64_scalar)
KG_DEFINE_GROUPS_X16(kg_groups_from_hashes_x16, int32_t, KG_LOAD16_HASHES, kg_groups_from_hashes_scalar)

/* The same with AVX2: eight lanes per register, two registers per sixteen keys. */
__attribute__((target("avx2"))) static inline __m256i kg_rotl_x8(__m256i x, int r) {
    return _mm256_or_si256(_mm256_slli_epi32(x, r), _mm256_srli_epi32(x, 32 - r));
}

__attribute__((target("avx2"))) static inline __m256i kg_murmur_x8(__m256i h) {
    h = kg_rotl_x8(_mm256_mullo_epi32(h, _mm256_set1_epi32((int)KG_MURMUR_C1)), 15);
    h = kg_rotl_x8(_mm256_mullo_epi32(h, _mm256_set1_epi32((int)KG_MURMUR_C2)), 13);
    h = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(h, 2), h), _mm256_set1_epi32((int)KG_MURMUR_C3));
    h = _mm256_xor_si256(h, _mm256_set1_epi32(4));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)KG_MURMUR_F1));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)KG_MURMUR_F2));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    return _mm256_and_si256(_mm256_abs_epi32(h), _mm256_set1_epi32(0x7fffffff));
}

__attribute__((target("avx2"))) static inline __m256i kg_mod_x8(__m256i x, __m256i d, __m256d inv) {
    __m128i q_lo = _mm256_cvttpd_epi32(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(x)), inv));
    __m128i q_hi = _mm256_cvttpd_epi32(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(x, 1)), inv));
    __m256i r = _mm256_sub_epi32(x, _mm256_mullo_epi32(_mm256_set_m128i(q_hi, q_lo), d));
    r = _mm256_add_epi32(r, _mm256_and_si256(_mm256_srai_epi32(r, 31), d));
    return _mm256_sub_epi32(r, _mm256_and_si256(d, _mm256_cmpgt_epi32(r, _mm256_sub_epi32(d, _mm256_set1_epi32(1)))));
}

/* Eight 64-bit keys as their Long.hashCode()s: the low halves of the folded lanes come out of the in-lane shuffle
 * as keys 0 1 4 5 | 2 3 6 7, and the cross-lane permute puts them in order. */
__attribute__((target("avx2"))) static inline __m256i kg_hash_long_x8(const int64_t *p) {
    __m256i a = _mm256_loadu_si256((const __m256i *)p), b = _mm256_loadu_si256((const __m256i *)(p + 4));
    a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 32));
    b = _mm256_xor_si256(b, _mm256_srli_epi64(b, 32));
    __m256i low = _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b),
                                                        _MM_SHUFFLE(2, 0, 2, 0)));
    return _mm256_permute4x64_epi64(low, _MM_SHUFFLE(3, 1, 2, 0));
}

#define KG_DEFINE_GROUPS_X8(NAME, IN_T, LOAD8, SCALAR)                                                               \
    __attribute__((target("avx2"))) static void NAME(const IN_T *in, Py_ssize_t n, int32_t maxp, int16_t *out) {     \
        const __m256i d = _mm256_set1_epi32(maxp), mask = _mm256_set1_epi32(maxp - 1);                              \
        const __m256d inv = _mm256_set1_pd(1.0 / (double)maxp);                                                      \
        const int power_of_two = (maxp & (maxp - 1)) == 0;                                                           \
        Py_ssize_t i = 0;                                                                                            \
        for (; i + 16 <= n; i += 16) {                                                                               \
            __m256i a = kg_murmur_x8(LOAD8(in + i)), b = kg_murmur_x8(LOAD8(in + i + 8));                            \
            if (power_of_two) {                                                                                      \
                a = _mm256_and_si256(a, mask);                                                                       \
                b = _mm256_and_si256(b, mask);                                                                       \
            } else {                                                                                                 \
                a = kg_mod_x8(a, d, inv);                                                                            \
                b = kg_mod_x8(b, d, inv);                                                                            \
            }                                                                                                        \
            /* key groups are below 2^15, so the saturating pack is exact; it interleaves a and b by 128-bit lane */ \
            __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), _MM_SHUFFLE(3, 1, 2, 0));            \
            _mm256_storeu_si256((__m256i *)(out + i), packed);                                                       \
        }                                                                                                            \
        SCALAR(in + i, n - i, maxp, out + i);                                                                        \
    }
#define KG_LOAD8_HASHES(p) _mm256_loadu_si256((const __m256i *)(p))
KG_DEFINE_GROUPS_X8(kg_groups_from_int64_x8, int64_t, kg_hash_long_x8, kg_groups_from_int64_scalar)
KG_DEFINE_GROUPS_X8(kg_groups_from_hashes_x8, int32_t, KG_LOAD8_HASHES, kg_groups_from_hashes_scalar)
#define KG_TRY_SIMD_GROUPS(KIND, in, n, maxp, out)                                                                   \
    switch (kg_simd_available()) {                                                                                   \
    case 2: kg_groups_from_##KIND##_x16(in, n, maxp, out); return;                                                   \
    case 1: kg_groups_from_##KIND##_x8(in, n, maxp, out); return;                                                    \
    default: break;                                                                                                  \
    }
#else
#define KG_HAVE_SIMD 0
static int kg_simd_allowed = 0;
static int kg_simd_available(void) { return 0; }
#define KG_TRY_SIMD_UTF8(WIDTH, offsets, n, readable, data, data_len, out, status)
#define KG_TRY_SIMD_GROUPS(KIND, in, n, maxp, out)
#endif

/* Key groups of int64 keys (hashed as java.lang.Long) and of Java hashes (also int32 keys: Integer.hashCode() is the
 * value): the widest vector kernel allowed, else the scalar loop. */
static void kg_groups_from_int64(const int64_t *in, Py_ssize_t n, int32_t maxp, int16_t *out) {
    KG_TRY_SIMD_GROUPS(int64, in, n, maxp, out)
    kg_groups_from_int64_scalar(in, n, maxp, out);
}

static void kg_groups_from_hashes(const int32_t *hashes, Py_ssize_t n, int32_t maxp, int16_t *out) {
    KG_TRY_SIMD_GROUPS(hashes, hashes, n, maxp, out)
    kg_groups_from_hashes_scalar(hashes, n, maxp, out);
}

/* Hashes of Arrow variable-length values: value i is data[offsets[i], offsets[i+1]), each offset checked against the
 * data buffer first. Returns -1 when all is well; otherwise the index of the first bad value, with *status 1 for
 * offsets outside the buffer and 2 for a string that is not UTF-8. */
#define KG_DEFINE_VAR_BINARY(NAME, OFFSET_T, WIDTH)                                                                  \
    static Py_ssize_t NAME##_ahead(const OFFSET_T *offsets, Py_ssize_t n, Py_ssize_t readable, const uint8_t *data,  \
                                   int64_t data_len, int utf8, int32_t *out, int *status) {                          \
        if (utf8) { KG_TRY_SIMD_UTF8(WIDTH, offsets, n, readable, data, data_len, out, status) }                     \
        return kg_scalar_run##WIDTH(offsets, 0, n, data, data_len, utf8, out, status);                               \
    }                                                                                                                \
    static Py_ssize_t NAME(const OFFSET_T *offsets, Py_ssize_t n, const uint8_t *data, int64_t data_len, int utf8,   \
                           int32_t *out, int *status) {                                                              \
        return NAME##_ahead(offsets, n, n, data, data_len, utf8, out, status);                                       \
    }                                                                                                                \
    /* Key groups straight away: hashes go through a small cache-resident block, so no int32 array of n hashes is    \
     * ever written (and page-faulted in), and the murmur/modulo pass over each block stays vectorized. */           \
    static Py_ssize_t NAME##_groups(const OFFSET_T *offsets, Py_ssize_t n, const uint8_t *data, int64_t data_len,    \
                                    int utf8, int32_t maxp, int16_t *out, int *status) {                             \
        int32_t block[1024];                                                                                         \
        for (Py_ssize_t base = 0; base < n; base += 1024) {                                                          \
            Py_ssize_t m = n - base < 1024 ? n - base : 1024;                                                        \
            Py_ssize_t bad = NAME##_ahead(offsets + base, m, n - base, data, data_len, utf8, block, status);         \
            if (bad >= 0) return base + bad;                                                                         \
            kg_groups_from_hashes(block, m, maxp, out + base);                                                       \
        }                                                                                                            \
        return -1;                                                                                                   \
    }
KG_DEFINE_VAR_BINARY(kg_hashes_var_binary32, int32_t, 32)
KG_DEFINE_VAR_BINARY(kg_hashes_var_binary64, int64_t, 64)

#endif
