"""The planner: predict a run's effective training throughput, staleness and idle roles
before running it, for a grid of inference fractions (on CPUs: server counts) and max_staleness
values.

    profiling run (events/, batches.jsonl) --calibrate.py--> profile.json (costs.py)
    docs' GPU figures ------------------------gpu_h200----> profile
    config + profile + grid point --sim.py: discrete-event simulation--> throughput,
        staleness, idle shares, bottleneck --__main__.py--> table + recommendation

    python -m areal.planner --config configs/tiny_longtail.yaml --profile RUN_DIR

Named `planner`, not `plan`: areal/launcher/plan.py is the launcher's placement plan (which
node runs which role), which this package only reads the rules of.
"""
