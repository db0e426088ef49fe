"""The default episode: G single-turn samples of one prompt, graded by the reward service.

    row{"prompt_ids", "task", "answer"} --generate(n=G)--> G trajectories
                                        --grade(decoded responses)--> one reward each

Every single-turn task (areal/tasks/) runs this way: the row's "task" (its dataset.type)
tells the reward service whose grader to use.
"""

from __future__ import annotations

from areal.trajectory import Trajectory
from areal.workflow.api import RolloutEngine, Workflow


class SingleTurnWorkflow(Workflow):
    async def arun_episode(self, engine: RolloutEngine, data: dict) -> list[Trajectory]:
        trajs = await engine.generate(data["prompt_ids"], n=engine.group_size)
        # Graded on text (a grader reads answers), trained on the recorded tokens.
        texts = [engine.tokenizer.decode(t.output_ids, skip_special_tokens=True) for t in trajs]
        rewards = await engine.grade(data["task"], texts, data["answer"])
        for t, r in zip(trajs, rewards, strict=True):
            t.reward = r
        return trajs
