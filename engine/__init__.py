"""One serving instance with no Ray: scheduler, KV cache, model runner, offline LLM API."""
