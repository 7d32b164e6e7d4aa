/* The bf16 elementwise math of a CPU training step, one pass each on torch's OpenMP threads: bf16 tensors (as their
 * 16 bits) in and out, float32 inside, each result rounded to nearest even once, as the formulas in fused.py round
 * it (x/rms rounded before the weight multiplies it, as HF does). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 4096 /* elements a task of the flat loops */

static inline float bf(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float v) { /* nearest even; the formulas give no NaN on finite inputs */
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* sigmoid(v) = 1 / (1 + e^-v) and 1 - sigmoid(v), each from e^-|v|, which never overflows (-ffast-math assumes no
 * infinities: e^100 taken as one made silu(-100) a NaN), and 1 - sigmoid(v) not as a difference (v·(1 - s) in the
 * gradient would multiply the difference's rounding error by v) */
static inline float sigmoid(float v, float *complement) {
    const float e = expf(-fabsf(v)), r = 1.0f / (1.0f + e);
    *complement = (v >= 0.0f ? e : 1.0f) * r;
    return (v >= 0.0f ? 1.0f : e) * r;
}

/* y = weight · bf16(x / rms(x)) per row of n, rstd = 1 / rms(x) = 1 / sqrt(mean(x²) + eps) */
void rms_norm_forward(const uint16_t *x, const uint16_t *weight, float eps, uint16_t *y, float *rstd, int64_t rows,
                      int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n;
        uint16_t *yr = y + r * n;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; i++) squares += bf(xr[i]) * bf(xr[i]);
        /* in double: -ffast-math turns a float 1/sqrt into an estimate, which gives NaN where x² overflows */
        const float s = (float)(1.0 / sqrt((double)(squares / (float)n + eps)));
        rstd[r] = s;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) yr[i] = to_bf16(bf(to_bf16(bf(xr[i]) * s)) * bf(weight[i]));
    }
}

/* dx = (gw - x̂·mean(gw·x̂))·rstd per row, x̂ = x·rstd, gw = grad·weight */
void rms_norm_backward(const uint16_t *x, const uint16_t *weight, const float *rstd, const uint16_t *grad, uint16_t *dx,
                       int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n, *gr = grad + r * n;
        uint16_t *dr = dx + r * n;
        const float s = rstd[r];
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < n; i++) dot += bf(gr[i]) * bf(weight[i]) * (bf(xr[i]) * s);
        const float c = dot / (float)n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float x_hat = bf(xr[i]) * s;
            dr[i] = to_bf16((bf(gr[i]) * bf(weight[i]) - x_hat * c) * s);
        }
    }
}

/* the weight's gradient Σ_rows grad·x̂ in float32, each thread summing its own columns over every row */
void rms_norm_weight_grad(const uint16_t *x, const float *rstd, const uint16_t *grad, float *out, int64_t rows,
                          int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < n; c0 += 64) {
        const int64_t width = n - c0 < 64 ? n - c0 : 64;
        float sums[64] = {0};
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t *xr = x + r * n + c0, *gr = grad + r * n + c0;
            const float s = rstd[r];
#pragma omp simd
            for (int64_t i = 0; i < width; i++) sums[i] += bf(gr[i]) * (bf(xr[i]) * s);
        }
        memcpy(out + c0, sums, sizeof(float) * width);
    }
}

/* silu(g)·u */
void swiglu_forward(const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t count) {
#pragma omp parallel for schedule(static)
    for (int64_t start = 0; start < count; start += CHUNK) {
        const int64_t end = start + CHUNK < count ? start + CHUNK : count;
#pragma omp simd
        for (int64_t i = start; i < end; i++) {
            const float v = bf(g[i]);
            float complement;
            out[i] = to_bf16(v * sigmoid(v, &complement) * bf(u[i]));
        }
    }
}

/* d/dg = grad·u·silu'(g), silu'(g) = s·(1 + g·(1 - s)) with s = sigmoid(g); d/du = grad·silu(g) */
void swiglu_backward(const uint16_t *g, const uint16_t *u, const uint16_t *grad, uint16_t *dg, uint16_t *du,
                     int64_t count) {
#pragma omp parallel for schedule(static)
    for (int64_t start = 0; start < count; start += CHUNK) {
        const int64_t end = start + CHUNK < count ? start + CHUNK : count;
#pragma omp simd
        for (int64_t i = start; i < end; i++) {
            float complement;
            const float v = bf(g[i]), d = bf(grad[i]), s = sigmoid(v, &complement);
            dg[i] = to_bf16(d * bf(u[i]) * s * (1.0f + v * complement));
            du[i] = to_bf16(d * v * s);
        }
    }
}
