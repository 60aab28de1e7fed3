// The Python module of our native kernels: one build, one .so (engine/native.py).
#include <torch/python.h>  // pybind11 and its tensor casters, lighter than torch/extension.h

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& d,
                        const at::Tensor& m);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor ctx_lens, double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                                double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul_bf16(const at::Tensor& gu);
std::tuple<at::Tensor, at::Tensor> qkv_rotary_bf16(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                                   int64_t rotated_heads, int64_t head_dim);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("q4_linear", &q4_linear, "x @ W.T, W on a 4-bit grid, fp32 activations");
  module.def("paged_decode_attention", &paged_decode_attention,
             "decode attention read in place from the paged KV cache, fp32");
  module.def("rms_norm", &rms_norm, "RMSNorm of fp32 rows in one pass");
  module.def("add_rms_norm", &add_rms_norm, "(x + r, RMSNorm(x + r)) in one pass");
  module.def("rotary", &rotary, "the rotary embedding, half-split layout, signed full-width sin");
  module.def("silu_mul_bf16", &silu_mul_bf16, "bf16(silu(gate) * up) of a bf16 gate|up, fp32 math");
  module.def("qkv_rotary_bf16", &qkv_rotary_bf16, "rotated q|k and v in fp32 from a bf16 qkv");
}
