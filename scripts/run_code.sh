#!/bin/bash
# The paper's code run (configs/code_14b.yaml: 32 nodes x 8 GPUs) as one SLURM job:
#   sbatch scripts/run_code.sh [--config FILE] [key=value ...]      (from the checkout)
# Arguments go to `python -m areal.train`; launcher.type=slurm is added. Another config
# may need another allocation: sbatch -N 16 scripts/run_code.sh --config my_code.yaml
#SBATCH --job-name=areal-code
#SBATCH --nodes=32
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=areal-%x-%j.out
set -euo pipefail
DEFAULT_CONFIG=configs/code_14b.yaml
# sbatch runs a copy of this script, so the checkout is where sbatch was called from.
AREAL_ROOT=${AREAL_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
if [ ! -f "$AREAL_ROOT/slurm/env.sh" ]; then
    echo "areal: no checkout at $AREAL_ROOT: run sbatch from the repository root or set AREAL_ROOT" >&2
    exit 2
fi
source "$AREAL_ROOT/slurm/env.sh"
source "$AREAL_ROOT/slurm/launch.sh"
