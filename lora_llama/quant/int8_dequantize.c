/* An int8 base's weight, codes times their row's scale, written in one pass: bf16 (rounded to nearest even, as
 * torch rounds float32 into bf16) or float32. Rows are shared among torch's OpenMP threads. */
#include <stdint.h>
#include <string.h>

static inline uint16_t bf16_nearest_even(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u); /* no NaN or infinity: int8 codes times a finite scale */
    return (uint16_t)(bits >> 16);
}

void int8_to_bf16(const int8_t *codes, const float *scales, uint16_t *out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *q = codes + r * cols;
        uint16_t *o = out + r * cols;
        const float s = scales[r];
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) o[c] = bf16_nearest_even((float)q[c] * s);
    }
}

void int8_to_float(const int8_t *codes, const float *scales, float *out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *q = codes + r * cols;
        float *o = out + r * cols;
        const float s = scales[r];
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) o[c] = (float)q[c] * s;
    }
}
