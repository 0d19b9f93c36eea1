"""The one logging set-up every Daybreak process calls first: key=value lines on stderr.

Operator, agent, engines, the load generator, the dev tools and the test
harnesses all log the same way, so one grep (``level=WARNING``,
``logger=daybreak.agent``) works across every process of a cluster. A base
module: it imports nothing from daybreak, so every layer may call it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

FORMAT = "%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"
# Libraries that narrate every connection at INFO: only their problems belong in our logs.
NOISY = ("aiohttp",)


def setup_logging(level: str | int = "INFO", *, quiet: Iterable[str] = NOISY) -> None:
    """Log records at ``level`` (a name such as ``"info"``, any case, or a ``logging`` number) and above to stderr.

    Like ``logging.basicConfig`` it does nothing when the root logger already has
    a handler (pytest's capture, an embedding application). The loggers in
    ``quiet`` are held at WARNING unless ``level`` is DEBUG.
    """
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    logging.basicConfig(level=numeric, stream=sys.stderr, format=FORMAT)
    for name in quiet:
        logging.getLogger(name).setLevel(logging.DEBUG if numeric <= logging.DEBUG else logging.WARNING)
