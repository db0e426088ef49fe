#!/usr/bin/env bash
# CI as a fresh machine runs it, on this one: a clean clone of HEAD, a new virtual
# environment, an empty model cache, and with FRESH_VLLM=1 a new vLLM environment too.
# What a machine keeps between runs (packages installed by hand, ~/.cache/areal's tiny
# models, /opt/areal-vllm) can hide a missing install step, or a test that passes only with
# the model this processor makes. Use it before stopping when a change touches models,
# warm-ups, installs or learning tests. Arguments go to pytest (none: the whole suite).
#
#   scripts/fresh_suite.sh                        # the whole suite, as CI runs it
#   scripts/fresh_suite.sh tests/system/test_vllm_run.py
#   KEEP=1 scripts/fresh_suite.sh ...             # keep the temporary directory afterwards
set -euo pipefail

src="$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)"
work="$(mktemp -d "${TMPDIR:-/tmp}/fresh-suite.XXXXXX")"
[[ "${KEEP:-0}" == 1 ]] || trap 'rm -rf "$work"' EXIT
echo "fresh_suite: $(git -C "$src" rev-parse --short HEAD) in $work (uncommitted changes are not in it)"
git clone --quiet --no-hardlinks "$src" "$work/areal"
python3 -m venv "$work/venv"
export PATH="$work/venv/bin:$PATH" AREAL_CACHE_DIR="$work/cache" CI=true
[[ "${FRESH_VLLM:-0}" == 1 ]] && export AREAL_VLLM_VENV="$work/vllm"
cd "$work/areal"
bash .ci/run "$@"
