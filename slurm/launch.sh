# Sourced by scripts/run_*.sh after env.sh: the job's arguments to `python -m areal.train`,
# with $DEFAULT_CONFIG unless a --config is given, and launcher.type=slurm last (it wins).
ARGS=("$@")
has_config=0
for a in "${ARGS[@]}"; do
    case "$a" in --config | --config=*) has_config=1 ;; esac
done
if [ "$has_config" = 0 ]; then
    ARGS=(--config "$AREAL_ROOT/$DEFAULT_CONFIG" "${ARGS[@]}")
fi
cd "$AREAL_ROOT"
echo "areal: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: $AREAL_PYTHON -m areal.train ${ARGS[*]} launcher.type=slurm"
# exec: the launcher itself receives scancel's SIGTERM and stops every step.
exec "$AREAL_PYTHON" -m areal.train "${ARGS[@]}" launcher.type=slurm
