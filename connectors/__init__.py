"""Inference-engine connectors to the Daybreak KV pool (vLLM's ``KVConnectorBase_V1``; see docs/engines.md)."""
