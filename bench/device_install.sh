#!/usr/bin/env bash
# The one install step on a lent GPU machine (and in bench/device_dry_run.sh): the wheels in .whl/
# (bench/device_wheels.sh) into SITE, with no index and no dependency resolution, in a few seconds.
#
#   eval "$(bash bench/device_install.sh /tmp/site | tee /dev/stderr | grep '^export PYTHONPATH=')"
#
# Prints one line per installed distribution (name version), a WARN line (stderr) for a need of a
# carried package that the environment does not meet, and last the PYTHONPATH to use: SITE first (the
# carried transformers wins over the image's), then the repo root (`import launcher` without
# installing the project). python3 is the one in PATH; PYTHON overrides it.
set -uo pipefail
SITE=${1:?usage: bash bench/device_install.sh SITE}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
shopt -s nullglob
wheels=("$ROOT"/.whl/*.whl)
((${#wheels[@]})) || { echo "device_install: no wheels in $ROOT/.whl (run bench/device_wheels.sh; carry .whl)" >&2; exit 1; }
mkdir -p "$SITE" && SITE=$(cd "$SITE" && pwd) || exit 1
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
  || { echo "device_install: pip install of ${#wheels[@]} wheels into $SITE failed (see above)" >&2; exit 1; }
PYTHONPATH="$SITE:$ROOT" "$PY" - "$SITE" <<'EOF' || exit 1
import importlib.metadata as md, sys
site = sys.argv[1]
dists = sorted(md.distributions(path=[site]), key=lambda d: d.metadata["Name"].lower())
for d in dists:
    print(d.metadata["Name"], d.version)
try:
    from packaging.requirements import Requirement
except ImportError:
    sys.exit(0)
for d in dists:
    for r in map(Requirement, d.requires or []):
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(r.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or not r.specifier.contains(have, prereleases=True):
            print(f"WARN {d.metadata['Name']} needs {r}, found {have or 'none'}", file=sys.stderr)
EOF
echo "export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
