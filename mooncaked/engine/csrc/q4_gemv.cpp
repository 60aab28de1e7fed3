// y = x @ W.T for a weight on a Q4_1-style 4-bit grid (W[n, k] = d[n, b] * q[n, k] + m[n, b], b = k / 32),
// with fp32 activations and fp32 math: a decode step's few rows read 0.56 byte a weight and round nothing
// but the weight (d * q + m, in one FMA) and the fp32 sums (torch's own int4 kernel takes bf16 activations
// and gives bf16 out; docs/performance.md).
//
// Layout: qp [N, K/2] uint8, byte j of a 32-input block holds q[j] (low nibble) and q[j + 16] (high);
// d, m [N, K/32] fp32; x [M, K] fp32 contiguous. Output rows are split over torch's own threads.
// ATen headers only (not torch/extension.h): a sixth of the compile time; module.cpp binds these
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 32;

// Rows [r0, r0 + R) of fp32 activations against output features [n0, n1): each block's 32 weights are rebuilt
// once in fp32 (d * q + m, one rounding) and multiplied into R rows at once, so a batch of decode rows reads
// the 4 bits once and spends its time in FMAs, not in reloading or unpacking weights.
template <int R>
void q4_rows_fp32(const float* x, const uint8_t* qp, const float* d, const float* m, float* y,
                  int64_t K, int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  const int64_t blocks = K / kGroup;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* qn = qp + n * (K / 2);
    const float* dn = d + n * blocks;
    const float* mn = m + n * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + b * 16));
      const __m512 scale = _mm512_set1_ps(dn[b]), offset = _mm512_set1_ps(mn[b]);
      const __m512 w_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low))), scale, offset);
      const __m512 w_hi = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low))), scale, offset);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + (r0 + r) * K + b * kGroup;
        acc[r] = _mm512_fmadd_ps(w_lo, _mm512_loadu_ps(xr), acc[r]);
        acc[r] = _mm512_fmadd_ps(w_hi, _mm512_loadu_ps(xr + 16), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[(r0 + r) * N + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

}  // namespace

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& d,
                        const at::Tensor& m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qp.size(0);
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(qp.scalar_type() == at::kByte && qp.is_contiguous() && qp.size(1) == K / 2, "qp: uint8 [N, K/2]");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.size(0) == N && d.size(1) == K / kGroup,
              "d: fp32 [N, K/32]");
  TORCH_CHECK(m.scalar_type() == at::kFloat && m.is_contiguous() && m.sizes() == d.sizes(), "m: like d");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qpp = qp.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    int64_t r0 = 0;
    for (; r0 + 16 <= M; r0 += 16) q4_rows_fp32<16>(xp, qpp, dp, mp, yp, K, N, r0, n0, n1);
    if (M - r0 >= 8) { q4_rows_fp32<8>(xp, qpp, dp, mp, yp, K, N, r0, n0, n1); r0 += 8; }
    if (M - r0 >= 4) { q4_rows_fp32<4>(xp, qpp, dp, mp, yp, K, N, r0, n0, n1); r0 += 4; }
    if (M - r0 >= 2) { q4_rows_fp32<2>(xp, qpp, dp, mp, yp, K, N, r0, n0, n1); r0 += 2; }
    if (M - r0 >= 1) q4_rows_fp32<1>(xp, qpp, dp, mp, yp, K, N, r0, n0, n1);
  });
  return y;
}

