"""Multi-LoRA in one engine (no Ray): adapters made with peft give transformers + peft's
greedy tokens, mixed with the base model and each other in one batch, under every
scheduling path; each adapter's prefix blocks are its own; a folder that cannot be served is
refused with a clear error and changes nothing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdcluster.engine import LLM, LoRARequest, SamplingParams
from pdcluster.engine.config import LoRAConfig
from pdcluster.engine.kv_cache_manager import root_hash
from pdcluster.engine.llm import engine_config_from_args
from pdcluster.engine.lora.adapter import LoRAAdapterError
from tests.lora_utils import ALL_PROJECTIONS, make_adapter, make_adapters
from tests.scheduler_utils import make_requests, make_scheduler
from tests.test_engine_vs_transformers import VARIANTS, hf_greedy

pytest.importorskip("peft")

NUM_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def adapted(request, preset_dir, tmp_path_factory):
    """(base folder, adapters folder, name -> peft reference model)."""
    base = preset_dir(request.param)
    folder = tmp_path_factory.mktemp(f"lora-{request.param}")
    return base, folder, make_adapters(base, folder)


def lora(folder, name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, str(folder / name))


def prompts_for(vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (int(length),), generator=g).tolist() for length in
            torch.randint(2, 30, (n,), generator=g)]  # fmt: skip


def assert_idle(llm: LLM) -> None:
    stats = llm.engine.scheduler.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert not llm.engine.scheduler.has_requests()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_batch_mixing_adapters_and_the_base_model_matches_peft(adapted, variant):
    base, folder, refs = adapted
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, **VARIANTS[variant])
    names = ["alpha", "beta", None, "alpha", "beta", None]
    prompts = prompts_for(llm.engine.model_info.vocab_size, len(names))
    outputs = llm.generate(prompts, GREEDY, lora_request=[lora(folder, n) for n in names])
    for name, prompt, out in zip(names, prompts, outputs):
        assert out.token_ids == hf_greedy(refs[name], prompt, NUM_NEW), name
    assert_idle(llm)
    if variant == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0


def test_more_adapters_than_slots_take_turns(adapted):
    """max_loras=1: one adapter's requests run at a time (with the base model's), the others
    wait for the slot; every output still matches."""
    base, folder, refs = adapted
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8)
    names = ["alpha", "beta", "gamma", None, "beta", "alpha"]
    prompts = prompts_for(llm.engine.model_info.vocab_size, len(names))
    outputs = llm.generate(prompts, GREEDY, lora_request=[lora(folder, n) for n in names])
    for name, prompt, out in zip(names, prompts, outputs):
        assert out.token_ids == hf_greedy(refs[name], prompt, NUM_NEW), name
    stats = llm.engine.stats()["lora"]
    assert stats.max_loras == 1 and len(stats.resident) == 1
    assert_idle(llm)


def test_each_adapter_computes_its_own_prefix(adapted):
    base, folder, refs = adapted
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
    prompt = prompts_for(llm.engine.model_info.vocab_size, 1)[0] * 2  # >= 4 blocks
    cached = {}
    for name in ("alpha", "beta", None, "alpha"):
        out = llm.generate([prompt], GREEDY, lora_request=lora(folder, name))[0]
        assert out.token_ids == hf_greedy(refs[name], prompt, NUM_NEW), name
        cached.setdefault(name, []).append(out.num_cached_tokens)
    assert cached["alpha"][0] == cached["beta"][0] == cached[None][0] == 0
    assert cached["alpha"][1] >= 4  # its own blocks, found again
    assert_idle(llm)


def test_an_adapter_is_named_by_its_folder_too():
    a, b = LoRARequest("x", "/one"), LoRARequest("x", "/two")
    roots = {root_hash(None), root_hash(None, a), root_hash(None, b), root_hash("s", a)}
    assert len(roots) == 4
    assert root_hash("s") != root_hash("s", a)


def _rewrite(folder, edit_config=None, edit_weights=None) -> None:
    if edit_config is not None:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps(edit_config(json.loads(path.read_text()))))
    if edit_weights is not None:
        path = folder / "adapter_model.safetensors"
        save_file(edit_weights(load_file(str(path))), str(path))


def _first_a(weights: dict) -> str:
    return next(k for k in sorted(weights) if k.endswith("lora_A.weight"))


BAD_FOLDERS = {
    "no_config": (lambda f: (f / "adapter_config.json").unlink(), "no adapter_config.json"),
    "no_weights": (lambda f: (f / "adapter_model.safetensors").unlink(), "no adapter_model"),
    "rank_over_limit": (None, "exceeds max_lora_rank 4"),
    "wrong_shapes": (
        lambda f: _rewrite(
            f,
            edit_weights=lambda w: {**w, _first_a(w): torch.zeros(8, w[_first_a(w)].shape[1] + 1)},
        ),
        "do not fit the base model",
    ),  # fmt: skip
    "dora": (lambda f: _rewrite(f, edit_config=lambda c: {**c, "use_dora": True}), "use_dora"),
    "embeddings": (
        lambda f: _rewrite(
            f,
            edit_weights=lambda w: {
                **w,
                "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 4),
            },
        ),
        "not a projection LoRA applies to",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_a_folder_that_cannot_be_served_is_refused_and_changes_nothing(adapted, case, tmp_path):
    base, folder, refs = adapted
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in (folder / "alpha").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    spoil, message = BAD_FOLDERS[case]
    if spoil is not None:
        spoil(bad)
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=4)
    llm.engine.load_lora(LoRARequest("beta", str(folder / "beta")))
    with pytest.raises(LoRAAdapterError, match=message):
        llm.engine.load_lora(LoRARequest("bad", str(bad)))
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("bad", str(bad)))
    assert llm.engine.lora.served() == ["beta"]
    assert_idle(llm)
    prompt = [5, 6, 7, 8]
    out = llm.generate([prompt], GREEDY, lora_request=lora(folder, "beta"))[0]
    assert out.token_ids == hf_greedy(refs["beta"], prompt, NUM_NEW)


def test_an_adapter_on_an_engine_without_lora_is_refused(preset_dir):
    llm = LLM(preset_dir("tiny-llama"))
    with pytest.raises(ValueError, match="serves no adapters"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("a", "/nowhere"))
    assert_idle(llm)


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="max_loras"):
        LoRAConfig(max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="enable_lora"):
        engine_config_from_args("/any", max_loras=2)


def test_the_scheduler_runs_at_most_max_loras_adapters_in_a_step():
    scheduler = make_scheduler()
    scheduler.admission.max_loras = 2
    requests = make_requests(6)
    names = ["a", "b", "c", None, "a", "c"]
    for request, name in zip(requests, names):
        request.lora_request = None if name is None else LoRARequest(name, f"/{name}")
        scheduler.add_request(request)
    so = scheduler.schedule()
    scheduled = [names[int(r[3:])] for r in so.num_scheduled_tokens]
    assert scheduled == ["a", "b", None, "a"]  # c waits: a and b hold the two slots


def test_an_unloaded_adapter_is_no_longer_served_but_its_requests_still_run(adapted):
    base, folder, refs = adapted
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8)
    alpha = lora(folder, "alpha")
    llm.engine.load_lora(alpha)
    assert llm.engine.lora.served() == ["alpha"]
    assert llm.engine.unload_lora("alpha") and not llm.engine.unload_lora("alpha")
    prompt = [9, 8, 7, 6]
    out = llm.generate([prompt], GREEDY, lora_request=alpha)[0]  # e.g. a D's handoff
    assert out.token_ids == hf_greedy(refs["alpha"], prompt, NUM_NEW)
    assert llm.engine.lora.served() == []
    llm.engine.load_lora(alpha)  # served again once loaded again
    assert llm.engine.lora.served() == ["alpha"]


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3_text", "qwen3_moe"])
def test_other_architectures_match_peft(arch, preset_dir, tmp_path):
    """Qwen3 (q/k norms), Gemma 2 and 3 (their own norms and soft caps), and a sparse MoE
    (attention adapted; its experts are refused, as PEFT targets them by parameter)."""
    import transformers

    from tests.arch_checkpoints import make_checkpoint

    base_dir = make_checkpoint(arch, tmp_path / arch, preset_dir("tiny-llama"))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    targets = ATTENTION if arch == "qwen3_moe" else ALL_PROJECTIONS
    ref = make_adapter(base, tmp_path / "adapter", 5, 8, 16, targets, False)
    llm = LLM(str(base_dir), enable_lora=True, max_lora_rank=8)
    prompts = prompts_for(llm.engine.model_info.vocab_size, 3)
    adapter = LoRARequest("a", str(tmp_path / "adapter"))
    outputs = llm.generate(prompts, GREEDY, lora_request=[adapter, None, adapter])
    for prompt, out, model in zip(prompts, outputs, [ref, base.eval(), ref]):
        assert out.token_ids == hf_greedy(model, prompt, NUM_NEW)
    assert_idle(llm)
    if arch == "qwen3_moe":
        import peft

        experts = peft.LoraConfig(r=4, target_modules=[], target_parameters=["gate_up_proj"])
        peft.get_peft_model(base, experts).save_pretrained(str(tmp_path / "experts"))
        with pytest.raises(LoRAAdapterError, match="target_parameters"):
            llm.engine.load_lora(LoRARequest("experts", str(tmp_path / "experts")))


def test_a_fused_projection_adds_each_parts_adapter():
    """q, k and v fused in one layer (the quantized modes' shape) give what three layers
    with their own adapters give."""
    from torch import nn

    from pdcluster.engine.lora.adapter import LoRAWeights
    from pdcluster.engine.lora.layers import LoRABatch, LoRALinear
    from pdcluster.engine.models.fusion import fused_linear

    torch.manual_seed(0)
    parts = [nn.Linear(32, n, bias=False) for n in (32, 16, 16)]
    adapters = [LoRAWeights(torch.randn(r, 32), torch.randn(p.out_features, r), s)
                for p, r, s in zip(parts, (4, 2, 3), (2.0, 0.5, 1.0))]  # fmt: skip
    batch = LoRABatch()
    fused = LoRALinear(fused_linear(parts), batch, 32, (32, 16, 16), 2, 4, torch.float32)
    alone = [LoRALinear(p, batch, 32, (p.out_features,), 2, 4, torch.float32) for p in parts]
    for i, weights in enumerate(adapters):
        fused.set_slot(1, i, None if i == 1 else weights)  # k's adapter leaves k alone
        alone[i].set_slot(1, 0, None if i == 1 else weights)
    x = torch.randn(5, 32)
    batch.set(1, torch.tensor([0, 3, 4]), torch.ones(1, 3, 1))  # rows 0, 3, 4 in slot 1
    expected = torch.cat([layer(x) for layer in alone], dim=-1)
    torch.testing.assert_close(fused(x), expected)
    base = torch.cat([p(x) for p in parts], dim=-1)
    assert torch.equal(fused(x)[[1, 2]], base[[1, 2]])  # rows of the base model untouched


def test_a_quantized_base_keeps_its_fused_layers_and_decode_kernels(preset_dir, adapted):
    """int4: q/k/v and gate/up stay fused (each part's adapter in its block), the layers'
    decode kernels run the steps without adapter rows, and base rows after adapter steps
    decode as before them. (Two int4 engines may pick different formats at load: both
    runs are one engine's.)"""
    from pdcluster.engine.kernels import cpu_kernels

    base, folder, _ = adapted
    llm = LLM(
        base, quantization="int4", enable_lora=True, max_loras=2, max_lora_rank=8,
        enable_prefix_caching=False,  # a hit computes fewer rows: another int4 format's
    )  # fmt: skip
    layers = llm.engine.runner.model.model.layers
    assert all(type(m.self_attn.qkv_proj).__name__ == "LoRALinear" for m in layers)
    if cpu_kernels() is not None:
        assert all(type(m.decode_kernel).__name__ == "LoRAGuardedKernel" for m in layers)
    prompts = prompts_for(llm.engine.model_info.vocab_size, 3)
    before = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    adapted_out = llm.generate(prompts, GREEDY, lora_request=lora(folder, "alpha"))
    assert [o.token_ids for o in adapted_out] != before  # the adapter applies
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == before
    assert_idle(llm)


def test_llavas_language_model_takes_an_adapter_as_peft_names_it(preset_dir, tmp_path):
    """PEFT names LLaVA's decoder modules as transformers nests them
    (`model.language_model.layers...`); they are the same projections here."""
    import peft
    import transformers

    base_dir = preset_dir("tiny-llava")
    hf = transformers.AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
    text = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, target_modules=text, init_lora_weights=False)
    ref = peft.get_peft_model(hf, config).eval()
    ref.save_pretrained(str(tmp_path / "adapter"))
    llm = LLM(base_dir, enable_lora=True, max_lora_rank=4)
    prompt = prompts_for(llm.engine.model_info.vocab_size, 1)[0]
    out = llm.generate([prompt], GREEDY, lora_request=LoRARequest("a", str(tmp_path / "adapter")))
    assert out[0].token_ids == hf_greedy(ref, prompt, NUM_NEW)


def test_a_request_runs_on_its_own_folder_after_its_name_moved_to_another(adapted):
    """A request that started under one folder (a D's handoff, say) finishes on it after its
    adapter's name was unloaded and loaded again from another folder."""
    base, folder, refs = adapted
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8)
    llm.engine.load_lora(LoRARequest("x", str(folder / "beta")))
    prompt = [4, 5, 6, 7]
    out = llm.generate([prompt], GREEDY, lora_request=LoRARequest("x", str(folder / "alpha")))
    assert out[0].token_ids == hf_greedy(refs["alpha"], prompt, NUM_NEW)
    out = llm.generate([prompt], GREEDY, lora_request=LoRARequest("x", str(folder / "beta")))
    assert out[0].token_ids == hf_greedy(refs["beta"], prompt, NUM_NEW)
    assert llm.engine.lora.served() == ["x"]
    assert_idle(llm)
