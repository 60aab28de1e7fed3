// RMSNorm (optionally after the residual add) and the rotary embedding, one pass over the rows each, fp32.
//
// Why native: on CPU torch runs RMSNorm as six ops (pow, mean, add, rsqrt, mul, mul) and our rotary as four
// (mul, roll, mul, add), each a pass over a [tokens, width] tensor; at a prefill of 2048 tokens or a decode
// batch of 16 those passes, not the math, are the time (docs/performance.md). The math is the reference's,
// in fp32: y = w * (x / sqrt(mean(x^2) + eps)); rotated = x * cos + x_rolled_half * sin (sin signed).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <cmath>
#include <tuple>

namespace {

constexpr int64_t kLanes = 16;

// one row: out = w * x * rsqrt(mean(x^2) + eps); x may also be written as x + r first (the residual add)
inline void norm_row(const float* x, const float* r, float* h, const float* w, float* out, int64_t D, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += kLanes) {
    __m512 v = _mm512_loadu_ps(x + i);
    if (r != nullptr) {
      v = _mm512_add_ps(v, _mm512_loadu_ps(r + i));
      _mm512_storeu_ps(h + i, v);
    }
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(D) + eps);
  const float* src = r != nullptr ? h : x;
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < D; i += kLanes)
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_mul_ps(_mm512_loadu_ps(src + i), s)));
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [T, D] fp32, contiguous");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == x.size(1),
              "weight: [D] fp32");
  TORCH_CHECK(x.size(1) % kLanes == 0, "the width must be a multiple of 16");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  const int64_t T = x.size(0), D = x.size(1);
  auto out = at::empty({T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) norm_row(xp + t * D, nullptr, nullptr, wp, op + t * D, D, static_cast<float>(eps));
  });
  return out;
}

// (x + r, rms_norm(x + r)): the residual stream after a sublayer and the next sublayer's input, in one pass
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                                double eps) {
  check_rows(x, w);
  TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == at::kFloat && r.is_contiguous(), "residual: like x");
  const int64_t T = x.size(0), D = x.size(1);
  auto h = at::empty({T, D}, x.options());
  auto out = at::empty({T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = r.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      norm_row(xp + t * D, rp + t * D, hp + t * D, wp, op + t * D, D, static_cast<float>(eps));
  });
  return {h, out};
}

// x [T, H, D] (rows may be strided: a view into the fused qkv output), cos / sin [T, D] full width, sin
// signed: out[t, h, i] = x[i] * cos[i] + x[(i + D/2) % D] * sin[i], as two products and a sum (no FMA),
// the same roundings as the torch formula's
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x: [T, H, D] fp32, heads contiguous");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(half % kLanes == 0, "head_dim must be a multiple of 32");
  for (const auto& c : {cos, sin})
    TORCH_CHECK(c.dim() == 2 && c.scalar_type() == at::kFloat && c.is_contiguous() && c.size(0) == T && c.size(1) == D,
                "cos / sin: [T, D] fp32, contiguous");
  auto out = at::empty({T, H, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row = x.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* ct = cp + t * D;
      const float* st = sp + t * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* xh = xp + t * row + h * D;
        float* oh = op + (t * H + h) * D;
        for (int64_t i = 0; i < half; i += kLanes) {
          const __m512 a = _mm512_loadu_ps(xh + i), b = _mm512_loadu_ps(xh + half + i);
          _mm512_storeu_ps(oh + i, _mm512_add_ps(_mm512_mul_ps(a, _mm512_loadu_ps(ct + i)),
                                                 _mm512_mul_ps(b, _mm512_loadu_ps(st + i))));
          _mm512_storeu_ps(oh + half + i, _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(ct + half + i)),
                                                        _mm512_mul_ps(a, _mm512_loadu_ps(st + half + i))));
        }
      }
    }
  });
  return out;
}
