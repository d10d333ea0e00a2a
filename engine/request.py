"""A request's state inside one engine instance, and its ordered status enum."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pdcluster.connectors.base import KVTransferParams
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdcluster.engine.outputs import PromptLogprobs


class RequestStatus(enum.IntEnum):
    """Ordered: every state greater than PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class PixelSource(Protocol):
    """Pixels kept elsewhere (e.g. in an object store), fetched only by an instance that runs
    the encoder on them."""

    def load(self) -> torch.Tensor: ...  # [3, H, W], float32


@dataclass
class MultiModalFeature:
    """One image in a prompt: its placeholder run and (optionally) its pixels.

    `offset` is the index of the first placeholder token in the prompt and `length` the number
    of placeholder tokens, which equals the number of encoder embeddings it expands to.
    The pixels are `pixel_values`, or fetched from `pixel_source` on first use; an instance
    that only loads this feature's encoder output from a connector never fetches them.
    """

    mm_hash: str
    offset: int
    length: int
    pixel_values: torch.Tensor | None = None  # [3, H, W], float32
    pixel_source: PixelSource | None = None

    @property
    def has_pixels(self) -> bool:
        return self.pixel_values is not None or self.pixel_source is not None

    def pixels(self) -> torch.Tensor | None:
        if self.pixel_values is None and self.pixel_source is not None:
            self.pixel_values = self.pixel_source.load()
        return self.pixel_values

    @property
    def end(self) -> int:
        return self.offset + self.length


class Request:
    """Mutable per-request state owned by the scheduler. The runner never touches it."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int] | None = (),
        mm_features: list[MultiModalFeature] | None = None,
        kv_transfer_params: KVTransferParams | Mapping[str, object] | None = None,
        arrival_time: float | None = None,
        num_prior_output_tokens: int = 0,
        prior_output_text: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids or ())  # the model's stop tokens, all of them
        self.mm_features = sorted(mm_features or [], key=lambda f: f.offset)
        # The P->D handoff. vLLM's public dict form ({"do_remote_decode": True}) is
        # converted here, once: inside the cluster it travels as KVTransferParams.
        self.kv_transfer_params = KVTransferParams.of(kv_transfer_params)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # The last this-many prompt tokens were generated before this instance took the
        # request over (a D continues after P's first token): penalties count them as output.
        self.num_prior_output_tokens = num_prior_output_tokens
        # The text of those tokens that reached the client (None: unknown, they are decoded
        # as prompt context): the detokenizer goes on from it, so that text held back on
        # the earlier instance (a possible stop string) is not lost and a stop string
        # across the boundary is found.
        self.prior_output_text = prior_output_text
        # Requests share prefix blocks only when their salts are equal (None: unsalted).
        self.cache_salt = cache_salt
        self.priority = priority  # under the priority policy: lower is scheduled first
        # The LoRA adapter it runs under (None: the base model); its blocks are its own.
        self.lora_request = lora_request

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first schedule; -1: not yet
        self.num_preemptions = 0
        self.queued_time = 0.0  # this instance's clock when its scheduler took the request in
        self.queue_time_s: float | None = None  # waited before first scheduled; not reported yet
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # set with FINISHED_ERROR
        self.block_hashes: list[int] = []  # hash chain of full blocks, kept by the KV manager
        # With prompt_logprobs: those of the prompt chunks computed so far (until the first
        # output carries them).
        self.prompt_logprobs: PromptLogprobs | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def append_output_token(self, token_id: int, logprob: float | None = None) -> None:
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
