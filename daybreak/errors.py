"""The root of every exception Daybreak raises on purpose: ``except DaybreakError`` catches them all.

This is the lowest layer of the package and imports nothing from daybreak, so
every other module (``api/`` and ``pool/`` included) can derive from it.
Classes keep the standard-library base their callers already catch
(``ValueError``, ``OSError``, ``RuntimeError``) through multiple inheritance.
"""

from __future__ import annotations


class DaybreakError(Exception):
    """Base of all Daybreak errors; the message says what failed and what to do next."""
