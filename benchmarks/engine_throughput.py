"""Generated tokens/s of `LLM.generate` against transformers' `generate`, measured in one run.

Three workloads, each measured side by side (ours, then transformers, alternating, for
--repeats rounds, fresh prompt tokens each round):

- equal: --num-prompts prompts of exactly --prompt-len tokens, --output-len tokens each;
- conversation: --conv-requests consecutive requests of the Azure conversation trace
  (`workload.default_trace`: the full trace where ../shared has it, else the packaged sample),
  lengths x--conv-token-scale, clamped to [4, --conv-max-prompt-len] and [2, --conv-max-output-len];
- prefill-heavy: --prefill-requests prompts of --prefill-prompt-len +-50% tokens (fixed seed),
  --prefill-output-len tokens each.

Both sides run the same checkpoint on the same token-id prompts, greedy, and make exactly
each request's output length: ours with ignore_eos, transformers with its EOS turned off
(EOS may be generated like any token, never suppressed), so greedy outputs are comparable
token by token. Transformers is batched statically, as it is used: batches of --batch-size
(0: all) are left-padded to their longest prompt and generate to their longest output; only
each request's own tokens count. Our engine gets every prompt at once and batches by its own
scheduler. Both sides are warmed up once before timing.

On the equal workload a second pass with one output token measures prefill alone, and the
decode step (derived from the two passes) is set against its memory floor: the bytes of the
weights, which every step reads once, over the read bandwidth of one thread measured here (a
sum over a 1 GiB tensor). Torch runs on --threads threads (1: what an instance actor gets).

    python -m pdcluster.benchmarks.engine_throughput [--preset small-llama | --model MODEL]
        [--workloads equal,conversation,prefill-heavy] [--repeats 3] [--threads 1]
        [--dtype float32 --quantization none] [--hf-dtype float32] ...

Ours defaults to the exact mode (float32, no quantization), transformers' own CPU default;
--dtype and --quantization measure a faster format against the same transformers.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdcluster.benchmarks.report import loadavg, machine_info
from pdcluster.benchmarks.workload import LengthScaling, default_trace, trace_workload
from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.config import DEFAULT_QUANTIZATION, QUANTIZATIONS
from pdcluster.engine.models.gguf import GGUF_WEIGHTS
from pdcluster.engine.presets import PAD_TOKEN_ID, default_model_dir, resolve_model_dir
from pdcluster.engine.tokenizer import Tokenizer

WORKLOADS = ("equal", "conversation", "prefill-heavy")


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_lens: list[int]
    output_lens: list[int]
    vocab_size: int
    first_token_id: int  # the special tokens' ids lie below it

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def prompts(self, seed: int) -> list[list[int]]:
        """Random ordinary token ids; a different seed gives different tokens, same lengths."""
        rng = random.Random(seed)
        lo, hi = self.first_token_id, self.vocab_size - 1
        return [[rng.randint(lo, hi) for _ in range(n)] for n in self.prompt_lens]

    def with_outputs(self, output_len: int) -> Workload:
        return Workload(
            self.name, self.prompt_lens, [output_len] * len(self.prompt_lens),
            self.vocab_size, self.first_token_id,
        )  # fmt: skip

    def describe(self) -> str:
        p, o = self.prompt_lens, self.output_lens
        return (
            f"{self.name}: {len(p)} requests, prompts {min(p)}..{max(p)} (sum "
            f"{self.num_prompt_tokens}), outputs {min(o)}..{max(o)} (sum {self.num_output_tokens})"
        )


@dataclass(frozen=True)
class Timing:
    seconds: float
    outputs: list[list[int]]  # generated token ids per prompt, in prompt order

    @property
    def num_generated(self) -> int:
        return sum(len(o) for o in self.outputs)


def spread_lengths(num: int, mean_len: int, seed: int) -> list[int]:
    """Uniform in [mean/2, 3*mean/2], fixed by `seed`."""
    rng = random.Random(seed)
    lo, hi = max(1, mean_len // 2), max(1, mean_len * 3 // 2)
    return [rng.randint(lo, hi) for _ in range(num)]


def build_workloads(
    args: argparse.Namespace, vocab_size: int, first_token_id: int
) -> list[Workload]:
    def make(name: str, prompt_lens: list[int], output_lens: list[int]) -> Workload:
        return Workload(name, prompt_lens, output_lens, vocab_size, first_token_id)

    built = []
    for name in args.workloads:
        if name == "equal":
            n = args.num_prompts
            built.append(make(name, [args.prompt_len] * n, [args.output_len] * n))
        elif name == "conversation":
            lengths = LengthScaling(
                args.conv_token_scale, 4, args.conv_max_prompt_len, 2, args.conv_max_output_len
            )
            trace = trace_workload(args.trace, lengths, num_requests=args.conv_requests)
            reqs = trace.requests
            built.append(make(name, [r.prompt_len for r in reqs], [r.output_len for r in reqs]))
        else:
            n = args.prefill_requests
            prompt_lens = spread_lengths(n, args.prefill_prompt_len, args.seed)
            built.append(make(name, prompt_lens, [args.prefill_output_len] * n))
    return built


# ---- our engine ---------------------------------------------------------------------------
def build_llm(model_dir: Path, args: argparse.Namespace, workloads: list[Workload]) -> LLM:
    """One engine for every workload; the largest one's KV fits at once, so the comparison
    never measures preemption."""
    max_len = max(p + o for w in workloads for p, o in zip(w.prompt_lens, w.output_lens)) + 1
    blocks_needed = max(
        sum(-(-(p + o) // args.block_size) for p, o in zip(w.prompt_lens, w.output_lens))
        for w in workloads
    )
    num_seqs = max(len(w.prompt_lens) for w in workloads)
    engine_args = {
        "block_size": args.block_size,
        "num_blocks": args.num_blocks or blocks_needed + num_seqs + 16,
        "max_num_seqs": args.max_num_seqs or num_seqs,
        "max_model_len": max_len,
        "enable_prefix_caching": args.prefix_caching == "on",
        "dtype": args.dtype,
        "quantization": args.quantization,
        "device": "cpu",
    }
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    return LLM(str(model_dir), **engine_args)


def run_ours(llm: LLM, prompts: list[list[int]], output_lens: list[int]) -> Timing:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return Timing(seconds, [r.token_ids for r in results])


# ---- transformers -------------------------------------------------------------------------
def load_hf(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The same checkpoint in transformers: the GGUF file itself when the folder links one."""
    from transformers import AutoModelForCausalLM

    if (model_dir / GGUF_WEIGHTS).exists():
        gguf_file = (model_dir / GGUF_WEIGHTS).resolve()
        return AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=dtype
        ).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


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
    model: torch.nn.Module, prompts: list[list[int]], output_lens: list[int], batch_size: int
) -> Timing:
    """Static batches: each generates to its longest output; a row keeps its own tokens."""
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        ids, mask = left_pad(prompts[start : start + batch_size])
        lens = output_lens[start : start + batch_size]
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(lens),
            eos_token_id=None,  # like ignore_eos: EOS neither stops nor is suppressed
            do_sample=False,
            pad_token_id=PAD_TOKEN_ID,
        )  # [batch, width + max(lens)]
        new = out[:, ids.shape[1] :].tolist()
        outputs.extend(row[:n] for row, n in zip(new, lens))
    seconds = time.perf_counter() - t0
    return Timing(seconds, outputs)


# ---- one comparison -----------------------------------------------------------------------
Runner = Callable[[list[list[int]], list[int]], Timing]


@dataclass(frozen=True)
class Pair:
    ours: list[Timing]  # one per repeat, in order
    hf: list[Timing]
    num_identical: int  # prompts whose greedy outputs match, summed over the repeats
    num_compared: int

    @property
    def ratios(self) -> list[float]:
        """Ours ÷ transformers in tokens/s (= their time ÷ ours), per repeat."""
        return [h.seconds / o.seconds for o, h in zip(self.ours, self.hf)]

    @property
    def best_ours(self) -> Timing:
        return min(self.ours, key=lambda t: t.seconds)

    @property
    def best_hf(self) -> Timing:
        return min(self.hf, key=lambda t: t.seconds)


def measure(ours: Runner, hf: Runner, workload: Workload, seed: int, repeats: int) -> Pair:
    """`repeats` rounds of ours then transformers, so that drift hits both alike. Each round
    gets fresh prompt tokens (both sides the same), so the prefix cache never hits."""
    runs = []
    for r in range(repeats):
        prompts = workload.prompts(seed * 1000 + r)
        runs.append((ours(prompts, workload.output_lens), hf(prompts, workload.output_lens)))
    for timing in (t for run in runs for t in run):
        if timing.num_generated != workload.num_output_tokens:
            raise RuntimeError(
                f"generated {timing.num_generated} tokens, expected {workload.num_output_tokens}"
            )
    return Pair(
        ours=[o for o, _ in runs],
        hf=[h for _, h in runs],
        num_identical=sum(a == b for o, h in runs for a, b in zip(o.outputs, h.outputs)),
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
    workloads: list[Workload],
) -> None:
    import transformers

    sched = llm.engine.config.scheduler
    cache = llm.engine.config.cache
    machine = machine_info()
    num_params = sum(p.numel() for p in hf.parameters())
    print("command: python -m pdcluster.benchmarks.engine_throughput " + shlex.join(sys.argv[1:]))
    print(
        f"machine: {machine['processor']}, {machine['cpus_usable']} usable CPUs (shared), "
        f"load average {machine['loadavg_start']}, commit {str(machine['git_commit'])[:10]}"
        f"{' (dirty)' if machine['git_dirty'] else ''}"
    )
    print(
        f"model: {label} ({model_dir}), {num_params / 1e6:.1f}M params, cpu; ours dtype "
        f"{args.dtype} quantization {args.quantization}, transformers {args.hf_dtype}"
    )
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads per side), "
        f"transformers {transformers.__version__}; greedy, {args.repeats} rounds per workload"
    )
    for w in workloads:
        print(f"workload {w.describe()}")
    print(
        f"ours: max_num_seqs={sched.max_num_seqs} max_num_batched_tokens="
        f"{sched.max_num_batched_tokens} block_size={cache.block_size} "
        f"num_blocks={cache.num_blocks} prefix_caching={args.prefix_caching}"
    )
    print(
        f"transformers: batch_size={args.batch_size or 'all'}, left-padded to the batch's "
        f"longest prompt, generating to its longest output, "
        f"attn_implementation={hf.config._attn_implementation}"
    )


def print_generate(pair: Pair, w: Workload) -> None:
    ours, hf = pair.best_ours, pair.best_hf
    useful = w.num_output_tokens
    ratios = pair.ratios
    print(f"\n{w.name} ({len(w.prompt_lens)} requests, {useful} output tokens), best of rounds:")
    print(f"  ours          {ours.seconds:7.3f} s  {useful / ours.seconds:8.1f} generated tok/s")
    print(f"  transformers  {hf.seconds:7.3f} s  {useful / hf.seconds:8.1f} generated tok/s")
    print(
        f"  ours / transformers (tok/s): best {hf.seconds / ours.seconds:.2f}x, per round "
        f"{' '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f}x)"
    )
    print(f"  greedy outputs identical: {pair.num_identical}/{pair.num_compared}")


def print_prefill(gen: Pair, prefill: Pair, w: Workload, floor_ms: float) -> None:
    ours, hf = prefill.best_ours.seconds, prefill.best_hf.seconds
    print("\nequal, prefill only (1 new token):")
    print(f"  ours          {ours:7.3f} s  {w.num_prompt_tokens / ours:8.1f} prompt tok/s")
    print(f"  transformers  {hf:7.3f} s  {w.num_prompt_tokens / hf:8.1f} prompt tok/s")
    print(f"  speedup ours vs transformers (time): {hf / ours:.2f}x")
    steps = max(w.output_lens) - 1
    if steps < 1:
        return
    ours_ms = (gen.best_ours.seconds - ours) / steps * 1e3
    hf_ms = (gen.best_hf.seconds - hf) / steps * 1e3
    print(
        f"  derived decode step (generate - prefill) / {steps}: ours {ours_ms:.1f} ms, "
        f"transformers {hf_ms:.1f} ms, speedup {hf_ms / ours_ms:.2f}x"
    )
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


def workload_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"workloads are a comma list of {', '.join(WORKLOADS)}")
    return names


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="small-llama", help="built-in preset (cached build)")
    src.add_argument(
        "--model", help="instead of a preset: a checkpoint folder, a .gguf file or smollm2-135m"
    )
    p.add_argument("--workloads", type=workload_list, default=list(WORKLOADS), help="comma list")
    p.add_argument("--num-prompts", type=int, default=16, help="equal")
    p.add_argument("--prompt-len", type=int, default=64, help="equal")
    p.add_argument("--output-len", type=int, default=64, help="equal")
    p.add_argument("--trace", type=Path, default=default_trace(), help="conversation")
    p.add_argument("--conv-requests", type=int, default=32, help="conversation")
    p.add_argument("--conv-token-scale", type=float, default=0.5, help="conversation")
    p.add_argument("--conv-max-prompt-len", type=int, default=1024, help="conversation")
    p.add_argument("--conv-max-output-len", type=int, default=128, help="conversation")
    p.add_argument("--prefill-requests", type=int, default=32, help="prefill-heavy")
    p.add_argument("--prefill-prompt-len", type=int, default=320, help="prefill-heavy (mean)")
    p.add_argument("--prefill-output-len", type=int, default=4, help="prefill-heavy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="rounds per workload (both sides)")
    p.add_argument("--batch-size", type=int, default=0, help="transformers (0: all prompts)")
    p.add_argument("--max-num-seqs", type=int, default=0, help="ours (0: all prompts)")
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="ours (0: default)")
    p.add_argument("--block-size", type=int, default=16, help="ours")
    p.add_argument("--num-blocks", type=int, default=0, help="ours (0: enough for all)")
    p.add_argument("--prefix-caching", choices=["on", "off"], default="on", help="ours")
    p.add_argument("--no-prefill", dest="prefill", action="store_false", help="skip 1-token pass")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument(
        "--quantization", choices=QUANTIZATIONS, default=DEFAULT_QUANTIZATION, help="ours"
    )
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "auto"), default="float32",
        help="ours (float32: the exact mode, as transformers')",
    )  # fmt: skip
    p.add_argument(
        "--hf-dtype", choices=("float32", "bfloat16"), default="float32", help="transformers"
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir, label = resolve_model(args)
    hf_model = load_hf(model_dir, getattr(torch, args.hf_dtype))
    first_token_id = max(Tokenizer(model_dir).special_ids, default=-1) + 1
    workloads = build_workloads(args, vocab_size_of(hf_model), first_token_id)
    llm = build_llm(model_dir, args, workloads)
    print_config(args, label, model_dir, hf_model, llm, workloads)
    floor_ms = print_floor(hf_model) if args.prefill and "equal" in args.workloads else None

    def ours(prompts: list[list[int]], output_lens: list[int]) -> Timing:
        return run_ours(llm, prompts, output_lens)

    def hf(prompts: list[list[int]], output_lens: list[int]) -> Timing:
        return run_hf(hf_model, prompts, output_lens, args.batch_size or len(prompts))

    warmup = workloads[0]
    warmup = Workload("warmup", warmup.prompt_lens[:2], [4, 4], warmup.vocab_size, first_token_id)
    ours(warmup.prompts(args.seed * 1000 + 999), warmup.output_lens)
    hf(warmup.prompts(args.seed * 1000 + 999), warmup.output_lens)
    for i, w in enumerate(workloads):
        gen = measure(ours, hf, w, args.seed + 1 + 2 * i, args.repeats)
        print_generate(gen, w)
        if w.name == "equal" and floor_ms is not None:
            prefill = measure(ours, hf, w.with_outputs(1), args.seed + 2 + 2 * i, args.repeats)
            print_prefill(gen, prefill, w, floor_ms)
    print(f"\nload average at the end: {loadavg()}")


if __name__ == "__main__":
    main()
