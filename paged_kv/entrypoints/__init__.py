"""Entry points: the engine served over HTTP, as vLLM serves it (lesson 16).

* :mod:`~paged_kv.entrypoints.openai`: ``paged-kv serve``, an OpenAI-compatible API (vLLM:
  ``vllm/entrypoints/openai/``) with ``/metrics`` by vLLM's names;
* :mod:`~paged_kv.entrypoints.kv_page`: the KV cache, live, in a page the server serves.
"""
