// One Llama-family decoder layer for a decode step of a few sequences, in one call.
//
// At one to a few rows a layer's arithmetic is small and the step's time goes to calling
// ~30 torch operators per layer from Python. Here the layer runs as the Python one does
// (engine/models/llama.py: DecoderLayer with a gated SiLU MLP), on its 4-bit weights
// (dot_linear.cpp), calling the other kernels of this folder directly:
//   h = rmsnorm(x) ; q, k, v = split(h @ Wqkv) ; [q, k = rmsnorm per head (Qwen3)]
//   q = rope(q), cache <- rope(k), v ; a = attention(q, cache) ; x = x + a @ Wo
//   h = rmsnorm(x) ; g, u = split(h @ Wgate_up) ; x = x + (silu(g) * u) @ Wdown
// Norms in float32 as the float32 path computes them (not bitwise: summation order).

#include <cmath>

#include "ops.h"

namespace {

// out[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps) for `rows` rows of `dim` (row stride
// `stride` in x, `dim` in out).
void rms_norm(const float* x, int64_t stride, const float* weight, float* out, int64_t rows,
              int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * stride;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; ++i) sum += row[i] * row[i];
    const float inverse = 1.f / std::sqrt(sum / static_cast<float>(dim) + static_cast<float>(eps));
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) out[r * dim + i] = weight[i] * (row[i] * inverse);
  }
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t dim = x.size(-1);
  auto rows = x.reshape({-1, dim});
  auto out = torch::empty({rows.size(0), dim}, x.options());
  rms_norm(rows.data_ptr<float>(), rows.stride(0), weight.data_ptr<float>(),
           out.data_ptr<float>(), rows.size(0), dim, eps);
  return out;
}

void check_norm(const torch::Tensor& weight, int64_t dim, const char* name) {
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                  weight.numel() == dim,
              name, " must be contiguous float32 [", dim, "]");
}

}  // namespace

// x [N, hidden] float32 -> the layer's output [N, hidden]; the new tokens' K/V are written
// to `kv_cache` (as rope_and_cache_kv does), attention reads it (as paged_decode_attention).
torch::Tensor decode_layer(
    const torch::Tensor& x, const torch::Tensor& input_norm, const torch::Tensor& post_norm,
    const torch::Tensor& qkv_packed, const torch::Tensor& qkv_scales,
    const c10::optional<torch::Tensor>& qkv_bias, const c10::optional<torch::Tensor>& q_norm,
    const c10::optional<torch::Tensor>& k_norm, const torch::Tensor& o_packed,
    const torch::Tensor& o_scales, const c10::optional<torch::Tensor>& o_bias,
    const torch::Tensor& gate_up_packed, const torch::Tensor& gate_up_scales,
    const c10::optional<torch::Tensor>& gate_up_bias, const torch::Tensor& down_packed,
    const torch::Tensor& down_scales, const c10::optional<torch::Tensor>& down_bias,
    const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& kv_cache,
    int64_t layer, const torch::Tensor& slot_block_ids, const torch::Tensor& slot_offsets,
    const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t num_heads,
    int64_t num_kv_heads, double scale, int64_t window, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be contiguous float32 [N, hidden]");
  const int64_t n = x.size(0), hidden = x.size(1);
  const int64_t head_dim = kv_cache.size(5);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(qkv_packed.size(0) == q_size + 2 * kv_size,
              "qkv must have num_heads + 2 * num_kv_heads heads of the cache's head_dim");
  TORCH_CHECK(gate_up_packed.size(0) % 2 == 0, "gate_up must hold gate and up rows");
  check_norm(input_norm, hidden, "input_norm");
  check_norm(post_norm, hidden, "post_norm");

  auto qkv = int4_linear(rms_norm(x, input_norm, eps), qkv_packed, qkv_scales, qkv_bias);
  auto q = qkv.narrow(1, 0, q_size).view({n, num_heads, head_dim});
  auto k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads, head_dim});
  auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, head_dim});
  if (q_norm.has_value() && q_norm->defined()) {
    TORCH_CHECK(k_norm.has_value() && k_norm->defined(), "q_norm and k_norm go together");
    check_norm(*q_norm, head_dim, "q_norm");
    check_norm(*k_norm, head_dim, "k_norm");
    q = rms_norm(q, *q_norm, eps).view({n, num_heads, head_dim});
    k = rms_norm(k, *k_norm, eps).view({n, num_kv_heads, head_dim});
  }
  q = rope_and_cache_kv(q, k, v, cos, sin, kv_cache, layer, slot_block_ids, slot_offsets);
  auto attn = paged_decode_attention(q, kv_cache, layer, block_tables, seq_lens, scale, window);
  auto out = x + int4_linear(attn.view({n, q_size}), o_packed, o_scales, o_bias);

  auto gate_up = int4_linear(rms_norm(out, post_norm, eps), gate_up_packed, gate_up_scales,
                             gate_up_bias);
  const int64_t inner = gate_up.size(1) / 2;
  auto act = torch::empty({n, inner}, x.options());
  const float* gu = gate_up.data_ptr<float>();
  float* a = act.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const float *gate = gu + r * 2 * inner, *up = gate + inner;
    for (int64_t i = 0; i < inner; ++i) {
      a[r * inner + i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  }
  out += int4_linear(act, down_packed, down_scales, down_bias);
  return out;
}
