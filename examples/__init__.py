"""Agent workflows to train with `rollout.workflow=examples.<module>:run` (see README)."""
