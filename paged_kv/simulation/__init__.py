"""Workloads and simulations with no model (lessons 00, 07, 08).

``fragmentation`` (lesson 00's benchmark), ``contiguous`` (first fit in one address space),
``shares`` (where the KV memory goes, as the vLLM paper's Figure 2), ``workload`` (the policies and
the serving simulator), ``sharing`` (shared system prompts and prefix caching).
"""
