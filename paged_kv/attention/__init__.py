"""Attention over the paged cache: decode and prefill, by gather, in place or by FlexAttention (lesson 05)."""
