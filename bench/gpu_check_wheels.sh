#!/usr/bin/env bash
# Wheels for bench/gpu_check.sh on a GPU machine without network: every line of
# requirements/gpu-check.txt, without dependencies, for CPython 3.12 on x86-64 Linux (PY_VERSION
# to change it), into OUTDIR (default .whl, which git ignores). A distribution published only as
# source is built here into a wheel, which must be pure Python (antlr4-python3-runtime). Prints
# the total size and fails above LIMIT_MIB (default 48): the source tree and the wheels travel together.
#   bench/gpu_check_wheels.sh [OUTDIR]        (PYTHON: any interpreter with pip; default python3)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/.whl}
py=${PYTHON:-python3}
ver=${PY_VERSION:-3.12}
limit=${LIMIT_MIB:-48}
mkdir -p "$out"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
pip=("$py" -m pip -q --disable-pip-version-check)
while read -r req; do
  req=${req%%#*}; req=${req//[[:space:]]/}
  [ -n "$req" ] || continue
  if ! "${pip[@]}" download --no-deps --only-binary=:all: --python-version "$ver" --implementation cp \
      "${platforms[@]}" -d "$out" "$req" 2>/dev/null; then
    tmp=$(mktemp -d)
    "${pip[@]}" wheel --no-deps -w "$tmp" "$req"
    for w in "$tmp"/*.whl; do
      case $(basename "$w") in
        *-py3-none-any.whl|*-py2.py3-none-any.whl) mv "$w" "$out/" ;;
        *) echo "gpu_check_wheels: error: $req has no wheel for Python $ver and builds only $(basename "$w"), not pure Python" >&2
           rm -rf "$tmp"; exit 1 ;;
      esac
    done
    rm -rf "$tmp"
  fi
done < "$root/requirements/gpu-check.txt"
wheels=("$out"/*.whl)
printf '%s\n' "${wheels[@]}"
bytes=$(cat "${wheels[@]}" | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "gpu_check_wheels: ${#wheels[@]} wheels, $mib MiB in $out"
if [ "$bytes" -gt $((limit * 1048576)) ]; then
  echo "gpu_check_wheels: error: $mib MiB is over the $limit MiB limit" >&2
  exit 1
fi
