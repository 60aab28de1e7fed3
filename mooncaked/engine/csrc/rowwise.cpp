// The row-wise steps between a layer's matrix products, one pass over the rows each, fp32 math: RMSNorm
// (optionally after the residual add), the rotary embedding, and the MLP's silu(gate) * up.
//
// Why native: on CPU torch runs RMSNorm as six ops (pow, mean, add, rsqrt, mul, mul), our rotary as four
// (mul, roll, mul, add) and the bf16 path's MLP middle as four (to fp32, silu, mul, to bf16), each a pass
// over a [tokens, width] tensor; at a prefill of 2048 tokens or a decode batch of 16 those passes, not the
// math, are the time (docs/performance.md). The math is the reference's: y = w * (x / sqrt(mean(x^2) + eps));
// rotated = x * cos + x_rolled_half * sin (sin signed); h = bf16(silu(g) * u), silu(g) = g / (1 + exp(-g)).
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

// e^x to ~1 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n); past fp32's range
// it gives inf (as expf does), and below e^-87.3 that value, where a sigmoid no longer sees the difference
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// bf16 <-> fp32 by bits: widening is exact; narrowing rounds to nearest even, as torch's .to(bfloat16) does
inline __m512 bf16_to_fp32(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline void fp32_to_bf16(__m512 v, uint16_t* p) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return bf16_to_fp32(p); }

// one head of one token, x fp32 or bf16 (widened exactly): out[i] = x[i] * cos[i] + x[(i + D/2) % D] * sin[i],
// as two products and a sum (no FMA), the same roundings as the torch formula's
template <typename T>
inline void rotate_head(const T* x, const float* cos, const float* sin, float* out, int64_t half) {
  for (int64_t i = 0; i < half; i += kLanes) {
    const __m512 a = load16(x + i), b = load16(x + half + i);
    _mm512_storeu_ps(out + i, _mm512_add_ps(_mm512_mul_ps(a, _mm512_loadu_ps(cos + i)),
                                            _mm512_mul_ps(b, _mm512_loadu_ps(sin + i))));
    _mm512_storeu_ps(out + half + i, _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(cos + half + i)),
                                                   _mm512_mul_ps(a, _mm512_loadu_ps(sin + half + i))));
  }
}

void check_angles(const at::Tensor& cos, const at::Tensor& sin, int64_t T, int64_t D) {
  for (const auto& c : {cos, sin})
    TORCH_CHECK(c.dim() == 2 && c.scalar_type() == at::kFloat && c.is_contiguous() && c.size(0) == T && c.size(1) == D,
                "cos / sin: [T, D] fp32, contiguous");
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

// x [T, H, D] (rows may be strided: a view into the fused qkv output), cos / sin [T, D] full width, sin signed
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x: [T, H, D] fp32, heads contiguous");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(half % kLanes == 0, "head_dim must be a multiple of 32");
  check_angles(cos, sin, T, D);
  auto out = at::empty({T, H, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row = x.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < H; ++h) rotate_head(xp + t * row + h * D, cp + t * D, sp + t * D, op + (t * H + h) * D, half);
  });
  return out;
}

// gu [M, 2I] bf16 (gate | up, the fused projection's output) -> bf16(silu(gate) * up) [M, I], math in fp32:
// what the bf16 path computed as four passes (gate_up to fp32, silu, mul, and the down projection's cast)
at::Tensor silu_mul_bf16(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kBFloat16 && gu.is_contiguous(), "gate|up: [M, 2I] bf16, contiguous");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * I && I % kLanes == 0, "the intermediate size must be a multiple of 16");
  auto out = at::empty({M, I}, gu.options());
  const auto* gp = reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const uint16_t* g = gp + m * 2 * I;
      const uint16_t* u = g + I;
      for (int64_t i = 0; i < I; i += kLanes) {
        const __m512 gv = bf16_to_fp32(g + i), uv = bf16_to_fp32(u + i);
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        fp32_to_bf16(_mm512_mul_ps(silu, uv), op + m * I + i);
      }
    }
  });
  return out;
}

// qkv [T, (R + V) * D] bf16, the fused projection's output (R = query + key heads, V = value heads) -> (q|k
// rotated [T, R, D] fp32, v [T, V, D] fp32): the rotary embedding straight from bf16, the same math as
// rotary() after the bf16 path's cast to fp32 (which is exact), one pass instead of two
std::tuple<at::Tensor, at::Tensor> qkv_rotary_bf16(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                                   int64_t rotated_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous(), "qkv: [T, width] bf16, contiguous");
  const int64_t T = qkv.size(0), D = head_dim, half = D / 2, R = rotated_heads;
  TORCH_CHECK(D > 0 && half % kLanes == 0, "head_dim must be a multiple of 32");
  TORCH_CHECK(R > 0 && qkv.size(1) % D == 0 && qkv.size(1) / D > R, "qkv: more heads than the rotated ones");
  const int64_t V = qkv.size(1) / D - R;
  check_angles(cos, sin, T, D);
  auto qk = at::empty({T, R, D}, cos.options());
  auto v = at::empty({T, V, D}, cos.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>());
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = qk.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t width = qkv.size(1);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < R; ++h) rotate_head(xp + t * width + h * D, cp + t * D, sp + t * D, qp + (t * R + h) * D, half);
      const uint16_t* xv = xp + t * width + R * D;
      for (int64_t i = 0; i < V * D; i += kLanes) _mm512_storeu_ps(vp + t * V * D + i, bf16_to_fp32(xv + i));
    }
  });
  return {qk, v};
}
