"""Generated tokens/s of `LLM.generate` against transformers' `generate`, measured in one run.

Both run the same checkpoint on the same token-id prompts (lengths vary ±50% around
--prompt-len with a fixed seed), greedy, and both produce exactly --output-len tokens per
prompt (ignore_eos here, min_new_tokens there). Transformers gets left-padded batches of
--batch-size; our engine gets every prompt at once and batches by its own scheduler. Each
side is warmed up once on a small run before timing. A second pass with one output token
compares prefill alone. Each timed phase uses fresh prompt tokens (same lengths), so our
prefix cache never hits across phases.

The decode step (derived from the two passes) is set against its memory floor: the bytes of
the weights, which every step reads once, over the read bandwidth of one thread measured here
(a sum over a 1 GiB tensor). Torch runs on --threads threads (1: what an instance actor gets).

    python -m benchmarks.engine_throughput [--preset small-llama | --model MODEL]
        [--num-prompts 16] [--prompt-len 128] [--output-len 64] [--batch-size N]
        [--repeats 3] [--max-num-seqs N] [--max-num-batched-tokens N] [--no-prefill]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.models.gguf import GGUF_WEIGHTS
from engine.presets import PAD_TOKEN_ID, default_model_dir, resolve_model_dir
from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class Workload:
    prompt_lens: list[int]
    vocab_size: int
    first_token_id: int  # the special tokens' ids lie below it

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    def prompts(self, seed: int) -> list[list[int]]:
        """Random ordinary token ids; a different seed gives different tokens, same lengths."""
        rng = random.Random(seed)
        lo, hi = self.first_token_id, self.vocab_size - 1
        return [[rng.randint(lo, hi) for _ in range(n)] for n in self.prompt_lens]


@dataclass(frozen=True)
class Timing:
    seconds: float
    outputs: list[list[int]]  # generated token ids per prompt, in prompt order

    @property
    def num_generated(self) -> int:
        return sum(len(o) for o in self.outputs)


def prompt_lengths(num_prompts: int, mean_len: int, seed: int) -> list[int]:
    """Uniform in [mean/2, 3*mean/2], fixed by `seed`."""
    rng = random.Random(seed)
    lo, hi = max(1, mean_len // 2), max(1, mean_len * 3 // 2)
    return [rng.randint(lo, hi) for _ in range(num_prompts)]


# ---- our engine ---------------------------------------------------------------------------
def build_llm(model_dir: Path, args: argparse.Namespace, workload: Workload) -> LLM:
    """All prompts' KV fits at once, so the comparison never measures preemption."""
    max_len = max(workload.prompt_lens) + args.output_len + 1
    blocks_needed = sum(-(-(n + args.output_len) // args.block_size) for n in workload.prompt_lens)
    engine_args = {
        "block_size": args.block_size,
        "num_blocks": args.num_blocks or blocks_needed + len(workload.prompt_lens) + 16,
        "max_num_seqs": args.max_num_seqs or len(workload.prompt_lens),
        "max_model_len": max_len,
        "enable_prefix_caching": args.prefix_caching == "on",
        "dtype": "float32",
        "device": "cpu",
    }
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    return LLM(str(model_dir), **engine_args)


def run_ours(llm: LLM, prompts: list[list[int]], output_len: int) -> Timing:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return Timing(seconds, [r.token_ids for r in results])


# ---- transformers -------------------------------------------------------------------------
def load_hf(model_dir: Path) -> torch.nn.Module:
    """The same checkpoint in transformers: the GGUF file itself when the folder links one."""
    from transformers import AutoModelForCausalLM

    if (model_dir / GGUF_WEIGHTS).exists():
        gguf_file = (model_dir / GGUF_WEIGHTS).resolve()
        return AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
        ).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def left_pad(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [len(batch), longest prompt], padded on the left."""
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


@torch.inference_mode()
def run_hf(
    model: torch.nn.Module, prompts: list[list[int]], output_len: int, batch_size: int
) -> Timing:
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        ids, mask = left_pad(prompts[start : start + batch_size])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,  # EOS suppressed: every row makes output_len tokens
            do_sample=False,
            pad_token_id=PAD_TOKEN_ID,
        )  # [batch, width + output_len]
        outputs.extend(out[:, ids.shape[1] :].tolist())
    seconds = time.perf_counter() - t0
    return Timing(seconds, outputs)


# ---- one comparison -----------------------------------------------------------------------
@dataclass(frozen=True)
class Pair:
    ours: Timing
    hf: Timing
    num_identical: int  # prompts whose greedy outputs match, summed over the repeats
    num_compared: int


def measure(
    ours: Callable[[list[list[int]], int], Timing],
    hf: Callable[[list[list[int]], int], Timing],
    workload: Workload,
    seed: int,
    output_len: int,
    repeats: int,
) -> Pair:
    """Best of `repeats` for each side, alternating so that drift hits both alike. Each repeat
    gets fresh prompt tokens (both sides the same), so the prefix cache never hits."""
    runs = []
    for r in range(repeats):
        prompts = workload.prompts(seed * 1000 + r)
        runs.append((ours(prompts, output_len), hf(prompts, output_len)))
    expected = len(workload.prompt_lens) * output_len
    for timing in (t for run in runs for t in run):
        if timing.num_generated != expected:
            raise RuntimeError(f"generated {timing.num_generated} tokens, expected {expected}")
    identical = sum(a == b for o, h in runs for a, b in zip(o.outputs, h.outputs))
    return Pair(
        ours=min((o for o, _ in runs), key=lambda t: t.seconds),
        hf=min((h for _, h in runs), key=lambda t: t.seconds),
        num_identical=identical,
        num_compared=repeats * len(workload.prompt_lens),
    )


# ---- the memory floor of a decode step ----------------------------------------------------
def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes/s one thread reads: best of `repeats` sums over a `num_bytes` float32 tensor."""
    x = torch.ones(num_bytes // 4)  # touched: no page faults while timed
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        seconds.append(time.perf_counter() - t0)
    return num_bytes / min(seconds)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameter tensors (a tied lm_head counts once)."""
    return sum({p.data_ptr(): p.nbytes for p in model.parameters()}.values())


def resolve_model(args: argparse.Namespace) -> tuple[Path, str]:
    if args.model:
        return Path(resolve_model_dir(args.model)), args.model
    return default_model_dir(args.preset), f"preset {args.preset}"


def vocab_size_of(model: torch.nn.Module) -> int:
    return model.get_input_embeddings().weight.shape[0]


def print_config(
    args: argparse.Namespace,
    label: str,
    model_dir: Path,
    hf: torch.nn.Module,
    llm: LLM,
    w: Workload,
) -> None:
    import transformers

    sched = llm.engine.config.scheduler
    cache = llm.engine.config.cache
    num_params = sum(p.numel() for p in hf.parameters())
    lens = w.prompt_lens
    print("command: python -m benchmarks.engine_throughput " + shlex.join(sys.argv[1:]))
    print(f"model: {label} ({model_dir}), {num_params / 1e6:.1f}M params, float32, cpu")
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads, shared), "
        f"transformers {transformers.__version__}"
    )
    print(
        f"workload: {len(lens)} prompts, lengths {min(lens)}..{max(lens)} "
        f"(mean {w.num_prompt_tokens / len(lens):.1f}, {w.num_prompt_tokens} tokens), "
        f"{args.output_len} output tokens each, greedy, repeats={args.repeats} (best of)"
    )
    print(
        f"ours: max_num_seqs={sched.max_num_seqs} max_num_batched_tokens="
        f"{sched.max_num_batched_tokens} block_size={cache.block_size} "
        f"num_blocks={cache.num_blocks} prefix_caching={args.prefix_caching}"
    )
    print(
        f"transformers: batch_size={args.batch_size or len(lens)}, left-padded, "
        f"attn_implementation={hf.config._attn_implementation}"
    )


def print_generate(pair: Pair, w: Workload, output_len: int) -> None:
    ours, hf = pair.ours, pair.hf
    ours_tps, hf_tps = ours.num_generated / ours.seconds, hf.num_generated / hf.seconds
    print(f"\ngenerate ({output_len} new tokens x {len(w.prompt_lens)} prompts):")
    print(f"  ours          {ours.seconds:7.3f} s  {ours_tps:8.1f} generated tok/s")
    print(f"  transformers  {hf.seconds:7.3f} s  {hf_tps:8.1f} generated tok/s")
    print(f"  ratio ours / transformers (tok/s): {ours_tps / hf_tps:.2f}x")
    print(f"  greedy outputs identical: {pair.num_identical}/{pair.num_compared}")


def print_prefill(
    gen: Pair, prefill: Pair, w: Workload, output_len: int, floor_ms: float | None
) -> None:
    ours, hf = prefill.ours.seconds, prefill.hf.seconds
    print("\nprefill only (1 new token):")
    print(f"  ours          {ours:7.3f} s  {w.num_prompt_tokens / ours:8.1f} prompt tok/s")
    print(f"  transformers  {hf:7.3f} s  {w.num_prompt_tokens / hf:8.1f} prompt tok/s")
    print(f"  speedup ours vs transformers (time): {hf / ours:.2f}x")
    if output_len > 1:  # the rest of the generate run, per decode step
        steps = output_len - 1
        ours_ms = (gen.ours.seconds - ours) / steps * 1e3
        hf_ms = (gen.hf.seconds - hf) / steps * 1e3
        print(
            f"  derived decode step (generate - prefill) / {steps}: ours {ours_ms:.1f} ms, "
            f"transformers {hf_ms:.1f} ms, speedup {hf_ms / ours_ms:.2f}x"
        )
        if floor_ms is not None:
            print(
                f"  decode step at {len(w.prompt_lens)} sequences vs the memory floor "
                f"{floor_ms:.1f} ms: ours {ours_ms / floor_ms:.2f}x floor, transformers "
                f"{hf_ms / floor_ms:.2f}x floor"
            )


def print_floor(model: torch.nn.Module) -> float:
    """Print and return the memory floor of a decode step, in ms."""
    num_bytes, bandwidth = weight_bytes(model), read_bandwidth()
    floor_ms = num_bytes / bandwidth * 1e3
    print(
        f"memory floor of a decode step: {num_bytes / 1e6:.0f} MB of weights / "
        f"{bandwidth / 1e9:.2f} GB/s read bandwidth (1 thread, 1 GiB sum) = {floor_ms:.1f} ms"
    )
    return floor_ms


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="small-llama", help="built-in preset (cached build)")
    src.add_argument(
        "--model", help="instead of a preset: a checkpoint folder, a .gguf file or smollm2-135m"
    )
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128, help="mean; lengths vary ±50%%")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side; best is kept")
    p.add_argument("--batch-size", type=int, default=0, help="transformers (0: all prompts)")
    p.add_argument("--max-num-seqs", type=int, default=0, help="ours (0: all prompts)")
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="ours (0: default)")
    p.add_argument("--block-size", type=int, default=16, help="ours")
    p.add_argument("--num-blocks", type=int, default=0, help="ours (0: enough for all)")
    p.add_argument("--prefix-caching", choices=["on", "off"], default="on", help="ours")
    p.add_argument("--no-prefill", dest="prefill", action="store_false", help="skip 1-token pass")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir, label = resolve_model(args)
    hf_model = load_hf(model_dir)
    lens = prompt_lengths(args.num_prompts, args.prompt_len, args.seed)
    first_token_id = max(Tokenizer(model_dir).special_ids, default=-1) + 1
    workload = Workload(lens, vocab_size_of(hf_model), first_token_id)
    llm = build_llm(model_dir, args, workload)
    batch_size = args.batch_size or args.num_prompts
    print_config(args, label, model_dir, hf_model, llm, workload)
    floor_ms = print_floor(hf_model) if args.prefill else None

    def ours(prompts: list[list[int]], n: int) -> Timing:
        return run_ours(llm, prompts, n)

    def hf(prompts: list[list[int]], n: int) -> Timing:
        return run_hf(hf_model, prompts, n, batch_size)

    warmup = Workload(lens[:2], workload.vocab_size, first_token_id).prompts(args.seed * 1000 + 999)
    ours(warmup, 4)
    hf(warmup, 4)
    gen = measure(ours, hf, workload, args.seed + 1, args.output_len, args.repeats)
    print_generate(gen, workload, args.output_len)
    if args.prefill:
        prefill = measure(ours, hf, workload, args.seed + 2, 1, args.repeats)
        print_prefill(gen, prefill, workload, args.output_len, floor_ms)


if __name__ == "__main__":
    main()
