// Pooling, one thread per output element (forward) or per input element (backward, a
// gather over the windows that cover it). Semantics follow purine/ops/pooling.py: MAX
// windows are clipped to the image and keep the first maximum in scan order, a NaN makes
// the maximum NaN and freezes the argmax (as the CPU's running maximum does), a window
// wholly outside the image gives -FLT_MAX and argmax -1; the argmax is the plane index
// h * width + w. AVE divides by the window clipped to the padded extent (height + pad).
// T, PURINE_LOOP and PURINE_FLT_MAX come from the loader's prelude.

// Integer min / max spelled out, so the source needs no header under NVRTC.
__device__ __forceinline__ int imin(const int a, const int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(const int a, const int b) { return a > b ? a : b; }

// The window of output element i: its plane, its position, and its extent clipped to the
// image (h0 <= h < h1, w0 <= w < w1).
struct Window {
    long long plane;
    int ph, pw, h0, w0, h1, w1;
};

__device__ __forceinline__ Window window(const long long i, const int height, const int width,
                                         const int pooled_h, const int pooled_w,
                                         const int kernel_h, const int kernel_w,
                                         const int stride_h, const int stride_w,
                                         const int pad_h, const int pad_w)
{
    Window win;
    win.pw = (int)(i % pooled_w);
    win.ph = (int)((i / pooled_w) % pooled_h);
    win.plane = i / ((long long)pooled_w * pooled_h);
    const int hs = win.ph * stride_h - pad_h;
    const int ws = win.pw * stride_w - pad_w;
    win.h0 = imax(hs, 0);
    win.w0 = imax(ws, 0);
    win.h1 = imin(hs + kernel_h, height);
    win.w1 = imin(ws + kernel_w, width);
    return win;
}

template <typename M>
__device__ __forceinline__ void max_pool_forward_impl(
    const long long n, const T* __restrict__ x, T* __restrict__ y, M* __restrict__ mask,
    const int height, const int width, const int pooled_h, const int pooled_w,
    const int kernel_h, const int kernel_w, const int stride_h, const int stride_w,
    const int pad_h, const int pad_w)
{
    PURINE_LOOP(i, n) {
        const Window win = window(i, height, width, pooled_h, pooled_w, kernel_h, kernel_w,
                                  stride_h, stride_w, pad_h, pad_w);
        const int h0 = win.h0, w0 = win.w0, h1 = win.h1, w1 = win.w1;
        const T* xs = x + win.plane * height * width;
        T best = (T)(-PURINE_FLT_MAX);
        int arg = -1;
        for (int h = h0; h < h1; ++h) {
            for (int w = w0; w < w1; ++w) {
                const T v = xs[h * width + w];
                if (arg < 0 || v > best) {
                    best = v;
                    arg = h * width + w;
                } else if (v != v) {
                    best = v;
                }
            }
        }
        y[i] = best;
        mask[i] = (M)arg;
    }
}

extern "C" __global__ void max_pool_forward(
    const long long n, const T* __restrict__ x, T* __restrict__ y, int* __restrict__ mask,
    const int height, const int width, const int pooled_h, const int pooled_w,
    const int kernel_h, const int kernel_w, const int stride_h, const int stride_w,
    const int pad_h, const int pad_w)
{
    max_pool_forward_impl<int>(n, x, y, mask, height, width, pooled_h, pooled_w, kernel_h,
                               kernel_w, stride_h, stride_w, pad_h, pad_w);
}

// The same with the argmax stored as T (Caffe's optional second top).
extern "C" __global__ void max_pool_forward_tmask(
    const long long n, const T* __restrict__ x, T* __restrict__ y, T* __restrict__ mask,
    const int height, const int width, const int pooled_h, const int pooled_w,
    const int kernel_h, const int kernel_w, const int stride_h, const int stride_w,
    const int pad_h, const int pad_w)
{
    max_pool_forward_impl<T>(n, x, y, mask, height, width, pooled_h, pooled_w, kernel_h,
                             kernel_w, stride_h, stride_w, pad_h, pad_w);
}

// The first and one-past-last window index along one axis whose window covers `h`.
__device__ __forceinline__ void covering(const int h, const int pad, const int kernel,
                                         const int stride, const int pooled, int* first,
                                         int* last)
{
    *first = (h + pad < kernel) ? 0 : (h + pad - kernel) / stride + 1;
    *last = imin((h + pad) / stride + 1, pooled);
}

template <typename M>
__device__ __forceinline__ void max_pool_backward_impl(
    const long long n, const T* __restrict__ dy, const M* __restrict__ mask,
    T* __restrict__ dx, const int height, const int width, const int pooled_h,
    const int pooled_w, const int kernel_h, const int kernel_w, const int stride_h,
    const int stride_w, const int pad_h, const int pad_w)
{
    PURINE_LOOP(i, n) {
        const int w = (int)(i % width);
        const int h = (int)((i / width) % height);
        const long long plane = i / ((long long)width * height);
        int ph0, ph1, pw0, pw1;
        covering(h, pad_h, kernel_h, stride_h, pooled_h, &ph0, &ph1);
        covering(w, pad_w, kernel_w, stride_w, pooled_w, &pw0, &pw1);
        const long long offset = plane * pooled_h * pooled_w;
        const int index = h * width + w;
        T sum = (T)0;
        for (int ph = ph0; ph < ph1; ++ph) {
            for (int pw = pw0; pw < pw1; ++pw) {
                const long long o = offset + ph * pooled_w + pw;
                if ((int)mask[o] == index) sum += dy[o];
            }
        }
        dx[i] = sum;
    }
}

extern "C" __global__ void max_pool_backward(
    const long long n, const T* __restrict__ dy, const int* __restrict__ mask,
    T* __restrict__ dx, const int height, const int width, const int pooled_h,
    const int pooled_w, const int kernel_h, const int kernel_w, const int stride_h,
    const int stride_w, const int pad_h, const int pad_w)
{
    max_pool_backward_impl<int>(n, dy, mask, dx, height, width, pooled_h, pooled_w,
                                kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w);
}

extern "C" __global__ void max_pool_backward_tmask(
    const long long n, const T* __restrict__ dy, const T* __restrict__ mask,
    T* __restrict__ dx, const int height, const int width, const int pooled_h,
    const int pooled_w, const int kernel_h, const int kernel_w, const int stride_h,
    const int stride_w, const int pad_h, const int pad_w)
{
    max_pool_backward_impl<T>(n, dy, mask, dx, height, width, pooled_h, pooled_w,
                              kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w);
}

// Caffe's divisor: the window clipped to the padded image (a ceil-rounded last window's
// overhang does not count); 0 when the window starts at height + pad (0 / 0 = NaN, as
// Caffe computes it).
__device__ __forceinline__ int pool_size(const int ph, const int pw, const int height,
                                         const int width, const int kernel_h,
                                         const int kernel_w, const int stride_h,
                                         const int stride_w, const int pad_h,
                                         const int pad_w)
{
    const int hs = ph * stride_h - pad_h;
    const int ws = pw * stride_w - pad_w;
    const int he = imin(hs + kernel_h, height + pad_h);
    const int we = imin(ws + kernel_w, width + pad_w);
    return (he - hs) * (we - ws);
}

extern "C" __global__ void ave_pool_forward(
    const long long n, const T* __restrict__ x, T* __restrict__ y, const int height,
    const int width, const int pooled_h, const int pooled_w, const int kernel_h,
    const int kernel_w, const int stride_h, const int stride_w, const int pad_h,
    const int pad_w)
{
    PURINE_LOOP(i, n) {
        const Window win = window(i, height, width, pooled_h, pooled_w, kernel_h, kernel_w,
                                  stride_h, stride_w, pad_h, pad_w);
        const int h0 = win.h0, w0 = win.w0, h1 = win.h1, w1 = win.w1;
        const T* xs = x + win.plane * height * width;
        T sum = (T)0;
        for (int h = h0; h < h1; ++h) {
            for (int w = w0; w < w1; ++w) sum += xs[h * width + w];
        }
        y[i] = sum / (T)pool_size(win.ph, win.pw, height, width, kernel_h, kernel_w, stride_h,
                                  stride_w, pad_h, pad_w);
    }
}

extern "C" __global__ void ave_pool_backward(
    const long long n, const T* __restrict__ dy, T* __restrict__ dx, const int height,
    const int width, const int pooled_h, const int pooled_w, const int kernel_h,
    const int kernel_w, const int stride_h, const int stride_w, const int pad_h,
    const int pad_w)
{
    PURINE_LOOP(i, n) {
        const int w = (int)(i % width);
        const int h = (int)((i / width) % height);
        const long long plane = i / ((long long)width * height);
        int ph0, ph1, pw0, pw1;
        covering(h, pad_h, kernel_h, stride_h, pooled_h, &ph0, &ph1);
        covering(w, pad_w, kernel_w, stride_w, pooled_w, &pw0, &pw1);
        const T* d = dy + plane * pooled_h * pooled_w;
        T sum = (T)0;
        for (int ph = ph0; ph < ph1; ++ph) {
            for (int pw = pw0; pw < pw1; ++pw) {
                sum += d[ph * pooled_w + pw]
                       / (T)pool_size(ph, pw, height, width, kernel_h, kernel_w, stride_h,
                                      stride_w, pad_h, pad_w);
            }
        }
        dx[i] = sum;
    }
}
