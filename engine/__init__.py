"""One serving instance with no Ray: scheduler, KV cache, model runner, offline LLM API."""

from engine.llm import LLM, CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
