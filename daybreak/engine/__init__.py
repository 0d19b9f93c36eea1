"""Inference engines Daybreak drives: the simulated engine and the PD router."""
