"""Daybreak: PD-disaggregated LLM inference on a pooled, tiered KV cache.

The distribution maps the repository's top-level folders to subpackages:
``api/`` is ``daybreak.api``, ``operator/`` is ``daybreak.operator``,
``agent/`` is ``daybreak.agent``, ``client/`` is ``daybreak.client`` and
``bench/`` is ``daybreak.bench``.
"""

from daybreak.version import __version__

__all__ = ["__version__"]
