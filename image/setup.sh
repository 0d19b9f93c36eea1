#!/bin/sh
# Steps that run inside the image's root filesystem, shared by both ways of building it: the local build
# (daybreak/devenv/image.py runs them in a chroot, one OCI layer each) and image/Dockerfile (one RUN each).
#   setup.sh requirements PYPROJECT      print the runtime requirements (dependencies + the nvidia extra)
#   setup.sh user                        add the non-root user daybreak (uid/gid 65532)
#   setup.sh deps PYPROJECT PYVERBS_SH [WHEELDIR]
#                                        make the venv /opt/daybreak with the requirements (offline from
#                                        WHEELDIR when given) and link Debian's pyverbs into it
#   setup.sh app WHEEL                   install the daybreak wheel (no dependencies) and put it on PATH
set -eu
VENV=/opt/daybreak
UID_GID=65532

requirements() {
  python3 - "$1" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
# The nvidia extra is small (NVML bindings) and lets the same image serve NVIDIA nodes.
for line in project["dependencies"] + project["optional-dependencies"]["nvidia"]:
    print(line)
PY
}

case "${1:-}" in
requirements)
  requirements "$2"
  ;;
user)
  groupadd --system --gid "$UID_GID" daybreak
  useradd --system --uid "$UID_GID" --gid "$UID_GID" --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin daybreak
  ;;
deps)
  requirements "$2" > /tmp/daybreak-requirements.txt
  python3 -m venv "$VENV"
  if [ -n "${4:-}" ]; then
    "$VENV/bin/pip" install --quiet --no-cache-dir --no-index --find-links "$4" -r /tmp/daybreak-requirements.txt
  else
    "$VENV/bin/pip" install --quiet --no-cache-dir -r /tmp/daybreak-requirements.txt
  fi
  rm -f /tmp/daybreak-requirements.txt
  # The same link `make rdma-deps` makes in a development venv; here its absence is a build error.
  sh "$3" "$VENV/bin/python"
  "$VENV/bin/python" -c 'import pyverbs.device' \
    || { echo "pyverbs does not import from $VENV (is python3-pyverbs installed?)" >&2; exit 1; }
  ;;
app)
  "$VENV/bin/pip" install --quiet --no-cache-dir --no-deps "$2"
  for script in daybreak kubectl-daybreak; do
    ln -sfn "$VENV/bin/$script" "/usr/local/bin/$script"
  done
  "$VENV/bin/daybreak" version
  ;;
*)
  echo "usage: setup.sh requirements PYPROJECT | user | deps PYPROJECT PYVERBS_SH [WHEELDIR] | app WHEEL" >&2
  exit 2
  ;;
esac
