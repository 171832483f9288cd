"""The host (CPU memory) tier: its manager, worker and sizing (vLLM's ``vllm/v1/kv_offload/cpu/``;
lesson 11)."""
