"""Torch models over the paged KV cache: Llama family (Llama, Mistral, Qwen2) and LLaVA.

Every model exposes `embed_tokens(input_ids)`, `forward(inputs_embeds, positions, kv_cache,
meta)` and `compute_logits(hidden)`; LLaVA also `embed_images(pixel_values)`. Build them with
`engine.models.loader.load_model`.
"""
