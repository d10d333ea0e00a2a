// Rotary position embedding (rotate-half) on a step's queries and keys, fused with writing the
// rotated keys and the values into their slots of a paged float32 KV cache.
//
// Per token t: q_out[t, h] = rope(q[t, h]) for every query head; for every KV head,
// kv_cache[block[t], layer, 0, offset[t], h] = rope(k[t, h]) and [.., 1, ..] = v[t, h].
// rope(x)[i] = x[i] * cos[i] - x[i + d/2] * sin[i] for i < d/2, x[i] * cos[i] + x[i - d/2] *
// sin[i] above: the same products and sums, in the same order and with no fused
// multiply-add, as `x * cos + cat(-x2, x1) * sin` in float32 torch, so results are bitwise
// those of the unfused ops. q, k and v may be views into one fused projection's output (each
// row's last dimension contiguous).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static void rope(const float* x, const float* cos, const float* sin, float* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i] * cos[i];
    const float b = x[i + half] * sin[i];
    out[i] = a - b;
  }
  for (int64_t i = half; i < dim; ++i) {
    const float a = x[i] * cos[i];
    const float b = x[i - half] * sin[i];
    out[i] = a + b;
  }
}
#pragma GCC pop_options

static void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kFloat32 && t.stride(2) == 1, name,
              " must be a float32 [T, heads, head_dim] tensor with contiguous rows");
}

// q [T, H, hd], k and v [T, kvh, hd], cos and sin [T, 1, hd] -> rotated q [T, H, hd]
torch::Tensor rope_and_cache_kv(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& cos,
                                const torch::Tensor& sin, const torch::Tensor& kv_cache,
                                int64_t layer, const torch::Tensor& slot_block_ids,
                                const torch::Tensor& slot_offsets) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k.size(1);
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(k.size(0) == num_tokens && v.size(0) == num_tokens && v.size(1) == num_kv_heads &&
                  k.size(2) == head_dim && v.size(2) == head_dim,
              "q, k and v must hold the same tokens and head_dim");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == num_tokens * head_dim && sin.numel() == num_tokens * head_dim,
              "cos and sin must be contiguous float32 [T, 1, head_dim] tensors");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.scalar_type() == torch::kFloat32 &&
                  kv_cache.is_contiguous() && kv_cache.size(2) == 2 &&
                  kv_cache.size(4) == num_kv_heads && kv_cache.size(5) == head_dim,
              "kv_cache must be a contiguous float32 [blocks, layers, 2, bs, kvh, hd] tensor");
  const int64_t num_blocks = kv_cache.size(0), num_layers = kv_cache.size(1);
  const int64_t block_size = kv_cache.size(3);
  TORCH_CHECK(0 <= layer && layer < num_layers, "layer out of range");
  TORCH_CHECK(slot_block_ids.scalar_type() == torch::kInt64 &&
                  slot_offsets.scalar_type() == torch::kInt64 &&
                  slot_block_ids.numel() == num_tokens && slot_offsets.numel() == num_tokens,
              "one int64 slot block id and offset per token");
  auto blocks = slot_block_ids.contiguous(), offsets = slot_offsets.contiguous();
  const int64_t* block_ptr = blocks.data_ptr<int64_t>();
  const int64_t* offset_ptr = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(0 <= block_ptr[t] && block_ptr[t] < num_blocks, "slot block id out of range");
    TORCH_CHECK(0 <= offset_ptr[t] && offset_ptr[t] < block_size, "slot offset out of range");
  }

  auto out = torch::empty({num_tokens, num_heads, head_dim}, q.options());
  const int64_t row_stride = num_kv_heads * head_dim;
  const int64_t kv_stride = block_size * row_stride;
  const int64_t block_stride = num_layers * 2 * kv_stride;
  const int64_t layer_offset = layer * 2 * kv_stride;
  const float *q_ptr = q.data_ptr<float>(), *k_ptr = k.data_ptr<float>();
  const float *v_ptr = v.data_ptr<float>(), *cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  float* cache_ptr = kv_cache.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cos_ptr + t * head_dim, *s = sin_ptr + t * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        rope(q_ptr + t * q.stride(0) + h * q.stride(1), c, s,
             out_ptr + (t * num_heads + h) * head_dim, head_dim);
      }
      float* key_row = cache_ptr + block_ptr[t] * block_stride + layer_offset +
                       offset_ptr[t] * row_stride;
      float* value_row = key_row + kv_stride;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        rope(k_ptr + t * k.stride(0) + h * k.stride(1), c, s, key_row + h * head_dim, head_dim);
        const float* value = v_ptr + t * v.stride(0) + h * v.stride(1);
        std::copy(value, value + head_dim, value_row + h * head_dim);
      }
    }
  });
  return out;
}
