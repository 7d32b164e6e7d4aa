/* A quantized base's weight written in one pass, on torch's OpenMP threads: bf16 (the float32 value rounded to
 * nearest even, as torch rounds it, subnormals kept) or float32.
 *
 * int8  codes times their row's scale
 * nf4   blocks of 64 weights in 32 bytes (high nibble first): the code's value in bitsandbytes' table times the block's
 *       absmax, looked up 16 (AVX-512) or 8 (AVX2) at a time in registers that hold the table times the absmax */
#include <stdint.h>
#include <string.h>

static inline uint16_t bf16_nearest_even(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u); /* no NaN or infinity: finite codes times a finite scale */
    return (uint16_t)(bits >> 16);
}

#define INT8_LOOP(name, type, convert)                                                                              \
    void name(const int8_t *codes, const float *scales, type *out, int64_t rows, int64_t cols) {                    \
        _Pragma("omp parallel for schedule(static)") for (int64_t r = 0; r < rows; r++) {                           \
            const int8_t *q = codes + r * cols;                                                                     \
            type *o = out + r * cols;                                                                               \
            const float s = scales[r];                                                                              \
            _Pragma("omp simd") for (int64_t c = 0; c < cols; c++) o[c] = convert((float)q[c] * s);                 \
        }                                                                                                           \
    }
#define AS_FLOAT(v) (v)
INT8_LOOP(int8_to_bf16, uint16_t, bf16_nearest_even)
INT8_LOOP(int8_to_float, float, AS_FLOAT)

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
typedef __m512i ivec;
static inline vec lookup(const vec table[2], const uint8_t *idx) {
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)idx)), table[0]);
}
static inline void scaled_table(vec table[2], const float *values, float s) {
    table[0] = _mm512_mul_ps(_mm512_loadu_ps(values), _mm512_set1_ps(s));
}
static inline void store_float(float *o, vec v) { _mm512_storeu_ps(o, v); }
static inline void store_bf16(uint16_t *o, vec v) {
    ivec b = _mm512_castps_si512(v);
    ivec odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(b));
}
#elif defined(__AVX2__)
#define LANES 8
typedef __m256 vec;
typedef __m256i ivec;
static inline vec lookup(const vec table[2], const uint8_t *idx) {
    ivec i = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)idx));
    vec low = _mm256_permutevar8x32_ps(table[0], i), high = _mm256_permutevar8x32_ps(table[1], i);
    return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28))); /* bit 3: the upper half */
}
static inline void scaled_table(vec table[2], const float *values, float s) {
    table[0] = _mm256_mul_ps(_mm256_loadu_ps(values), _mm256_set1_ps(s));
    table[1] = _mm256_mul_ps(_mm256_loadu_ps(values + 8), _mm256_set1_ps(s));
}
static inline void store_float(float *o, vec v) { _mm256_storeu_ps(o, v); }
static inline void store_bf16(uint16_t *o, vec v) {
    ivec b = _mm256_castps_si256(v);
    ivec odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    _mm_storeu_si128((__m128i *)o, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
#endif

/* the block's 64 code indices in order: each byte's high nibble, then its low one */
static inline void block_indices(const uint8_t *bytes, uint8_t idx[64]) {
#ifdef LANES
    for (int j = 0; j < 32; j += 16) {
        __m128i b = _mm_loadu_si128((const __m128i *)(bytes + j)), nibble = _mm_set1_epi8(15);
        __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), nibble), low = _mm_and_si128(b, nibble);
        _mm_storeu_si128((__m128i *)(idx + 2 * j), _mm_unpacklo_epi8(high, low));
        _mm_storeu_si128((__m128i *)(idx + 2 * j + 16), _mm_unpackhi_epi8(high, low));
    }
#else
    for (int j = 0; j < 32; j++) {
        idx[2 * j] = bytes[j] >> 4;
        idx[2 * j + 1] = bytes[j] & 15;
    }
#endif
}

#define NF4_LOOP(name, type, store, convert)                                                                        \
    void name(const uint8_t *codes, const float *absmax, const float *values, type *out, int64_t blocks) {          \
        _Pragma("omp parallel for schedule(static)") for (int64_t b = 0; b < blocks; b++) {                         \
            uint8_t idx[64];                                                                                        \
            block_indices(codes + b * 32, idx);                                                                     \
            NF4_BLOCK(type, store, convert)                                                                         \
        }                                                                                                           \
    }
#ifdef LANES
#define NF4_BLOCK(type, store, convert)                                                                             \
    vec table[2];                                                                                                   \
    scaled_table(table, values, absmax[b]);                                                                         \
    for (int j = 0; j < 64; j += LANES) store(out + b * 64 + j, lookup(table, idx + j));
#else
#define NF4_BLOCK(type, store, convert)                                                                             \
    for (int j = 0; j < 64; j++) out[b * 64 + j] = convert(values[idx[j]] * absmax[b]);
#endif
NF4_LOOP(nf4_to_bf16, uint16_t, store_bf16, bf16_nearest_even)
NF4_LOOP(nf4_to_float, float, store_float, AS_FLOAT)
