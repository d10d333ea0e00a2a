// The engine's CPU kernels as torch operators: torch.ops.pdcluster.* (engine/kernels).

#include "ops.h"

TORCH_LIBRARY(pdcluster, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv_cache, int layer, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window) -> Tensor");
  m.def(
      "rope_and_cache_kv(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, "
      "Tensor(a!) kv_cache, int layer, Tensor slot_block_ids, Tensor slot_offsets) -> Tensor");
  m.def("dot_linear_supported() -> bool", &dot_linear_supported);
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor w_scale, Tensor? bias) -> Tensor");
  m.def(
      "decode_layer(Tensor x, Tensor input_norm, Tensor post_norm, Tensor qkv_packed, "
      "Tensor qkv_scales, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, Tensor o_packed, "
      "Tensor o_scales, Tensor? o_bias, Tensor gate_up_packed, Tensor gate_up_scales, "
      "Tensor? gate_up_bias, Tensor down_packed, Tensor down_scales, Tensor? down_bias, "
      "Tensor cos, Tensor sin, Tensor(a!) kv_cache, int layer, Tensor slot_block_ids, "
      "Tensor slot_offsets, Tensor block_tables, Tensor seq_lens, int num_heads, "
      "int num_kv_heads, float scale, int window, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdcluster, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rope_and_cache_kv", &rope_and_cache_kv);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("decode_layer", &decode_layer);
}
