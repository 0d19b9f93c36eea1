#!/usr/bin/env bash
# Make the distribution's pyverbs importable from the venv (DESIGN.md §5).
# pyverbs is not on PyPI in a usable form; Debian ships it as python3-pyverbs for
# the system Python 3.11, whose extension ABI the venv's 3.11 shares. Optional:
# without it the agent advertises tcp only, so every failure here is a note.
set -u
venv_python=${1:?usage: pyverbs.sh VENV_PYTHON}
dist=/usr/lib/python3/dist-packages/pyverbs
"$venv_python" -c 'import pyverbs' 2>/dev/null && exit 0
if [ ! -d "$dist" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "installing python3-pyverbs (Debian) for the rdma transport"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-pyverbs >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-pyverbs >/dev/null 2>&1; }
fi
if [ ! -d "$dist" ]; then
  echo "note: python3-pyverbs is not available; rdma runs only against the pyverbs fake in tests"
  exit 0
fi
site=$("$venv_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ln -sfn "$dist" "$site/pyverbs"
if ! "$venv_python" -c 'import pyverbs.device' 2>/dev/null; then
  rm -f "$site/pyverbs"
  echo "note: the distribution's pyverbs does not import into this venv's Python (ABI mismatch); left out"
fi
exit 0
