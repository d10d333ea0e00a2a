"""LoRA adapters made with `peft` for a preset checkpoint: the adapters the engine and the
cluster are checked against (with transformers + peft's greedy output under each)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (seed, rank, lora_alpha, target modules, use_rslora)
ADAPTERS = {
    "alpha": (1, 8, 16, ALL_PROJECTIONS, False),
    "beta": (2, 4, 8, ("q_proj", "v_proj", "down_proj"), True),
    "gamma": (3, 2, 4, ("o_proj", "up_proj"), False),
}


def make_adapters(base_dir: str, out_dir: Path, names=tuple(ADAPTERS)) -> dict[str, object]:
    """Save each named adapter (random, non-zero A and B) under out_dir/name; name ->
    the peft model (base + that adapter), ready to run."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    models = {name: make_adapter(base, out_dir / name, *ADAPTERS[name]) for name in names}
    models[None] = base.eval()
    return models


def make_adapter(
    base, out: Path, seed: int, rank: int, alpha: int, targets: tuple[str, ...], rslora: bool
):
    """A random adapter of `base` (a transformers model, left as it is) saved in `out`; the
    peft model (a copy of `base` with the adapter)."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
        init_lora_weights=False,  # B is not zero: the adapter changes the output
    )  # fmt: skip
    model = peft.get_peft_model(copy.deepcopy(base), config)
    model.save_pretrained(str(out))
    return model.eval()


def adapter_of_another_base(out_dir: Path) -> Path:
    """A LoRA adapter saved for a Llama of another width (hidden 32, not the presets' 64)."""
    import peft
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=4, target_modules=list(ALL_PROJECTIONS), init_lora_weights=False)
    peft.get_peft_model(model, lora).save_pretrained(str(out_dir))
    return out_dir
