#!/bin/bash
# The paper's math run (configs/math_1.5b.yaml: 16 nodes x 8 GPUs) on a running Ray cluster,
# the Ray counterpart of scripts/run_math.sh. From the checkout, submit it as a Ray job:
#   ray job submit --address http://HEAD:8265 -- bash scripts/run_math_ray.sh [--config FILE] [key=value ...]
# or run it on any node of the cluster: bash scripts/run_math_ray.sh [...]
# Arguments go to `python -m areal.train`; launcher.type=ray is added (launcher.ray_address
# defaults to auto: the cluster of the node it runs on). `fileroot` must be storage every node
# mounts at the same path (the roles find each other through the registry there), and the
# checkout too, or areal installed in the nodes' image. Another config may need more nodes:
# ... run_math_ray.sh --config configs/math_7b.yaml (24 nodes x 8 GPUs).
set -euo pipefail
DEFAULT_CONFIG=configs/math_1.5b.yaml
AREAL_ROOT=${AREAL_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
if [ ! -f "$AREAL_ROOT/slurm/env.sh" ]; then
    echo "areal: no checkout at $AREAL_ROOT: set AREAL_ROOT to it" >&2
    exit 2
fi
# The same environment set-up as the SLURM scripts: $AREAL_ENV_SETUP, $AREAL_VENV, PYTHONPATH.
source "$AREAL_ROOT/slurm/env.sh"
ARGS=("$@")
has_config=0
for a in "${ARGS[@]}"; do
    case "$a" in --config | --config=*) has_config=1 ;; esac
done
if [ "$has_config" = 0 ]; then
    ARGS=(--config "$AREAL_ROOT/$DEFAULT_CONFIG" "${ARGS[@]}")
fi
cd "$AREAL_ROOT"
echo "areal: Ray job ${RAY_JOB_ID:-(not submitted)} on $(hostname): $AREAL_PYTHON -m areal.train ${ARGS[*]} launcher.type=ray"
# exec: `ray job stop` signals the launcher itself, which stops every role and actor.
exec "$AREAL_PYTHON" -m areal.train "${ARGS[@]}" launcher.type=ray
