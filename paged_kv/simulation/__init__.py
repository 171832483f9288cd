"""Workloads and simulations with no model: fragmentation, memory policies, shared prompts (00, 06, 07)."""
