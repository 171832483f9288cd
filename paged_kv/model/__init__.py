"""The tiny GPT, its two KV caches and greedy generation (lesson 09)."""
