"""Agent workflows: `rollout.workflow=examples.<module>:run` (docs/guides/agents.md)."""
