#!/usr/bin/env bash
# mypy over the library as it is installed (turnstile.envs, turnstile.rollout, ...). setuptools maps the
# top-level folders into the turnstile namespace with an import hook that mypy cannot follow, so this
# script names them the same way with links in build/typecheck/turnstile and checks them there.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck/turnstile
rm -rf build/typecheck
mkdir -p "$tree"
for package in envs rollout rewards learner cluster; do
  ln -s "../../../$package" "$tree/$package"
done
exec .venv/bin/mypy "$@"
