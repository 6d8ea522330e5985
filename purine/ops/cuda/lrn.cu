// Caffe's LRN across channels, one thread per element, with the arithmetic of
// purine/ops/lrn.py in the same order: the window sum adds channel c, then c-1, c+1,
// c-2, c+2, ...; scale = sum * (alpha / size) + k; y = x * scale^-beta; backward
// dx = dy * scale^-beta - (2 alpha beta / size) * x * window_sum(dy * y / scale).
// T and PURINE_LOOP come from the loader's prelude.

// a^e, with square roots for the usual exponents (as the CPU's _power).
__device__ __forceinline__ T lrn_power(const T a, const T e)
{
    if (e == (T)-0.75) {
        T s = sqrt(a);
        s *= sqrt(s);
        return (T)1 / s;
    }
    if (e == (T)-0.5) return (T)1 / sqrt(a);
    if (e == (T)-1) return (T)1 / a;
    return pow(a, e);
}

extern "C" __global__ void lrn_across_forward(
    const long long n, const T* __restrict__ x, T* __restrict__ y, T* __restrict__ scale,
    const int channels, const long long plane, const int size, const T alpha_over_size,
    const T shift, const T neg_beta)
{
    const int half = (size - 1) / 2;
    PURINE_LOOP(i, n) {
        const int c = (int)((i / plane) % channels);
        const T* xc = x + (i - c * plane);  // channel 0 at this pixel
        const T v = xc[c * plane];
        T acc = v * v;
        for (int o = 1; o <= half; ++o) {
            if (c - o >= 0) {
                const T a = xc[(c - o) * plane];
                acc += a * a;
            }
            if (c + o < channels) {
                const T a = xc[(c + o) * plane];
                acc += a * a;
            }
        }
        T s = acc * alpha_over_size;
        s += shift;
        scale[i] = s;
        y[i] = v * lrn_power(s, neg_beta);
    }
}

extern "C" __global__ void lrn_across_backward(
    const long long n, const T* __restrict__ x, const T* __restrict__ y,
    const T* __restrict__ scale, const T* __restrict__ dy, T* __restrict__ dx,
    const int channels, const long long plane, const int size, const T neg_beta,
    const T coeff)
{
    const int half = (size - 1) / 2;
    PURINE_LOOP(i, n) {
        const int c = (int)((i / plane) % channels);
        const long long c0 = i - c * plane;
        T acc = dy[i] * y[i] / scale[i];
        for (int o = 1; o <= half; ++o) {
            if (c - o >= 0) {
                const long long j = c0 + (c - o) * plane;
                acc += dy[j] * y[j] / scale[j];
            }
            if (c + o < channels) {
                const long long j = c0 + (c + o) * plane;
                acc += dy[j] * y[j] / scale[j];
            }
        }
        acc *= x[i];
        acc *= coeff;
        dx[i] = dy[i] * lrn_power(scale[i], neg_beta) - acc;
    }
}
