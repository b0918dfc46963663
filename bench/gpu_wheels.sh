#!/usr/bin/env bash
# The wheels bench/gpu_check.py needs on a GPU machine that has torch, transformers, peft,
# typer, pyyaml and rich but nothing else of rlx's, and no network: rlx's own non-torch
# dependencies that the learner imports (pydantic, its parts and the typing_extensions it
# needs), at the versions the test environment pins (.ci/requirements.lock), for that
# machine's Python (3.12 by default: GPU_PYTHON=3.11 for another). They land in .whl/
# (ignored by git), which travels with the working tree; docs/gpu.md has the command that
# installs and runs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${GPU_PYTHON:-3.12}
lock=.ci/requirements.lock
pin() { grep -i -E "^$1==" "$lock" | head -n 1; }
packages=()
for name in pydantic pydantic_core annotated-types typing-inspection typing_extensions; do
  line=$(pin "$name") || { echo "gpu_wheels: $name is not pinned in $lock" >&2; exit 1; }
  packages+=("$line")
done
rm -rf .whl && mkdir -p .whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$python_version" --implementation cp "${platforms[@]}" \
  -d .whl "${packages[@]}"
du -sh .whl
ls .whl
