# Environment of an AReaL job, sourced by scripts/run_*.sh on the batch node. Every srun
# step inherits it (the launcher runs steps with --export=ALL), so set things up here once.
#
#   AREAL_ENV_SETUP=/path/site.sh  a site script sourced first (module load cuda, conda ...)
#   AREAL_VENV=/path/venv          a virtualenv to activate (default: $AREAL_ROOT/.venv if any)
#   AREAL_PYTHON=python3           the interpreter that runs areal.train (default: python3)
# AREAL_ROOT (the checkout) comes first on PYTHONPATH, so a checkout runs uninstalled.

if [ -n "${AREAL_ENV_SETUP:-}" ]; then
    if [ ! -f "$AREAL_ENV_SETUP" ]; then
        echo "areal: AREAL_ENV_SETUP=$AREAL_ENV_SETUP is not a file" >&2
        exit 2
    fi
    # shellcheck disable=SC1090
    source "$AREAL_ENV_SETUP"
fi
AREAL_VENV=${AREAL_VENV:-}
if [ -z "$AREAL_VENV" ] && [ -f "$AREAL_ROOT/.venv/bin/activate" ]; then
    AREAL_VENV=$AREAL_ROOT/.venv
fi
if [ -n "$AREAL_VENV" ]; then
    # shellcheck disable=SC1091
    source "$AREAL_VENV/bin/activate"
fi
export PYTHONPATH="$AREAL_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
AREAL_PYTHON=${AREAL_PYTHON:-python3}
