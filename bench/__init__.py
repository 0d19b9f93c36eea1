"""Benchmarks (``make bench`` / ``daybreak bench``): measured side by side with their anchors."""
