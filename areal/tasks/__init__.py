"""Tasks: what a single-turn problem is and how its answer is graded, one module each.

    dataset.type = "arith" | "longtail" | "math" | "code"   (areal/tasks/<name>.py: TASK)
                 | "package.module:object"                  (a Task of your own)
        load_task(spec) --> Task
            .generate(dataset_cfg, seed) | .from_record(record)  -> rows (areal.data.dataset)
            .screen(response, answer)  -> a verdict, or the question for is_correct (service)
            .is_correct(response, answer, **.grader_options(cfg.reward))  (reward service pool,
                                                   or the service itself: .grade_inline)
            .warmup(dataset_cfg, seed)  -> the tiny model's supervised batches (models/tiny.py):
                (prompt, answer) pairs, or agent episodes: the chat calls an agent makes

A row is {"prompt", "answer", "task"}: "task" is the spec it was loaded under, so the reward
service (which gets it with every request) loads the same task in its pool processes. A new
task is one module here defining `TASK = Task(...)` (or anywhere, named by
"package.module:object"); nothing else names it.

The built-in tasks' graders are graders/ (math-verify, the code sandbox), beside them: the
reward service imports the tasks, and nothing here imports the service. Importing this
package and a task module is cheap (the config validates dataset.type with it): a task
imports heavy graders (math-verify, sympy) inside its functions.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from areal import config_loader, plugins
from areal.config_loader import ConfigError
from areal.plugins import SPEC


@dataclass(frozen=True)
class ChatCall:
    """One call of an agent as the OpenAI endpoint receives it, and what the model should
    answer: a warm-up example rendered exactly as the endpoint renders the call."""

    messages: list[dict]
    """The conversation in OpenAI's wire shapes (assistant tool_calls' arguments as JSON
    strings, tool results as role "tool"), as an agent framework sends it."""
    tools: list[dict] | None
    """The request's tools, exactly as sent (the chat template writes them into the prompt)."""
    response: str
    """The text the model should write (a tool call in its family's format, or an answer);
    the end-of-turn token follows."""


Batch = list[tuple[str, str] | list[ChatCall]]
"""One supervised warm-up step: (prompt, worked answer) pairs, or episodes (the calls of one
agent episode, in order)."""


def _no_options(reward_cfg: Any) -> dict:
    return {}


@dataclass(frozen=True, kw_only=True)
class Task:
    """One single-turn task: its rows (made in code or read from dataset.path), its grader,
    the grader's options and, for the tiny model, its warm-up data."""

    name: str
    is_correct: Callable[..., bool]
    """(response, answer, **options) -> right or wrong. Runs in a reward service process
    (killed past reward.timeout_s); an exception scores the response wrong and is counted."""
    generate: Callable[[Any, int], list[dict]] | None = None
    """(dataset_cfg, seed) -> rows {"prompt", "answer"} made in code (dataset.n_problems)."""
    from_record: Callable[[dict], dict] | None = None
    """A record of dataset.path -> row {"prompt", "answer"}; ValueError says what is wrong."""
    record_fields: str = ""
    """What a record needs, for the error when a file has no usable one."""
    grader_options: Callable[[Any], dict] = _no_options
    """(reward_cfg) -> keyword arguments of is_correct (e.g. the code sandbox's limits)."""
    grader_imports: tuple[str, ...] = ()
    """Heavy modules is_correct imports when called (a task module stays cheap to import):
    the reward service imports them before its pool forks, so that no grading pays for them
    within its time limit."""
    uses_sandbox: bool = False
    """is_correct runs the response in the code sandbox (areal/tasks/graders/sandbox.py): the
    reward service says how isolated it is when it first grades the task (only then)."""
    grade_inline: bool = False
    """is_correct is a regex on the response, cheap and unable to hang: the reward service
    calls it in its own process. A pool round trip costs more than such a grading (15% of a
    step's throughput with the 145k-parameter model) but is what enforces
    reward.timeout_s, so a grader that parses (math-verify) or runs code keeps the pool."""
    screen: Callable[[str, Any], bool | tuple] | None = None
    """(response, answer) -> a first look, cheap and unable to hang, that the reward service
    takes in its own process before the pool: a bool is the verdict; a tuple is the question
    is_correct has to answer (math: the boxed answer and the gold one), asked of the pool once
    and its verdict reused for every response that asks the same (benchmarks/grading.py)."""
    warmup: Callable[[Any, int], Iterator[Batch]] | None = None
    """(dataset_cfg, seed) -> supervised batches for the tiny model (None: no warm-up data;
    a run without model.path then gets the arith model)."""
    options: type | None = None
    """Its own options (dataset.options): a dataclass subclassing areal.config_loader.Section,
    whose fields are checked as the config's are (None: it takes none); `options_of` parses
    them."""

    def __post_init__(self) -> None:
        assert (self.generate is None) != (self.from_record is None), (
            f"task {self.name!r}: give exactly one of generate and from_record"
        )

    def options_of(self, options: dict) -> Any:
        """dataset.options as this task's options object (None if it takes none);
        ConfigError naming the key for an unknown or mistyped option."""
        if self.options is None:
            if options:
                raise ConfigError(
                    f"dataset.options {sorted(options)}: task {self.name!r} takes no options; "
                    "remove them (as an override: dataset.options={})"
                )
            return None
        return config_loader.build(self.options, options, at="dataset.options.")

    @property
    def needs_path(self) -> bool:
        """Its rows are read from dataset.path."""
        return self.from_record is not None


@functools.cache
def names() -> tuple[str, ...]:
    """The built-in tasks' short names: made in code first, then read from a file (each a
    module here; the packages here, graders/, are no task)."""
    modules = pkgutil.iter_modules(__path__)
    found = [m.name for m in modules if not m.ispkg and not m.name.startswith("_")]
    tasks = [_builtin(name) for name in found]
    return tuple(t.name for t in sorted(tasks, key=lambda t: (t.needs_path, t.name)))


def _builtin(name: str) -> Task:
    task = importlib.import_module(f"{__name__}.{name}").TASK
    assert isinstance(task, Task) and task.name == name, f"areal/tasks/{name}.py: TASK"
    return task


def known() -> str:
    """The accepted values of dataset.type, for messages."""
    return f'{", ".join(names())}, or "package.module:object" naming a Task'


@functools.cache
def load_task(spec: str) -> Task:
    """The task a short name or "package.module:object" names; ConfigError saying what to fix."""
    if not SPEC.fullmatch(spec):
        if spec not in names():
            raise ConfigError(f"unknown task {spec!r}: use one of {known()}")
        return _builtin(spec)
    obj = plugins.resolve(spec, f"task {spec!r}", ConfigError)
    if not isinstance(obj, Task):
        raise ConfigError(f"task {spec!r} is a {type(obj).__name__}, not an areal.tasks.Task")
    return obj
