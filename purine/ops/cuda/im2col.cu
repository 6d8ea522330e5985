// im2col / col2im for a chunk of `num` whole samples in the "cols" layout: a
// (channels * kernel_h * kernel_w, num * out_h * out_w) matrix whose row (c, ki, kj) holds
// input channel c under kernel tap (ki, kj) for every output pixel of every sample, so
// group k of a grouped convolution owns the k-th block of rows (Caffe's order).
// T and PURINE_LOOP come from the loader's prelude.

// One thread per column entry: consecutive threads write consecutive output pixels.
extern "C" __global__ void im2col(
    const long long n, const T* __restrict__ x, T* __restrict__ col, const int num,
    const int channels, const int height, const int width, const int kernel_h,
    const int kernel_w, const int stride_h, const int stride_w, const int pad_h,
    const int pad_w, const int dilation_h, const int dilation_w, const int out_h,
    const int out_w)
{
    const long long plane = (long long)out_h * out_w;
    const long long cols = (long long)num * plane;
    PURINE_LOOP(i, n) {
        const long long q = i % cols;
        const long long r = i / cols;
        const long long s = q / plane;
        const int p = (int)(q % plane);
        const int oh = p / out_w;
        const int ow = p % out_w;
        const int kj = (int)(r % kernel_w);
        const int ki = (int)((r / kernel_w) % kernel_h);
        const long long c = r / ((long long)kernel_w * kernel_h);
        const int h = oh * stride_h - pad_h + ki * dilation_h;
        const int w = ow * stride_w - pad_w + kj * dilation_w;
        T v = (T)0;
        if (h >= 0 && h < height && w >= 0 && w < width) {
            v = x[((s * channels + c) * height + h) * width + w];
        }
        col[i] = v;
    }
}

// The adjoint of im2col as a gather: one thread per input pixel sums the column entries
// that read it (taps ki outer, kj inner), so no two threads write one element.
extern "C" __global__ void col2im(
    const long long n, const T* __restrict__ col, T* __restrict__ x, const int num,
    const int channels, const int height, const int width, const int kernel_h,
    const int kernel_w, const int stride_h, const int stride_w, const int pad_h,
    const int pad_w, const int dilation_h, const int dilation_w, const int out_h,
    const int out_w)
{
    const long long plane = (long long)out_h * out_w;
    const long long cols = (long long)num * plane;
    PURINE_LOOP(i, n) {
        const int w = (int)(i % width);
        const int h = (int)((i / width) % height);
        const long long c = (i / ((long long)width * height)) % channels;
        const long long s = i / ((long long)width * height * channels);
        const T* base = col + s * plane;
        T sum = (T)0;
        for (int ki = 0; ki < kernel_h; ++ki) {
            const int hh = h + pad_h - ki * dilation_h;
            if (hh < 0) break;  // hh only falls as ki grows
            if (hh % stride_h != 0) continue;
            const int oh = hh / stride_h;
            if (oh >= out_h) continue;
            for (int kj = 0; kj < kernel_w; ++kj) {
                const int ww = w + pad_w - kj * dilation_w;
                if (ww < 0) break;
                if (ww % stride_w != 0) continue;
                const int ow = ww / stride_w;
                if (ow >= out_w) continue;
                const long long row = (c * kernel_h + ki) * kernel_w + kj;
                sum += base[row * cols + (long long)oh * out_w + ow];
            }
        }
        x[i] = sum;
    }
}
