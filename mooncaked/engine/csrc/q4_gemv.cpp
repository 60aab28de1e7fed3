// y = x @ W.T for a weight on a Q4_1-style 4-bit grid (W[n, k] = d[n, b] * q[n, k] + m[n, b], b = k / 32),
// with fp32 activations and fp32 math: a decode step's few rows read 0.56 byte a weight and round nothing
// but the fp32 sums (torch's own int4 kernel takes bf16 activations and gives bf16 out; docs/performance.md).
//
// Layout: qp [N, K/2] uint8, byte j of a 32-input block holds q[j] (low nibble) and q[j + 16] (high);
// d, m [N, K/32] fp32; x [M, K] fp32 contiguous. Output rows are split over torch's own threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowsAtOnce = 4;  // activation rows sharing one unpacking of the weights

// rows [r0, r0 + nr) of x against output features [n0, n1)
void q4_rows(const float* x, const float* xsum, const uint8_t* qp, const float* d, const float* m, float* y,
             int64_t K, int64_t N, int64_t r0, int64_t nr, int64_t n0, int64_t n1) {
  const int64_t blocks = K / kGroup;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[kRowsAtOnce];
    float offset[kRowsAtOnce];
    for (int64_t r = 0; r < nr; ++r) {
      acc[r] = _mm512_setzero_ps();
      offset[r] = 0.f;
    }
    const uint8_t* qn = qp + n * (K / 2);
    const float* dn = d + n * blocks;
    const float* mn = m + n * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + b * 16));
      const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low)));
      const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low)));
      const __m512 scale = _mm512_set1_ps(dn[b]);
      for (int64_t r = 0; r < nr; ++r) {
        const float* xr = x + (r0 + r) * K + b * kGroup;
        __m512 t = _mm512_mul_ps(q_lo, _mm512_loadu_ps(xr));
        t = _mm512_fmadd_ps(q_hi, _mm512_loadu_ps(xr + 16), t);
        acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
        offset[r] += mn[b] * xsum[(r0 + r) * blocks + b];
      }
    }
    for (int64_t r = 0; r < nr; ++r) y[(r0 + r) * N + n] = _mm512_reduce_add_ps(acc[r]) + offset[r];
  }
}

}  // namespace

torch::Tensor q4_linear(const torch::Tensor& x, const torch::Tensor& qp, const torch::Tensor& d,
                        const torch::Tensor& m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qp.size(0);
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(qp.scalar_type() == torch::kUInt8 && qp.is_contiguous() && qp.size(1) == K / 2, "qp: uint8 [N, K/2]");
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.size(0) == N && d.size(1) == K / kGroup,
              "d: fp32 [N, K/32]");
  TORCH_CHECK(m.scalar_type() == torch::kFloat32 && m.is_contiguous() && m.sizes() == d.sizes(), "m: like d");
  auto y = torch::empty({M, N}, x.options());
  const auto xsum = x.view({M, K / kGroup, kGroup}).sum(-1).contiguous();  // for the blocks' offsets
  const float* xp = x.data_ptr<float>();
  const float* sp = xsum.data_ptr<float>();
  const uint8_t* qpp = qp.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowsAtOnce) {
      q4_rows(xp, sp, qpp, dp, mp, yp, K, N, r0, std::min(kRowsAtOnce, M - r0), n0, n1);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("q4_linear", &q4_linear, "x @ W.T, W on a 4-bit grid, fp32 activations");
}
