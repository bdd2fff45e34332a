#!/usr/bin/env bash
# The tests that depend most on torch's internals (the private-API probes, models nobody here wrote, the compile
# cache), on each torch version the project supports at its ends: the oldest pyproject.toml declares and the newest
# installable here. Each version in a fresh virtual environment of its own; prints the install and test times.
#
#   bash .ci/torch_versions.sh                 # torch 2.9.1 and 2.14.1
#   TORCH_VERSIONS="2.11.0" bash .ci/torch_versions.sh
#
# From PyPI these are CUDA builds (torch 2.9.1: a 900 MB wheel and about 3 GB of nvidia-* wheels); they run on the
# CPU. Not part of .ci/run. Measured 2026-11-25 on 2 shared cores: torch 2.9.1 install 453 s, tests 484 s (4 failed:
# fixed since but T5, whose transformers code Dynamo 2.9 cannot trace whole: copy.deepcopy in get_text_config);
# torch 2.14.1 install 133 s (the common packages cached by then), tests 297 s, all passed.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=${TORCH_VERSIONS:-"2.9.1 2.14.1"}
root=${TORCH_VERSIONS_DIR:-/tmp/compile_trainer_torch_versions}
tests=(tests/test_compat.py tests/test_real_models.py tests/test_compile_cache.py tests/test_precompiled.py)
summary=()
for version in $versions; do
  venv="$root/torch-$version"
  rm -rf "$venv"
  started=$SECONDS
  python -m venv "$venv"
  "$venv/bin/python" -m pip install -q "torch==$version"
  "$venv/bin/python" -m pip install -q -e ".[dev]"
  installed=$SECONDS
  echo "+ torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'): ${tests[*]}"
  status=0
  "$venv/bin/python" -m pytest -q -n 2 "${tests[@]}" || status=$?
  summary+=("torch $version: install $((installed - started)) s, tests $((SECONDS - installed)) s, pytest exit $status")
done
printf '%s\n' "${summary[@]}"
