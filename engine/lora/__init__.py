"""Multi-LoRA serving (vLLM's `--enable-lora`): adapters in PEFT's format applied to the
attention and MLP projections, many adapters and the base model in one step's batch.

`adapter` reads and checks an adapter folder, `layers` wraps the model's projections so each
adds its adapter's low-rank product to the rows of its requests, and `manager` keeps the
adapters an instance has loaded and the `max_loras` of them resident in the layers.
"""
