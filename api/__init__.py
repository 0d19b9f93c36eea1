"""Shared models: the CRD types and wire definitions used by operator, agent and client (no I/O)."""
