#!/usr/bin/env bash
# Installs SGLang 0.5.17, the smoke-only native-ops plugin and eagle3d (this checkout) into SITE
# on the GPU machine, from a bundle that build_bundle.sh made on a machine with the registry.
#   bench/sglang_h200/install.sh BUNDLE SITE
# Then: export PYTHONPATH=SITE:bench/sglang_h200/stubs (stubs after SITE).
set -euo pipefail
here=$(dirname "$(realpath "$0")"); bundle=$(realpath "$1"); site=$(realpath -m "$2")
mkdir -p "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$bundle"/wheels/*.whl
tar xJf "$bundle/sk.tar.xz" -C "$site"
tar xJf "$bundle/fi.tar.xz" -C "$site"
cp -r "$here"/native_ops/. "$site"/
python3 "$here/patch_sglang.py" "$site"
# eagle3d itself, so that SGLang finds the capture plugin's entry point, built with the bundle's
# setuptools (the machine's may be older than eagle3d's pyproject.toml needs).
python3 -m pip install -q --no-index --find-links "$bundle/build" --no-deps --no-compile --upgrade \
  --target "$site" "$here/../.."
