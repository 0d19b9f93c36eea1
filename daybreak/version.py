"""The Daybreak release version (single source for packaging and the CLI)."""

__version__ = "0.1.0"
