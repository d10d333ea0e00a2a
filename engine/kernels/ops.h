// The engine's CPU kernels (engine/kernels/*.cpp), declared for ops.cpp, which registers them
// as torch operators, and for the kernels that call one another.

#pragma once

#include <torch/extension.h>

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     int64_t layer, const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale, int64_t window);

torch::Tensor rope_and_cache_kv(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& cos,
                                const torch::Tensor& sin, const torch::Tensor& kv_cache,
                                int64_t layer, const torch::Tensor& slot_block_ids,
                                const torch::Tensor& slot_offsets);

bool dot_linear_supported();

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias);

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q,
                          const torch::Tensor& w_scale, const c10::optional<torch::Tensor>& bias);

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
    int64_t num_kv_heads, double scale, int64_t window, double eps);
