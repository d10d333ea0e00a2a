"""Throughput of a batch spread over LoRA adapters against the same batch on the base model,
on one cluster, and a run-time adapter load under load.

Writes `--adapters` + 1 random PEFT-format adapters (rank `--rank` on every attention and MLP
projection) for the model, launches one cluster with `enable_lora` serving the first
`--adapters` of them, warms every model up, then alternates for `--rounds` rounds: `--streams`
requests at once on the base model, and the same requests spread round-robin over the
adapters. Output tokens/s of each (best round kept) and their ratio are printed (the goal:
>= 0.8x). In the last adapter round the spare adapter is loaded through the cluster while
the streams run (as `POST /v1/load_lora_adapter` does); every stream must end whole (0
failed), and a request on the new adapter runs after it.

    python -m pdcluster.benchmarks.lora [--model smollm2-135m] [--prefills 1 --decodes 1 |
        --mixed 1] [--streams 32] [--adapters 4] [--rank 16] [--max-tokens 64]
        [--prompt-tokens 64] [--rounds 2] [--quantization none]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdcluster.benchmarks.report import loadavg
from pdcluster.cluster.client import Cluster
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.control.launch import launch
from pdcluster.engine import SamplingParams
from pdcluster.engine.config import DEFAULT_QUANTIZATION, QUANTIZATIONS
from pdcluster.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoRARequest
from pdcluster.engine.lora.layers import adaptable_shapes
from pdcluster.engine.models.loader import load_model
from pdcluster.engine.presets import resolve_model_dir


def write_adapter(out: Path, shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> Path:
    """A random LoRA adapter in PEFT's files (small weights: outputs stay the model's own
    kind of text, as a fine-tune's do)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (n_in, n_out) in shapes.items():
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE))
    targets = sorted({m.rsplit(".", 1)[-1] for m in shapes})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (out / CONFIG_FILE).write_text(json.dumps(config))
    return out


async def one_batch(
    cluster: Cluster,
    loras: list[LoRARequest | None],
    prompts: list[list[int]],
    params: SamplingParams,
    load_midway: LoRARequest | None = None,
) -> tuple[float, int, int]:
    """(output tokens/s, streams that failed, output tokens) of `prompts` at once, request i
    under `loras[i % len(loras)]`; with `load_midway`, that adapter is loaded once the
    streams have started."""
    started = time.perf_counter()
    calls = [
        cluster.generate_async([p], params, loras[i % len(loras)]) for i, p in enumerate(prompts)
    ]
    running = asyncio.gather(*calls)
    if load_midway is not None:
        await asyncio.sleep(0.5)
        await cluster.load_lora_adapter(load_midway.name, load_midway.path)
    outs = [o[0] for o in await running]
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    failed = sum(o.finish_reason != "length" or len(o.token_ids) != params.max_tokens for o in outs)
    return tokens / elapsed, failed, tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prefills", type=int, default=1)
    p.add_argument("--decodes", type=int, default=1)
    p.add_argument("--mixed", type=int, default=0, help="colocated instances instead of P/D")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=DEFAULT_QUANTIZATION)
    args = p.parse_args(argv)

    model_dir = resolve_model_dir(args.model)
    model, info = load_model(model_dir, torch.device("cpu"), torch.float32)
    shapes = adaptable_shapes(model)  # module name -> (in, out), as the engine reads them
    del model
    folder = Path(tempfile.mkdtemp(prefix="pdcluster-lora-"))
    adapters = [
        LoRARequest(f"adapter-{i}", str(write_adapter(folder / f"a{i}", shapes, args.rank, i)))
        for i in range(args.adapters + 1)
    ]
    spare, served = adapters[-1], adapters[:-1]
    roles = (
        {"mixed": {"count": args.mixed}}
        if args.mixed
        else {"prefill": {"count": args.prefills}, "decode": {"count": args.decodes}}
    )
    config = ClusterConfig.model_validate({
        "model": model_dir,
        **roles,
        "engine": {
            "enable_lora": True, "max_loras": args.adapters, "max_lora_rank": args.rank,
            "max_cpu_loras": args.adapters + 1, "quantization": args.quantization,
            "max_num_seqs": max(args.streams, 1), "max_model_len": 2048,
            "lora_modules": {a.name: a.path for a in served},
        },
    })  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = info.vocab_size
    prompts = [
        torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()
        for _ in range(args.streams)
    ]
    base: list[float] = []
    spread: list[float] = []
    failed = 0
    with launch(config) as cluster:
        warm = [None, *served]
        asyncio.run(one_batch(cluster, warm, prompts[: len(warm)], params))
        for r in range(args.rounds):
            base.append(asyncio.run(one_batch(cluster, [None], prompts, params))[0])
            load = spare if r == args.rounds - 1 else None
            rate, n_failed, _ = asyncio.run(one_batch(cluster, served, prompts, params, load))
            spread.append(rate)
            failed += n_failed
        after = asyncio.run(one_batch(cluster, [cluster.adapters[spare.name]], prompts[:1], params))
    topology = f"{args.mixed} mixed" if args.mixed else f"{args.prefills}P{args.decodes}D"
    print(f"model {args.model} ({args.quantization}), {topology}, {args.streams} streams x "
          f"{args.max_tokens} tokens, {args.adapters} adapters of rank {args.rank}, "
          f"load {loadavg()}")  # fmt: skip
    print(f"base model alone:  {max(base):8.1f} tok/s  (rounds {[round(x, 1) for x in base]})")
    print(f"over {args.adapters} adapters: {max(spread):8.1f} tok/s  "
          f"(rounds {[round(x, 1) for x in spread]})")  # fmt: skip
    print(f"ratio: {max(spread) / max(base):.2f}x (goal >= 0.8x)")
    print(f"adapter loaded under load: {failed} failed streams; a request on it after: "
          f"{after[2]} tokens, {after[1]} failed")  # fmt: skip


if __name__ == "__main__":
    main()
