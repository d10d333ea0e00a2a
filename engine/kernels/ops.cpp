// The engine's CPU kernels as torch operators: torch.ops.pdcluster.* (engine/kernels).

#include <torch/extension.h>

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     int64_t layer, const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale, int64_t window);

torch::Tensor rope_and_cache_kv(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& cos,
                                const torch::Tensor& sin, const torch::Tensor& kv_cache,
                                int64_t layer, const torch::Tensor& slot_block_ids,
                                const torch::Tensor& slot_offsets);

TORCH_LIBRARY(pdcluster, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv_cache, int layer, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window) -> Tensor");
  m.def(
      "rope_and_cache_kv(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, "
      "Tensor(a!) kv_cache, int layer, Tensor slot_block_ids, Tensor slot_offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdcluster, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rope_and_cache_kv", &rope_and_cache_kv);
}
