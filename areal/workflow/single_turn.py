"""The default episode: G single-turn samples of one prompt, graded by the reward service.

    row{"prompt_ids", "task", "answer"} --generate(n=G)--> G trajectories
                                        --grade(decoded responses)--> one reward each
    (rollout.data_plane=pull: both on the rollout worker, which keeps the tokens and
    returns references; relay: the decode and the grade request on the controller)

Every single-turn task (areal/tasks/) runs this way: the row's "task" (its dataset.type)
tells the reward service whose grader to use.
"""

from __future__ import annotations

from areal.trajectory import Trajectory, TrajectoryRef
from areal.workflow.api import RolloutEngine, Workflow


class SingleTurnWorkflow(Workflow):
    async def arun_episode(
        self, engine: RolloutEngine, data: dict
    ) -> list[Trajectory | TrajectoryRef]:
        # Graded on text (a grader reads answers), trained on the recorded tokens; with the
        # pull data plane both happen on the rollout worker, which keeps the tokens.
        return await engine.generate_graded(
            data["prompt_ids"], engine.group_size, data["task"], data["answer"]
        )
