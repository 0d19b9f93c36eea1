"""Compile the test build of the Sunrise libraries (libtangrt_shared.so, libptml_shared.so) with gcc."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent
LIBRARIES = {"libtangrt_shared.so": "libtangrt_shared.c", "libptml_shared.so": "libptml_shared.c"}


def build(out_dir: Path) -> Path:
    """Build both libraries into ``out_dir`` and return it; fails loudly when gcc is missing."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc not found: the Sunrise test libraries are compiled by the test suite")
    out_dir.mkdir(parents=True, exist_ok=True)
    for lib, src in LIBRARIES.items():
        subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-o", str(out_dir / lib),
                        str(SOURCE / src), "-lpthread"], check=True, capture_output=True, text=True)
    return out_dir


def node(bus_ids: list[str], *, links: list[list[int]] | None = None, memory_bytes: int = 1 << 30,
         name: str = "Sunrise S2") -> str:
    """The JSON for DAYBREAK_FAKE_SUNRISE: one device per bus id, links as [chip, port, chip, port(, up)]."""
    config: dict[str, Any] = {
        "devices": [{"bus_id": b, "memory_bytes": memory_bytes, "name": name, "uuid": f"SR-{i:04d}"}
                    for i, b in enumerate(bus_ids)],
        "links": links or [],
    }
    return json.dumps(config)


def counters(lib_dir: Path | str) -> dict[str, int]:
    """What this process's loaded stand-in Tang library counted (``fakeTangCounters``, a test hook): host
    registrations, H2D/D2H copies whose host side was registered (``pinned``) or not (``pageable``), and bytes."""
    import ctypes

    lib = ctypes.CDLL(str(Path(lib_dir) / "libtangrt_shared.so"))  # the handle the runtime already opened
    out = (ctypes.c_ulonglong * 5)()
    lib.fakeTangCounters(out)
    return dict(zip(("registrations", "pinned_copies", "pageable_copies", "pinned_bytes", "pageable_bytes"),
                    (int(v) for v in out), strict=True))
