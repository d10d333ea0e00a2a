"""What one image costs to encode, next to the prefill of the prompt it ends up in.

The prompt is exactly what `pdcluster bench --image-fraction 1` sends (benchmarks.workload):
the chat template around one random PNG and `--prompt-len` words, tokenized and expanded by
the engine's processor. With `--threads` torch threads (default 1, what an instance with one
Ray CPU gets), interleaved over `--repeats` rounds with a fresh image each, it times

- encode: vision tower + projector on the image (what E runs per image; P runs it in 1P1D),
- prefill: the decoder over the whole prompt, image embeddings merged (what P runs),
- decode: one decode step of that request at its full context (what D runs per token),

and prints medians, encode ÷ prefill, and P's work per request in 1P1D (encode + prefill)
against E/P/D's slowest stage (max of the two): the capacity a separate encoder can add.

    python -m pdcluster.benchmarks.encode_prefill [--model preset:small-llava] [--prompt-len 64]
        [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from pdcluster.benchmarks import report
from pdcluster.benchmarks.workload import RequestSpec, request_body
from pdcluster.engine import LLM
from pdcluster.engine.attention import AttentionMetadata, allocate_kv_cache
from pdcluster.engine.multimodal import decode_data_url, load_image
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16


def image_request(llm: LLM, prompt_len: int, seed: int) -> Request:
    """The request the gateway builds for one benchmark chat request with an image."""
    _, body = request_body(RequestSpec(0.0, prompt_len, 1, True), "m", random.Random(seed))
    messages = body["messages"]
    image_part = next(p for p in messages[0]["content"] if p["type"] == "image_url")
    image = load_image(decode_data_url(image_part["image_url"]["url"]))
    prompt = {
        "prompt_token_ids": llm.tokenizer.encode_chat(messages),
        "multi_modal_data": {"image": image},
    }
    return llm.processor.process(f"r{seed}", prompt, SamplingParams(max_tokens=1))


def timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


def measure_once(llm: LLM, request: Request) -> dict[str, float]:
    """Encode, prefill and one decode step of `request`, in ms."""
    model = llm.engine.runner.model
    info = llm.engine.model_info
    ids = torch.tensor(request.prompt_token_ids)
    num_tokens = len(request.prompt_token_ids)
    table = list(range(-(-(num_tokens + 1) // BLOCK_SIZE)))
    kv_cache = allocate_kv_cache(len(table), BLOCK_SIZE, info, llm.engine.dtype, "cpu")
    pixels = torch.stack([f.pixel_values for f in request.mm_features])  # [1, 3, S, S]
    with torch.inference_mode():
        encode_ms, images = timed(lambda: model.embed_images(pixels))  # [1, P, hidden]

        def prefill() -> torch.Tensor:
            embeds = model.embed_tokens(ids)  # [T, hidden]
            embeds[ids == info.image_token_id] = images.reshape(-1, info.hidden_size)
            meta = AttentionMetadata.build([0], [num_tokens], [table], BLOCK_SIZE, "cpu")
            hidden = model(embeds, meta.positions, kv_cache, meta)  # [T, hidden]
            return model.compute_logits(hidden[-1:])  # [1, vocab]

        prefill_ms, logits = timed(prefill)

        def decode() -> torch.Tensor:
            token = logits.argmax(-1)  # [1]
            meta = AttentionMetadata.build([num_tokens], [1], [table], BLOCK_SIZE, "cpu")
            hidden = model(model.embed_tokens(token), meta.positions, kv_cache, meta)
            return model.compute_logits(hidden)

        decode_ms, _ = timed(decode)
    return {"encode_ms": encode_ms, "prefill_ms": prefill_ms, "decode_ms": decode_ms}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--model", default="preset:small-llava", help="a multimodal model")
    p.add_argument("--prompt-len", type=int, default=64, help="words of text next to the image")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = report.machine_info()
    llm = LLM(args.model)
    if not llm.engine.model_info.is_multimodal:
        raise SystemExit(f"{args.model} takes no images")
    requests = [image_request(llm, args.prompt_len, seed) for seed in range(args.repeats + 1)]
    measure_once(llm, requests[0])  # warm-up
    rounds = [measure_once(llm, r) for r in requests[1:]]
    machine["loadavg_end"] = report.loadavg()
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    encode, prefill = med["encode_ms"], med["prefill_ms"]
    info = llm.engine.model_info
    print(report._machine_line(machine))
    print(
        f"model {args.model}: prompt {len(requests[1].prompt_token_ids)} tokens "
        f"({info.num_image_tokens} image tokens + chat template + {args.prompt_len} words), "
        f"{args.threads} torch thread(s), medians of {args.repeats} rounds"
    )
    for key in ("encode_ms", "prefill_ms", "decode_ms"):
        values = ", ".join(f"{r[key]:.0f}" for r in rounds)
        print(f"  {key.removesuffix('_ms'):8s} {med[key]:8.1f} ms   [{values}]")
    print(f"  encode ÷ prefill {encode / prefill:.2f}; encode is {encode / (encode + prefill):.0%} "
          f"of P's work per request in 1P1D")  # fmt: skip
    print(f"  P's work per image request: 1P1D {encode + prefill:.0f} ms (encode + prefill); "
          f"E/P/D's slowest stage {max(encode, prefill):.0f} ms → at most "
          f"{(encode + prefill) / max(encode, prefill):.2f}× the image-request capacity, "
          f"given a core per stage")  # fmt: skip


if __name__ == "__main__":
    main()
