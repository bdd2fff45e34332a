#!/usr/bin/env bash
# The tests that depend most on torch's internals (the private-API probes, models nobody here wrote, the bucket
# warm-up's traces, per-block values the compiler may specialize, the telemetry's events and FLOPs count in a real
# fit, background compiles: 2.11+, skipped before with the refusal's reason), on each end of the torch versions the
# project supports: the oldest pyproject.toml declares and the newest installable here. Each version in a virtual
# environment of its own, holding torch and the project's dependencies (not the project: the tests import it from
# this checkout).
#
#   bash .ci/torch_versions.sh            # install, then test
#   bash .ci/torch_versions.sh install    # build the environments, side by side
#   bash .ci/torch_versions.sh test       # test in environments built before
#   TORCH_VERSIONS="2.11.0" bash .ci/torch_versions.sh
#
# From PyPI these are CUDA builds (torch 2.9.1: a 900 MB wheel and about 3 GB of nvidia-* wheels); they run on
# the CPU. Each environment's install and test times are printed.
#
# The newest environment also holds torchvision and timm (timm without its dependencies: torchvision, pyyaml,
# huggingface_hub and safetensors are there) and runs the tier `vision` (tests/conftest.py: TIERS) there: timm imports
# torchvision, and PyPI's torchvision does not import beside the CPU torch 2.13 of the README's suite.
set -euo pipefail
cd "$(dirname "$0")/.."
oldest=$(python - <<'EOF'
import re, tomllib
requirement = next(r for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if r.startswith("torch"))
print(re.fullmatch(r"torch>=(\d+\.\d+)", requirement).group(1) + ".*")
EOF
)
versions=${TORCH_VERSIONS:-"$oldest 2.14.1"}
root=${TORCH_VERSIONS_DIR:-/tmp/compile_trainer_torch_versions}
tests=(tests/test_compat.py tests/test_real_models.py tests/test_bucket_warmup.py tests/test_block_values.py tests/test_promoted_inputs.py
  tests/test_rest_background.py tests/test_fit_telemetry.py tests/test_thread_guards.py tests/test_telemetry.py
  tests/test_background.py)
stage=${1:-all}
vision_torch=2.14.1  # the environment that runs the vision tier, with the torchvision built for it
vision_packages=(torchvision==0.29.1)
vision_tests=(tests/test_vision_models.py tests/test_vision_benchmark.py)

install() {
  local version=$1 venv=$2 started=$SECONDS
  rm -rf "$venv"
  python -m venv "$venv"
  local extras=()
  [[ $version == "$vision_torch" ]] && extras=("${vision_packages[@]}")
  "$venv/bin/python" -m pip install -q --no-compile "torch==$version" "${extras[@]}"
  # the project's dependencies and dev extras, read from pyproject.toml (its own extra spelled out)
  "$venv/bin/python" - <<'EOF' > "$venv/requirements.txt"
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for requirement in project["dependencies"] + extras["dev"]:
    print("\n".join(extras["remote-cache"]) if requirement == "compile_trainer[remote-cache]" else requirement)
EOF
  "$venv/bin/python" -m pip install -q --no-compile -r "$venv/requirements.txt"
  if [[ $version == "$vision_torch" ]]; then
    "$venv/bin/python" -m pip install -q --no-compile --no-deps timm
  fi
  echo "torch $version: installed in $((SECONDS - started)) s"
}

venv_of() { echo "$root/torch-${1//\*/x}"; }

status=0
if [[ $stage != test ]]; then
  # the versions side by side: mostly unpacking wheels, about a core each
  installers=()
  for version in $versions; do
    install "$version" "$(venv_of "$version")" &
    installers+=($!)
  done
  for installer in "${installers[@]}"; do
    wait "$installer" || status=$?
  done
  [[ $status == 0 ]] || exit $status
fi
if [[ $stage != install ]]; then
  for version in $versions; do
    venv=$(venv_of "$version")
    started=$SECONDS
    echo "+ torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'): ${tests[*]}"
    rc=0
    "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider "${tests[@]}" || rc=$?
    echo "torch $version: tested in $((SECONDS - started)) s, pytest exit $rc"
    [[ $rc == 0 ]] || status=$rc
    if [[ $version == "$vision_torch" ]]; then
      started=$SECONDS
      echo "+ torch $version, the vision tier: ${vision_tests[*]}"
      rc=0
      "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider -m vision "${vision_tests[@]}" || rc=$?
      echo "torch $version, vision: tested in $((SECONDS - started)) s, pytest exit $rc"
      [[ $rc == 0 ]] || status=$rc
    fi
  done
fi
exit $status
