"""One serving instance with no Ray: scheduler, KV cache, model runner, offline LLM API."""

from pdcluster.engine.llm import LLM, CompletionOutput, RequestOutput
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
