// Decode attention over a paged float32 KV cache, reading each key and value where it lies.
//
// One query token per sequence attends to keys [start, len) of its sequence, start = 0 or
// len - window (sliding window). The cache is one tensor
// [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (engine/attention.py), so a
// position's key is head_dim contiguous floats found through the sequence's block table; no
// gathered copy of the context is made. Each sequence is one unit of work, reading each
// position's keys (then values) of every KV head as one contiguous row, which all query heads
// share. Softmax in float32: scores, their max, exp and sum, then the weighted sum of values
// divided by the sum.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Ask for the cache lines of `bytes` at `p` ahead of their use (the rows of a sequence's next
// positions lie in other blocks, which the hardware prefetcher cannot guess).
inline void prefetch(const float* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + i);
}

constexpr int64_t kPrefetchAhead = 4;  // positions

inline void axpy(float w, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

}  // namespace

// q [D, H, hd], kv_cache [blocks, L, 2, bs, kvh, hd], block_tables [D, max_blocks] int64,
// seq_lens [D] int64 -> [D, H, hd]
torch::Tensor paged_decode_attention(
    const torch::Tensor& q, const torch::Tensor& kv_cache, int64_t layer,
    const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
    int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q must be a contiguous float32 [D, H, head_dim] tensor");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.scalar_type() == torch::kFloat32 &&
                  kv_cache.is_contiguous(),
              "kv_cache must be a contiguous float32 [blocks, layers, 2, bs, kvh, hd] tensor");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt64 &&
                  block_tables.is_contiguous(),
              "block_tables must be a contiguous int64 [D, max_blocks] tensor");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == torch::kInt64,
              "seq_lens must be an int64 [D] tensor");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(0), num_layers = kv_cache.size(1);
  const int64_t block_size = kv_cache.size(3), num_kv_heads = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(2) == 2 && kv_cache.size(5) == head_dim, "kv_cache shape");
  TORCH_CHECK(0 <= layer && layer < num_layers, "layer out of range");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs,
              "one block table and one length per sequence");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t group = num_heads / num_kv_heads;  // query heads reading one KV head

  auto lens = seq_lens.contiguous();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  const int64_t* table_ptr = block_tables.data_ptr<int64_t>();
  for (int64_t d = 0; d < num_seqs; ++d) {
    TORCH_CHECK(1 <= len_ptr[d] && len_ptr[d] <= max_blocks * block_size,
                "sequence length out of its block table's range");
  }
  for (int64_t i = 0; i < num_seqs * max_blocks; ++i) {
    TORCH_CHECK(0 <= table_ptr[i] && table_ptr[i] < num_blocks, "block id out of range");
  }

  auto out = torch::empty_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* cache_ptr = kv_cache.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t row_stride = num_kv_heads * head_dim;      // one position within a block
  const int64_t kv_stride = block_size * row_stride;       // K -> V of one layer
  const int64_t block_stride = num_layers * 2 * kv_stride;  // one block
  const int64_t layer_offset = layer * 2 * kv_stride;
  const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(float));
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, sums(num_heads), acc(num_heads * head_dim);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = len_ptr[seq];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      const float* queries = q_ptr + seq * num_heads * head_dim;  // [H, hd]
      const int64_t* table = table_ptr + seq * max_blocks;
      scores.resize(num_heads * n);  // [H, n]
      // [kvh, hd]: position pos's keys (which = 0) or values (1), every KV head's side by side
      auto row = [&](int64_t pos, int64_t which) {
        return cache_ptr + table[pos / block_size] * block_stride + layer_offset +
               which * kv_stride + (pos % block_size) * row_stride;
      };
      for (int64_t pos = start; pos < len; ++pos) {
        if (pos + kPrefetchAhead < len) prefetch(row(pos + kPrefetchAhead, 0), row_bytes);
        const float* keys = row(pos, 0);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* key = keys + (h / group) * head_dim;
          scores[h * n + pos - start] = dot(queries + h * head_dim, key, head_dim) * fscale;
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* row = scores.data() + h * n;
        float max = row[0];
        for (int64_t i = 1; i < n; ++i) max = std::max(max, row[i]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          row[i] = std::exp(row[i] - max);
          sum += row[i];
        }
        sums[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pos = start; pos < len; ++pos) {
        if (pos + kPrefetchAhead < len) prefetch(row(pos + kPrefetchAhead, 1), row_bytes);
        const float* values = row(pos, 1);
        for (int64_t h = 0; h < num_heads; ++h) {
          axpy(scores[h * n + pos - start], values + (h / group) * head_dim,
               acc.data() + h * head_dim, head_dim);
        }
      }
      float* dest = out_ptr + seq * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = 1.f / sums[h];
        for (int64_t e = 0; e < head_dim; ++e) dest[h * head_dim + e] = acc[h * head_dim + e] * inv;
      }
    }
  });
  return out;
}
