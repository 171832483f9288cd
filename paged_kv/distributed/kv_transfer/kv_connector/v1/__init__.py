"""vLLM v1's KV connector (lesson 11): :mod:`.base` (the interface) and :mod:`.offloading_connector`."""
