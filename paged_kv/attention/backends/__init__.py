"""The attention backends, one module each, found by name in :mod:`paged_kv.attention.registry`
(lessons 05, 06, 12).

``gather`` (``GATHER``, the course's reference), ``in_place`` (``IN_PLACE``, the course's block by
block products), ``flex_attention`` (``FLEX_ATTENTION``), ``triton_attn`` (``TRITON_ATTN``) and
``cpu_attn`` (``CPU_ATTN``): vLLM 0.33.0 keeps its backends in ``vllm/v1/attention/backends/`` the
same way, one module per backend, named in its ``AttentionBackendEnum``.
"""
