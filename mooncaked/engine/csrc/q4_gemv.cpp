// y = x @ W.T for a weight on a Q4_1-style 4-bit grid (W[n, k] = d[n, b] * q[n, k] + m[n, b], b = k / 32),
// with fp32 activations and fp32 math: a decode step's rows read 0.56 byte a weight and round nothing but the
// weight (d * q + m, in one FMA) and the fp32 sums (torch's own int4 kernel takes bf16 activations and gives
// bf16 out; docs/performance.md).
//
// Layout, in tiles of 16 output features (n = 16 t + j): qt [N/16, K/2, 16] uint8, byte j of pair p holds
// q[n, 2p] (low nibble) and q[n, 2p + 1] (high); dt, mt [N/16, K/32, 16] fp32. A tile's 16 weights of one input
// are one vector: each is multiplied into every row by a broadcast activation and the sums land in 16 output
// features at once, so no horizontal sum is needed and the activations are read once per tile, not per feature
// (1.5-1.8x the per-feature layout at 1 to 16 rows; docs/performance.md). x [M, K] fp32 contiguous. Tiles are
// split over torch's own threads.
// ATen headers only (not torch/extension.h): a sixth of the compile time; module.cpp binds these
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;

// Rows [r0, r0 + R) against tiles [t0, t1). Each pair of inputs' weights is rebuilt once in fp32 (d * q + m, one
// rounding) and multiplied into R rows; with few rows, A accumulators a row keep the FMAs from waiting on one
// another (summed at the end).
template <int R, int A = (R >= 8 ? 1 : (R >= 4 ? 2 : (R >= 2 ? 4 : 8)))>
void q4_tile_rows(const float* x, const uint8_t* qt, const float* dt, const float* mt, float* y, int64_t K,
                  int64_t N, int64_t r0, int64_t t0, int64_t t1) {
  const int64_t blocks = K / kGroup;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[R * A];
    for (int i = 0; i < R * A; ++i) acc[i] = _mm512_setzero_ps();
    const uint8_t* qn = qt + t * (K / 2) * kTile;
    const float* dn = dt + t * blocks * kTile;
    const float* mn = mt + t * blocks * kTile;
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 scale = _mm512_loadu_ps(dn + b * kTile), offset = _mm512_loadu_ps(mn + b * kTile);
#pragma GCC unroll 16
      for (int p = 0; p < kGroup / 2; ++p) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + (b * kGroup / 2 + p) * kTile));
        const __m512 w0 =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low))), scale, offset);
        const __m512 w1 = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low))), scale, offset);
        const int64_t k = b * kGroup + 2 * p;
        for (int r = 0; r < R; ++r) {
          const float* xr = x + (r0 + r) * K + k;
          __m512& a0 = acc[r * A + (2 * p) % A];
          a0 = _mm512_fmadd_ps(w0, _mm512_set1_ps(xr[0]), a0);
          __m512& a1 = acc[r * A + (2 * p + 1) % A];
          a1 = _mm512_fmadd_ps(w1, _mm512_set1_ps(xr[1]), a1);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 sum = acc[r * A];
      for (int a = 1; a < A; ++a) sum = _mm512_add_ps(sum, acc[r * A + a]);
      _mm512_storeu_ps(y + (r0 + r) * N + t * kTile, sum);
    }
  }
}

}  // namespace

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qt, const at::Tensor& dt, const at::Tensor& mt) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(qt.dim() == 3 && qt.scalar_type() == at::kByte && qt.is_contiguous() && qt.size(1) == K / 2 &&
                  qt.size(2) == kTile,
              "qt: uint8 [N/16, K/2, 16]");
  const int64_t T = qt.size(0), N = T * kTile;
  TORCH_CHECK(dt.dim() == 3 && dt.scalar_type() == at::kFloat && dt.is_contiguous() && dt.size(0) == T &&
                  dt.size(1) == K / kGroup && dt.size(2) == kTile,
              "dt: fp32 [N/16, K/32, 16]");
  TORCH_CHECK(mt.scalar_type() == at::kFloat && mt.is_contiguous() && mt.sizes() == dt.sizes(), "mt: like dt");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qt.data_ptr<uint8_t>();
  const float* dp = dt.data_ptr<float>();
  const float* mp = mt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    int64_t r0 = 0;
    for (; r0 + 16 <= M; r0 += 16) q4_tile_rows<16>(xp, qp, dp, mp, yp, K, N, r0, t0, t1);
    switch (M - r0) {  // the rest in one pass: the weights are read once more, not once per power of two
#define MOONCAKED_ROWS(n) \
  case n:                 \
    q4_tile_rows<n>(xp, qp, dp, mp, yp, K, N, r0, t0, t1); \
    break;
      MOONCAKED_ROWS(1) MOONCAKED_ROWS(2) MOONCAKED_ROWS(3) MOONCAKED_ROWS(4) MOONCAKED_ROWS(5) MOONCAKED_ROWS(6)
      MOONCAKED_ROWS(7) MOONCAKED_ROWS(8) MOONCAKED_ROWS(9) MOONCAKED_ROWS(10) MOONCAKED_ROWS(11)
      MOONCAKED_ROWS(12) MOONCAKED_ROWS(13) MOONCAKED_ROWS(14) MOONCAKED_ROWS(15)
#undef MOONCAKED_ROWS
      default:
        break;
    }
  });
  return y;
}
