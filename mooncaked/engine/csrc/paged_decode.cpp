// Decode attention read in place from the paged KV cache, fp32: out[s, h] = softmax(scale * q[s, h] . K_s) @ V_s
// over the first ctx_lens[s] tokens of sequence s's blocks, K/V of KV head h / G (G query heads share one).
//
// Why native: torch's path gathers every sequence's blocks into a fresh copy per layer (index_select), zeroes
// the slots past each length and runs SDPA with a mask over the padded copy; at a batch of 16 that is a
// third of a decode step on CPU (docs/performance.md). Here each K/V row is read once, where it lies, for
// all the query heads that share it; slots past a length are never read, so a freed block's stale values cannot leak.
//
// Layout: q [S, H, D] fp32 contiguous; k_cache, v_cache [num_blocks, block_size, Hkv, D] fp32 contiguous;
// block_tables [S, max_blocks] int32; ctx_lens [S] int32. Sequences are split over torch's threads.
// ATen headers only (not torch/extension.h): a sixth of the compile time; module.cpp binds these
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

// One sequence, all its heads: its token rows (Hkv * D floats each, block_size of them contiguous per block)
// are read front to back, once for K and once for V, so the reads stream as a copy's would.
void one_sequence(const float* q, const float* k, const float* v, const int32_t* table, int64_t len, int64_t bs,
                  int64_t H, int64_t Hkv, int64_t D, float scale, float* scores, float* acc, float* out) {
  const int64_t G = H / Hkv, chunks = D / kLanes, row = Hkv * D;
  // pass 1: every query head's score of every token
  for (int64_t t = 0; t < len; ++t) {
    const float* kr = k + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * row;
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        const float* qh = q + (h * G + g) * D;
        const float* kp = kr + h * D;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(kp));
        for (int64_t c = 1; c < chunks; ++c)
          a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c * kLanes), _mm512_loadu_ps(kp + c * kLanes), a);
        scores[(h * G + g) * len + t] = _mm512_reduce_add_ps(a) * scale;
      }
    }
  }
  // softmax per query head, in place; its normaliser kept for the end
  std::vector<float> inv_sum(H);
  for (int64_t i = 0; i < H; ++i) {
    float* si = scores + i * len;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, si[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      si[t] = std::exp(si[t] - mx);
      sum += si[t];
    }
    inv_sum[i] = 1.f / sum;
  }
  // pass 2: the weighted sum of V rows, into acc [H, D]
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const float* vr = v + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * row;
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 vc = _mm512_loadu_ps(vr + h * D + c * kLanes);
        for (int64_t g = 0; g < G; ++g) {
          float* ap = acc + (h * G + g) * D + c * kLanes;
          _mm512_storeu_ps(ap, _mm512_fmadd_ps(_mm512_set1_ps(scores[(h * G + g) * len + t]), vc, _mm512_loadu_ps(ap)));
        }
      }
    }
  }
  for (int64_t i = 0; i < H; ++i) {
    const __m512 norm = _mm512_set1_ps(inv_sum[i]);
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_storeu_ps(out + i * D + c * kLanes, _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + c * kLanes), norm));
  }
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [S, H, D] fp32, contiguous");
  for (const auto& c : {k_cache, v_cache})
    TORCH_CHECK(c.dim() == 4 && c.scalar_type() == at::kFloat && c.is_contiguous(),
                "k/v cache: [blocks, block_size, Hkv, D] fp32, contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k and v caches differ in shape");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables: [S, max_blocks] int32, contiguous");
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.scalar_type() == at::kInt && ctx_lens.is_contiguous(),
              "ctx_lens: [S] int32, contiguous");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t blocks = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % kLanes == 0, "head_dim must match the cache and be a multiple of 16");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == S && ctx_lens.size(0) == S, "one block table and length per query row");
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = ctx_lens.data_ptr<int32_t>();
  int64_t longest = 0;
  for (int64_t s = 0; s < S; ++s) {  // every slot read must lie in the cache: checked before any work
    TORCH_CHECK(lens[s] > 0 && lens[s] <= max_blocks * bs, "sequence ", s, " has length ", lens[s],
                " outside its block table");
    for (int64_t b = 0; b < (lens[s] + bs - 1) / bs; ++b)
      TORCH_CHECK(tables[s * max_blocks + b] >= 0 && tables[s * max_blocks + b] < blocks, "block id out of range");
    longest = std::max<int64_t>(longest, lens[s]);
  }
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(H * longest), acc(H * D);
    for (int64_t s = begin; s < end; ++s)
      one_sequence(qp + s * H * D, kp, vp, tables + s * max_blocks, lens[s], bs, H, Hkv, D, sc, scores.data(),
                   acc.data(), op + s * H * D);
  });
  return out;
}
