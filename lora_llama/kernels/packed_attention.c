// Causal attention over packed rows of short examples on the CPU, bf16 (or, built with FLOAT_IN, float32) in and
// out, float32 inside: one task is one example of one batch row and one key/value head with the REP query heads that
// share it. Scores are in base 2 (the caller folds log2(e) into c), the keys and values of a task are held as float32
// (transposed for the scores), and every product runs on 16-float vectors with the REP rows that share a load in
// registers. Given cos and sin, q and k are rotated (RoPE) as they are read and dq, dk rotated back as they are
// written. Built and loaded by packed_attention.py; `lse` is the base-2 log-sum-exp the backward recomputes the
// probabilities from.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64)));
#ifndef D
#define D 64  /* the head dimension, a multiple of 16 */
#endif
#ifndef REP
#define REP 3  /* query heads per key/value head */
#endif
#define NV (D / 16)

#ifdef FLOAT_IN
typedef float elem;  /* float32 tensors */
static inline float bf(elem x) { return x; }
static inline elem tobf(float f) { return f; }
#else
typedef uint16_t elem;  /* bf16 tensors, as their 16 bits */
static inline float bf(elem h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline elem tobf(float f) {  /* rounded to nearest even */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (elem)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1); return (elem)(u >> 16);
}
#endif
static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, 64); return v; }
static inline void st(float* p, v16 v) { memcpy(p, &v, 64); }
typedef int32_t v16i __attribute__((vector_size(64)));

/* 2^x of 16 floats x <= ~0 (scores less their maximum or log-sum-exp) in registers, where gcc leaves a loop of exp2f
   calls scalar (the backward's, 20% of its time): x = n + f, n an integer, |f| <= 1/2, 2^f by Cephes' exp2f
   polynomial (relative error ~2e-7); 0 below 2^-126 */
static inline v16 exp2v(v16 x) {
    v16i under = x < -126.0f;
    x = (v16)(((v16i)x & ~under) | ((v16i)(x * 0.0f - 126.0f) & under));
    v16i n = __builtin_convertvector(x - 0.5f, v16i);  /* rounded toward zero: x rounded to nearest for x <= 1/2 */
    v16 f = x - __builtin_convertvector(n, v16);
    v16 poly = 1.535336188319500e-4f * f + 1.339887440266574e-3f;
    poly = poly * f + 9.618437357674640e-3f;
    poly = poly * f + 5.550332471162809e-2f;
    poly = poly * f + 2.402264791363012e-1f;
    poly = poly * f + 6.931472028550421e-1f;
    v16 y = (v16)((v16i)(1.0f + f * poly) + (n << 23));
    return (v16)((v16i)y & ~under);
}

/* RoPE at one position, in HF's layout (each half rotated with the other, cos and sin equal in both halves):
   y = x·cos + rotate_half(x)·sin; sign -1 rotates back (a gradient). cs NULL: no rotation. y may be x. */
static inline void rope(float* y, const float* x, const elem* cs, const elem* sn, float sign) {
    if (!cs) { if (y != x) memcpy(y, x, sizeof(float) * D); return; }
    for (int64_t i = 0; i < D / 2; i++) {
        float a = x[i], b = x[i + D / 2], c = bf(cs[i]), s = bf(sn[i]) * sign;
        y[i] = a * c - b * s; y[i + D / 2] = b * c + a * s;
    }
}
/* cos and sin at batch row b, position t (rs: their strides), or NULL without RoPE */
#define COS(b, t) (cs ? cs + (b) * rs[0] + (t) * rs[1] : NULL)
#define SIN(b, t) (cs ? sn + (b) * rs[0] + (t) * rs[1] : NULL)

static int forward_tasks(const elem* q, const elem* k, const elem* v, elem* out, float* lse,
                    const int64_t* tasks, int64_t t0, int64_t t1, float c,
                    const int64_t* qs, const int64_t* ks, const int64_t* vs, const int64_t* os, const int64_t* ls,
                    const elem* cs, const elem* sn, const int64_t* rs) {
    for (int64_t task = t0; task < t1; task++) {
        int64_t b = tasks[4 * task], g = tasks[4 * task + 1], s = tasks[4 * task + 2], L = tasks[4 * task + 3];
        int64_t Lp = (L + 15) / 16 * 16;
        float* kt = aligned_alloc(64, sizeof(float) * (D * Lp + Lp * D + REP * Lp));
        if (!kt) return 1;
        float *vr = kt + D * Lp, *p = vr + Lp * D;
        memset(kt, 0, sizeof(float) * D * Lp);
        for (int64_t j = 0; j < L; j++) {
            const elem *ks_ = k + b * ks[0] + g * ks[1] + (s + j) * ks[2], *vs_ = v + b * vs[0] + g * vs[1] + (s + j) * vs[2];
            float kx[D];
            for (int64_t x = 0; x < D; x++) { kx[x] = bf(ks_[x]); vr[j * D + x] = bf(vs_[x]); }
            rope(kx, kx, COS(b, s + j), SIN(b, s + j), 1.0f);
            for (int64_t x = 0; x < D; x++) kt[x * Lp + j] = kx[x];
        }
        for (int64_t i = 0; i < L; i++) {
            float qf[REP][D];
            for (int64_t r = 0; r < REP; r++) {
                const elem* src = q + b * qs[0] + (g * REP + r) * qs[1] + (s + i) * qs[2];
                for (int64_t x = 0; x < D; x++) qf[r][x] = bf(src[x]);
                rope(qf[r], qf[r], COS(b, s + i), SIN(b, s + i), 1.0f);
                for (int64_t x = 0; x < D; x++) qf[r][x] *= c;
            }
            int64_t n = i + 1, nb = (n + 15) / 16;
            for (int64_t jb = 0; jb < nb; jb++) {
                v16 acc[REP] = {0};
                const float* col = kt + jb * 16;
                for (int64_t x = 0; x < D; x++) {
                    v16 kv = ld(col + x * Lp);
                    for (int64_t r = 0; r < REP; r++) acc[r] += qf[r][x] * kv;
                }
                for (int64_t r = 0; r < REP; r++) st(p + r * Lp + jb * 16, acc[r]);
            }
            v16 o[REP][NV];
            float m[REP], sum[REP];
            for (int64_t r = 0; r < REP; r++) {
                float* pr = p + r * Lp; float mm = pr[0];
                for (int64_t j = 1; j < n; j++) mm = pr[j] > mm ? pr[j] : mm;
                float ss = 0.0f;
                v16 sums = {0};
                for (int64_t jb = 0; jb < nb; jb++) {
                    v16 e = exp2v(ld(pr + jb * 16) - mm);
                    for (int64_t u = n - jb * 16; u < 16; u++) e[u] = 0.0f;  /* keys past the query */
                    st(pr + jb * 16, e); sums += e;
                }
                for (int64_t u = 0; u < 16; u++) ss += sums[u];
                m[r] = mm; sum[r] = ss;
                for (int64_t cc = 0; cc < NV; cc++) o[r][cc] = (v16){0};
            }
            for (int64_t j = 0; j < n; j++) {
                v16 vj[NV];
                for (int64_t cc = 0; cc < NV; cc++) vj[cc] = ld(vr + j * D + cc * 16);
                for (int64_t r = 0; r < REP; r++) {
                    float w = p[r * Lp + j];
                    for (int64_t cc = 0; cc < NV; cc++) o[r][cc] += w * vj[cc];
                }
            }
            for (int64_t r = 0; r < REP; r++) {
                int64_t h = g * REP + r;
                elem* dst = out + b * os[0] + h * os[1] + (s + i) * os[2];
                float of[D]; float inv = 1.0f / sum[r];
                for (int64_t cc = 0; cc < NV; cc++) st(of + cc * 16, o[r][cc] * inv);
                for (int64_t x = 0; x < D; x++) dst[x] = tobf(of[x]);
                lse[b * ls[0] + h * ls[1] + (s + i) * ls[2]] = m[r] + log2f(sum[r]);
            }
        }
        free(kt);
    }
    return 0;
}

static int backward_tasks(const elem* q, const elem* k, const elem* v, const elem* out,
                     const elem* dout, const float* lse, elem* dq, elem* dk, elem* dv,
                     const int64_t* tasks, int64_t t0, int64_t t1, float c, float scale,
                     const int64_t* qs, const int64_t* ks, const int64_t* vs, const int64_t* os, const int64_t* gs,
                     const int64_t* ls, const int64_t* dqs, const int64_t* dks,
                     const elem* cs, const elem* sn, const int64_t* rs) {
    for (int64_t task = t0; task < t1; task++) {
        int64_t b = tasks[4 * task], g = tasks[4 * task + 1], s = tasks[4 * task + 2], L = tasks[4 * task + 3];
        int64_t Lp = (L + 15) / 16 * 16;
        float* kt = aligned_alloc(64, sizeof(float) * (2 * D * Lp + 3 * Lp * D + 2 * REP * Lp));
        if (!kt) return 1;
        float *vt = kt + D * Lp, *kr = vt + D * Lp, *gk = kr + Lp * D, *gv = gk + Lp * D, *p = gv + Lp * D;
        float* ds = p + REP * Lp;
        memset(kt, 0, sizeof(float) * 2 * D * Lp);
        memset(gk, 0, sizeof(float) * 2 * Lp * D);
        for (int64_t j = 0; j < L; j++) {
            const elem *ks_ = k + b * ks[0] + g * ks[1] + (s + j) * ks[2], *vs_ = v + b * vs[0] + g * vs[1] + (s + j) * vs[2];
            float* kx = kr + j * D;
            for (int64_t x = 0; x < D; x++) { kx[x] = bf(ks_[x]); vt[x * Lp + j] = bf(vs_[x]); }
            rope(kx, kx, COS(b, s + j), SIN(b, s + j), 1.0f);
            for (int64_t x = 0; x < D; x++) kt[x * Lp + j] = kx[x];
        }
        for (int64_t i = 0; i < L; i++) {
            const int64_t t = s + i, n = i + 1, nb = (n + 15) / 16;
            float qf[REP][D], gf[REP][D], delta[REP], l[REP];
            for (int64_t r = 0; r < REP; r++) {
                int64_t h = g * REP + r;
                const elem *qsrc = q + b * qs[0] + h * qs[1] + t * qs[2], *gsrc = dout + b * gs[0] + h * gs[1] + t * gs[2];
                const elem* osrc = out + b * os[0] + h * os[1] + t * os[2];
                float dl = 0.0f;
                for (int64_t x = 0; x < D; x++) { qf[r][x] = bf(qsrc[x]); gf[r][x] = bf(gsrc[x]); dl += gf[r][x] * bf(osrc[x]); }
                rope(qf[r], qf[r], COS(b, t), SIN(b, t), 1.0f);
                delta[r] = dl; l[r] = lse[b * ls[0] + h * ls[1] + t * ls[2]];
            }
            for (int64_t jb = 0; jb < nb; jb++) {
                v16 as[REP] = {0}, ap[REP] = {0};
                for (int64_t x = 0; x < D; x++) {
                    v16 kv = ld(kt + x * Lp + jb * 16), vv = ld(vt + x * Lp + jb * 16);
                    for (int64_t r = 0; r < REP; r++) { as[r] += (qf[r][x] * c) * kv; ap[r] += gf[r][x] * vv; }
                }
                for (int64_t r = 0; r < REP; r++) {
                    v16 pv = exp2v(as[r] - l[r]), dsv = pv * (ap[r] - delta[r]);
                    float *pr = p + r * Lp + jb * 16, *dr = ds + r * Lp + jb * 16;
                    st(pr, pv); st(dr, dsv);
                    for (int64_t u = n - jb * 16; u < 16; u++) pr[u] = dr[u] = 0.0f;  /* keys past the query */
                }
            }
            v16 aq[REP][NV];
            for (int64_t r = 0; r < REP; r++) for (int64_t cc = 0; cc < NV; cc++) aq[r][cc] = (v16){0};
            for (int64_t j = 0; j < n; j++) {
                v16 kj[NV];
                for (int64_t cc = 0; cc < NV; cc++) kj[cc] = ld(kr + j * D + cc * 16);
                for (int64_t r = 0; r < REP; r++) { float w = ds[r * Lp + j]; for (int64_t cc = 0; cc < NV; cc++) aq[r][cc] += w * kj[cc]; }
            }
            for (int64_t j = 0; j < n; j++) {
                for (int64_t cc = 0; cc < NV; cc++) {
                    v16 a = ld(gk + j * D + cc * 16), e = ld(gv + j * D + cc * 16);
                    for (int64_t r = 0; r < REP; r++) {
                        a += ds[r * Lp + j] * ld(qf[r] + cc * 16);
                        e += p[r * Lp + j] * ld(gf[r] + cc * 16);
                    }
                    st(gk + j * D + cc * 16, a); st(gv + j * D + cc * 16, e);
                }
            }
            for (int64_t r = 0; r < REP; r++) {
                elem* dst = dq + b * dqs[0] + (g * REP + r) * dqs[1] + t * dqs[2];
                float of[D];
                for (int64_t cc = 0; cc < NV; cc++) st(of + cc * 16, aq[r][cc] * scale);
                rope(of, of, COS(b, t), SIN(b, t), -1.0f);
                for (int64_t x = 0; x < D; x++) dst[x] = tobf(of[x]);
            }
        }
        for (int64_t j = 0; j < L; j++) {
            elem *kdst = dk + b * dks[0] + g * dks[1] + (s + j) * dks[2], *vdst = dv + b * dks[0] + g * dks[1] + (s + j) * dks[2];
            float* gkj = gk + j * D;
            for (int64_t x = 0; x < D; x++) { gkj[x] *= scale; vdst[x] = tobf(gv[j * D + x]); }
            rope(gkj, gkj, COS(b, s + j), SIN(b, s + j), -1.0f);
            for (int64_t x = 0; x < D; x++) kdst[x] = tobf(gkj[x]);
        }
        free(kt);
    }
    return 0;
}

/* The entry points: share i runs tasks bounds[i] .. bounds[i + 1] on a thread of an OpenMP team, the one torch's own
   products use (packed_attention.py links this library against the OpenMP runtime torch loaded): a second set of
   threads would compete with torch's, which spin a while after each product. Nonzero: out of memory. */
int packed_forward(const elem* q, const elem* k, const elem* v, elem* out, float* lse,
                   const int64_t* tasks, const int64_t* bounds, int64_t shares, float c,
                   const int64_t* qs, const int64_t* ks, const int64_t* vs, const int64_t* os, const int64_t* ls,
                   const elem* cs, const elem* sn, const int64_t* rs) {
#define FORWARD(i) forward_tasks(q, k, v, out, lse, tasks, bounds[i], bounds[(i) + 1], c, qs, ks, vs, os, ls, cs, sn, rs)
    int failed = 0;
#pragma omp parallel num_threads(shares) reduction(| : failed)
    for (int64_t i = omp_get_thread_num(); i < shares; i += omp_get_num_threads()) failed |= FORWARD(i);
    return failed;
}

int packed_backward(const elem* q, const elem* k, const elem* v, const elem* out,
                    const elem* dout, const float* lse, elem* dq, elem* dk, elem* dv,
                    const int64_t* tasks, const int64_t* bounds, int64_t shares, float c, float scale,
                    const int64_t* qs, const int64_t* ks, const int64_t* vs, const int64_t* os, const int64_t* gs,
                    const int64_t* ls, const int64_t* dqs, const int64_t* dks,
                    const elem* cs, const elem* sn, const int64_t* rs) {
#define BACKWARD(i) backward_tasks(q, k, v, out, dout, lse, dq, dk, dv, tasks, bounds[i], bounds[(i) + 1], c, scale, \
                                   qs, ks, vs, os, gs, ls, dqs, dks, cs, sn, rs)
    int failed = 0;
#pragma omp parallel num_threads(shares) reduction(| : failed)
    for (int64_t i = omp_get_thread_num(); i < shares; i += omp_get_num_threads()) failed |= BACKWARD(i);
    return failed;
}
