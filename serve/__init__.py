"""The OpenAI-compatible server of jaxllm (``jaxllm serve``): Quart app, protocol, SSE, metrics."""
