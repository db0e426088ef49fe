"""configs/agent_tools.yaml with each agent framework: whole CPU runs in which the tiny model
calls the add tool through the framework. Each skips itself where its framework is not
installed (pip install -e ".[agents]"; .ci/run installs it)."""

from __future__ import annotations

import pytest

from tests.system.test_run import ROOT, processes_mentioning, read_metrics, run_train

pytest.importorskip("openai")

FRAMEWORKS = {"agents_sdk_add": "agents", "langchain_add": "langchain_openai"}
STEPS = 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", sorted(FRAMEWORKS))
def test_a_tool_agent_calls_add_and_trains(tmp_path, example):
    """A short run: the model's tool calls come back parsed and the agent runs add (its
    episodes make a second call, which follows only a tool result), and the episodes train.
    150 warm-up steps (~30 s idle, one model for both tests) teach the call format, not the
    operands (examples/add_tool.py): nearly every episode calls add."""
    pytest.importorskip(FRAMEWORKS[example])
    proc = run_train(
        tmp_path,
        f"total_train_steps={STEPS}",
        f"trial_name={example}",
        f"rollout.workflow=examples.{example}:run",
        "model.tiny_warmup_steps=150",
        "trainer.batch_size=4",
        config=ROOT / "configs/agent_tools.yaml",
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(tmp_path / f"agent_tools/{example}")
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
    assert sum(m["rollout/episodes_rejected"] + m["rollout/episodes_timeout"] for m in metrics) == 0
    counted = [m for m in metrics if m["episode/count"] > 0]
    episodes = sum(m["episode/count"] for m in counted)
    calls = sum(m["episode/calls_mean"] * m["episode/count"] for m in counted)
    assert episodes > 0 and calls / episodes > 1.5, [(m["episode/calls_mean"]) for m in counted]
    assert all(m["train/n_tokens"] > 0 for m in metrics)
    # The calls of an episode append (the template re-renders the model's call as it was
    # written): one sequence per episode, nearly always.
    assert sum(m["rollout/concat_fallbacks"] for m in metrics) <= 0.1 * episodes
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.timeout(300)
def test_a_langchain_agent_with_every_default_runs_a_whole_run(tmp_path):
    """tests/documented_agents/langchain_adder.py: ChatOpenAI(model, base_url, api_key) with
    no timeout, whose async HTTP client LangChain caches per base_url for the whole process,
    with instructions and a docstring of its own. Every episode of the agent process shares
    one event loop, so the cached client serves them all: no episode is rejected."""
    pytest.importorskip("langchain_openai")
    proc = run_train(
        tmp_path,
        f"total_train_steps={STEPS}",
        "trial_name=documented",
        "rollout.workflow=tests.documented_agents.langchain_adder:run",
        "model.tiny_warmup_steps=150",
        "trainer.batch_size=4",
        config=ROOT / "configs/agent_tools.yaml",
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(tmp_path / "agent_tools/documented")
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
    assert sum(m["rollout/episodes_rejected"] + m["rollout/episodes_timeout"] for m in metrics) == 0
    assert sum(m["episode/count"] for m in metrics) >= STEPS * 4 * 8  # batch_size x group_size
    assert processes_mentioning(str(tmp_path)) == []
