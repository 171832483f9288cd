"""Workloads and simulations with no model (lessons 00, 06, 07): fragmentation, policies, shared prompts."""
