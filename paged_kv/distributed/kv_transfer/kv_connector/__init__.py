"""KV connectors (vLLM's ``kv_connector/``; lesson 11): only v1's interface here."""
