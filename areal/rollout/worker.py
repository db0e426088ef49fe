"""The rollout worker: one per inference server, between the controller and that server.

    controller --generate(group)--------> worker --generate_batch [G]-------> client --> server
               <--- G trajectories ------        <-- output | abort (update) --
    controller --update_weights(v, dir)-> worker --update_weights_from_disk(
                                                     abort_all_requests)--> client --> server
    controller --wait_ready------------->  (answers once a dead server is back, on the latest v)
    controller --abandon(call_id)-------> worker --abort_request(rid) per request of that call
    trainer ranks --fetch(ids)----------> worker's TrajectoryStore (the pull data plane:
    controller --release(ids)-----------> the trajectories it graded and holds; data_plane.py)

client: the worker's InferenceClient (areal/rollout/inference.py), made by the client factory
of inference.backend (areal/rollout/backends/: SGLangClient for SGLang and for the embedded
server, VLLMClient for vLLM); the worker knows no wire format.

| loop              | waits for                      | unblocked by                          |
|-------------------|--------------------------------|---------------------------------------|
| a group's samples | the client's generate_batch    | each finishing (stop/length) or abort |
| resumed samples   | the server's new weights       | the weight update finishing           |
| weight update     | the server to abort and load   | update_weights_from_disk answering    |
| recovery          | the restarted server's health  | the launcher restarting it; deadline  |

Abandoned calls: a generate whose episode ended first (rejected, timed out, its agent's
session closed) is worth nothing, so the controller abandons it: its requests are aborted
on the server and not resumed, and the server's slots go to work that counts.

Interruptible (the paper): an update aborts in-flight generations; each comes back with its
partial output, and is resubmitted as prompt + partial output (a group's unfinished samples
in one generate_batch, as its first request was), which the server holds until it has
loaded the new weights. Its tokens keep the behaviour log-prob and the version of the
weights that produced them. Non-interruptible (the paper's ablation): the
update stops new submissions and waits for the in-flight ones to finish.

A dead server (unreachable, or refusing weights after every retry) is marked down: its
samples come back unfinished (finish_reason "") with their partial output, for the
controller to resume on another server, and new ones are refused the same way until the
recovery loop sees the server healthy again (the launcher restarts it, possibly on a new
port: `find_server` looks it up) and has loaded the latest version into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable

from areal import rolelog
from areal.comm.rpc import RpcClient
from areal.data_plane import TrajectoryStore
from areal.rollout.backends import load_backend
from areal.rollout.inference import ClientFactory, InferenceClient, ServerDied
from areal.trajectory import Trajectory

log = logging.getLogger("areal.rollout")

_MAX_RESUMES = 1000  # an abort loop this long means something other than updates aborts us
_RECOVERY_POLL_S = 0.5


class ServerDown(Exception):
    """The server is down: the current sample goes back unfinished."""


class RolloutWorker:
    RPC_METHODS: tuple[str, ...] = ("generate", "update_weights", "stats", "wait_ready", "abandon")
    """The methods the controller calls over RPC, each served under its own name (and the
    store's, TrajectoryStore.RPC_METHODS, with the pull data plane)."""

    def __init__(
        self,
        server_url: str,
        *,
        client_factory: ClientFactory | None = None,
        interruptible: bool = True,
        find_server: Callable[[], str] | None = None,
        update_timeout_s: float = 600.0,
        update_retries: int = 3,
        recovery_timeout_s: float = 900.0,
        on_fatal: Callable[[Exception], None] | None = None,
        api_key: str | None = None,
        store: TrajectoryStore | None = None,
        tokenizer: object | None = None,
        reward: RpcClient | None = None,
    ):
        self.api_key = api_key
        self.store = store
        """The pull data plane: graded trajectories stay here for the trainer ranks."""
        self.tokenizer = tokenizer
        self.reward = reward
        """With the store: the decode and the reward service for generate(grade=...)."""
        self.client_factory = client_factory or load_backend("embedded").client()
        """Makes the client of a server URL: the client of inference.backend's backend."""
        self.client: InferenceClient = self.client_factory(server_url, api_key=api_key)
        self.interruptible = interruptible
        self.find_server = find_server or (lambda: server_url)
        """The server's current URL (a restarted server may listen on another port)."""
        self.update_timeout_s = update_timeout_s
        self.update_retries = update_retries
        self.recovery_timeout_s = recovery_timeout_s
        """Seconds a dead server has to come back before this worker gives up (and exits)."""
        self.on_fatal = on_fatal or (lambda e: None)
        """Called when recovery gives up: the worker's process ends with that error."""
        self.version = 0
        """The version the server holds."""
        self._latest: tuple[int, str] | None = None  # the newest (version, path) asked for
        self.n_interrupted = 0
        """Requests interrupted by weight updates since the last stats() call."""
        self.n_abandoned = 0
        """Requests aborted because their call was abandoned, since the last stats() call."""
        self._calls: dict[str, list[str]] = {}  # call_id -> its requests' rids now in flight
        self._abandoned: set[str] = set()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()  # cleared while a non-interruptible update waits
        self._open.set()
        self._alive = asyncio.Event()  # cleared while the server is down
        self._alive.set()
        # Held: asyncio keeps only weak references to tasks.
        self._recovery: asyncio.Task | None = None
        self._update_lock = asyncio.Lock()
        self._group: str | None = None  # the weight-update group the server is in

    async def generate(
        self,
        group_id: int,
        prompt_ids: list[int],
        n: int,
        sampling_params: dict,
        start_version: int,
        partial: list[dict] | None = None,
        call_id: str = "",
        grade: dict | None = None,
    ) -> list[dict]:
        """Sample n responses to one prompt, or continue the `partial` ones (which another
        server left unfinished); returns trajectories in wire form, unfinished ones
        (finish_reason "") when the server went down. call_id names the call for abandon().

        grade {"task", "answer"} (the pull data plane): the finished ones are decoded,
        graded by the reward service and held here; they come back as TrajectoryRefs."""
        if partial is not None:
            trajs = [Trajectory.from_wire(w) for w in partial]
        else:
            trajs = [
                Trajectory(group_id=group_id, prompt_ids=list(prompt_ids),
                           start_version=start_version, t_start=time.time())
                for _ in range(n)
            ]  # fmt: skip
        call_id = call_id or uuid.uuid4().hex
        self._calls[call_id] = []
        try:
            await self._sample(trajs, sampling_params, call_id)
            if grade is not None:
                return await self._grade_and_hold(trajs, grade, call_id)
        finally:
            del self._calls[call_id]
            self._abandoned.discard(call_id)
        return [t.to_wire() for t in trajs]

    async def _grade_and_hold(self, trajs: list[Trajectory], grade: dict, call_id: str) -> list:
        """The single-turn episode's grading, where the tokens are: graded on text, trained
        on the recorded tokens (as SingleTurnWorkflow does on the controller with relay)."""
        if self.store is None or self.tokenizer is None or self.reward is None:
            raise RuntimeError(
                "generate(grade=...) needs the pull data plane's store, tokenizer and reward "
                "service (rollout.data_plane=pull)"
            )
        done = [t for t in trajs if t.finish_reason]
        if done:
            ids = [t.output_ids for t in done]
            texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            rewards = await self.reward.call(
                "grade", task=grade["task"], responses=texts, answer=grade["answer"]
            )
            for t, r in zip(done, rewards, strict=True):
                t.reward = r
        if call_id in self._abandoned:
            return []  # nobody waits for them
        refs = self.store.hold(done, call_id)
        return [r.to_wire() for r in refs] + [t.to_wire() for t in trajs if not t.finish_reason]

    async def abandon(self, call_id: str) -> dict:
        """Abort the requests of generate(call_id) on the server, and resume none of them:
        nobody waits for them. {"aborted": how many requests were in flight}."""
        rids = self._calls.get(call_id)
        if rids is None:  # finished already (or never came): drop what it holds, if any
            if self.store is not None:
                self.store.drop_call(call_id)
            return {"aborted": 0}
        self._abandoned.add(call_id)
        for rid in rids:
            try:
                await self.client.abort_request(rid)
            except (ServerDied, RuntimeError) as e:  # it ends anyway; the server is the loser
                log.warning("could not abort abandoned request %s: %s", rid, e)
        self.n_abandoned += len(rids)
        return {"aborted": len(rids)}

    async def _sample(self, trajs: list[Trajectory], sampling_params: dict, call_id: str) -> None:
        """Generate into trajs until each finishes, or the server is down. The unfinished
        ones go to the server as one generate_batch (one round trip per group, not per
        sample); the aborted ones are resubmitted together."""
        max_new = int(sampling_params["max_new_tokens"])
        rids = {id(t): uuid.uuid4().hex for t in trajs}  # a resumed sample keeps its rid
        todo = [t for t in trajs if not t.finish_reason]
        for _ in range(_MAX_RESUMES):
            if not todo:
                return
            await self._open.wait()
            if not self._alive.is_set() or call_id in self._abandoned:
                return
            self._calls[call_id] = [rids[id(t)] for t in todo]
            self._in_flight += len(todo)
            self._idle.clear()
            try:
                outs = await self.client.generate_batch(
                    [t.prompt_ids + t.output_ids for t in todo],
                    [{**sampling_params, "max_new_tokens": max_new - len(t.output_ids)}
                     for t in todo],
                    [rids[id(t)] for t in todo],
                )  # fmt: skip
            except ServerDied as e:
                self._server_down(str(e))
                return
            finally:
                self._in_flight -= len(todo)
                if self._in_flight == 0:
                    self._idle.set()
            if call_id in self._abandoned:
                return  # back aborted (or finished meanwhile): nobody waits for them
            aborted = []
            for traj, out in zip(todo, outs, strict=True):
                traj.extend(out.output_ids, out.logprobs, out.weight_version)
                if out.finish_reason != "abort":
                    traj.finish_reason = out.finish_reason
                elif len(traj.output_ids) >= max_new:
                    traj.finish_reason = "length"
                else:
                    traj.n_interrupts += 1
                    self.n_interrupted += 1
                    aborted.append(traj)
                    continue
                traj.t_end = time.time()
            todo = aborted
        raise RuntimeError(
            f"requests {[rids[id(t)] for t in todo]} were aborted {_MAX_RESUMES} times: "
            "something other than weight updates is aborting requests on the inference server"
        )

    async def update_weights(
        self,
        version: int,
        path: str | None,
        disk_version: int | None = None,
        broadcast: dict | None = None,
    ) -> dict:
        """Make the server generate with `version` from now on; {"version": what the server
        holds, "loaded": whether it is `version`, "alive": whether it serves} (a down server
        loads the newest version on disk once back).

        From disk (weights.transport=disk): path is version's directory. By broadcast
        (distributed): broadcast is the group to receive in, the buckets' specs
        (areal/weight_group.py) and the directory the trainer writes `version` to if the
        broadcast fails ("path"); path is the newest version on disk or being written there
        (disk_version; the initial model's directory at 0): what a restarted server loads.
        """
        if path is not None:
            newest = version if disk_version is None else disk_version
            if self._latest is None or newest >= self._latest[0]:
                self._latest = (newest, path)
        async with self._update_lock:
            if self._alive.is_set() and version > self.version:
                try:
                    if broadcast is None:
                        await self._load(version, path)
                    else:
                        await self._receive(version, broadcast)
                except ServerDown as e:
                    self._server_down(str(e))
            return {
                "version": self.version,
                "loaded": self.version >= version,
                "alive": self._alive.is_set(),
            }

    async def _receive(self, version: int, broadcast: dict) -> None:
        """Receive `version` in the weight-update group (joining it first when it is new).
        A broadcast that fails: the server leaves the group and loads `version` from disk
        inside the same pause (no token is generated with half-updated weights); a server
        that does not answer within the group's deadline is down."""
        group = broadcast["group"]
        # The server's own collectives fail at timeout_s and it answers; past twice that it
        # is hung (stopped, swapping) and counts as down.
        deadline = 2 * group["timeout_s"] + 10
        t0 = time.time()
        try:
            await asyncio.wait_for(self._join(group), deadline)
            async with self._held_for_update(deadline):
                try:
                    last = len(broadcast["buckets"]) - 1
                    # model.lora: the adapter's tensors, and how the server applies them.
                    lora = broadcast.get("lora_config")
                    extra = {} if lora is None else {"lora_config": lora}
                    for i, bucket in enumerate(broadcast["buckets"]):
                        await asyncio.wait_for(
                            self.client.update_weights_from_distributed(
                                **bucket,
                                group_name=group["group_name"],
                                weight_version=version,
                                load_format=broadcast["load_format"],
                                flush_cache=i == last,
                                **extra,
                            ),
                            deadline,
                        )
                except (RuntimeError, ValueError) as e:  # it answered: the broadcast failed
                    await self._fall_back_to_disk(version, broadcast["path"], str(e), deadline)
                    return
        except (ServerDied, asyncio.TimeoutError) as e:
            self._group = None
            raise ServerDown(f"version {version}: {e or 'no answer in time'}") from e
        except (RuntimeError, ValueError) as e:
            # Joining failed (a member never came): the weights are unchanged; the next
            # update forms a new group.
            self._group = None
            log.warning("version %d not received: joining its group failed (%s)", version, e)
            return
        self.version = version
        rolelog.set_context(version=version)
        log.info("received version %d in %.2fs", version, time.time() - t0)

    async def _fall_back_to_disk(
        self, version: int, path: str, reason: str, deadline: float
    ) -> None:
        """The broadcast of `version` failed: leave the broken group and load `version` from
        path, where the trainer writes every version whose broadcast failed on its side; if
        it did not fail there (this server refused), the newest version on disk."""
        await asyncio.wait_for(self._leave(), deadline)
        try:
            await asyncio.wait_for(_complete(path), deadline)
        except asyncio.TimeoutError:
            if self._latest is None:
                raise RuntimeError(f"version {version} is not on disk ({reason})") from None
            version, path = self._latest
        log.warning("a version did not arrive by broadcast (%s): loading version %d from disk",
                    reason, version)  # fmt: skip
        await asyncio.wait_for(
            self.client.update_weights_from_disk(path, version), self.update_timeout_s
        )
        self.version = version
        rolelog.set_context(version=version)

    async def _from_disk(self, version: int, path: str, abort_all_requests: bool = False) -> None:
        """update_weights_from_disk once the directory is complete: with the distributed
        transport the trainer may still be writing it (in the background)."""
        await _complete(path)
        await self.client.update_weights_from_disk(path, version, abort_all_requests)

    async def _join(self, group: dict) -> None:
        if self._group == group["group_name"] and not group["new"]:
            return
        await self._leave()  # the server's old group (broken or not), if any
        await self.client.init_weights_update_group(
            group["master_address"],
            group["master_port"],
            group["rank"],
            group["world_size"],
            group["group_name"],
            group["backend"],
        )
        self._group = group["group_name"]

    async def _leave(self) -> None:
        """The server leaves its weight-update group, if it is in one."""
        name, self._group = self._group, None
        if name is None:
            return
        try:
            await self.client.destroy_weights_update_group(name)
        except (RuntimeError, ValueError) as e:  # a broken group may refuse: it is gone anyway
            log.warning("leaving weight-update group %s: %s", name, e)

    @contextlib.asynccontextmanager
    async def _held_for_update(self, deadline: float) -> AsyncIterator[None]:
        """No token generated while the body changes the weights. Interruptible: pause the
        server, aborting what is in flight (resubmitted at once, held by the server until
        continue_generation: every resumed token has the new weights). Otherwise (the
        paper's ablation) hold back new submissions until the in-flight ones finish: the
        trainer's broadcast waits for them."""
        if self.interruptible and self._in_flight:
            await asyncio.wait_for(self.client.pause_generation("abort"), deadline)
            try:
                yield
            finally:
                await asyncio.wait_for(self.client.continue_generation(), deadline)
        else:
            self._open.clear()
            try:
                await self._idle.wait()
                yield
            finally:
                self._open.set()

    async def _load(self, version: int, path: str) -> None:
        """Load `version` with retries; ServerDown when the server is gone or keeps refusing."""
        t0 = time.time()
        for attempt in range(1, self.update_retries + 1):
            try:
                await asyncio.wait_for(self._load_into_server(version, path), self.update_timeout_s)
                break
            except ServerDied as e:
                raise ServerDown(str(e)) from e
            except (RuntimeError, asyncio.TimeoutError) as e:
                reason = str(e) or f"no answer within {self.update_timeout_s:g} s"
                log.warning("loading version %d, attempt %d/%d failed: %s",
                            version, attempt, self.update_retries, reason)  # fmt: skip
                if attempt == self.update_retries:
                    msg = f"it refused version {version} {attempt} times: {reason}"
                    raise ServerDown(msg) from e
                await asyncio.sleep(min(2.0**attempt, 10.0))
        self.version = version
        rolelog.set_context(version=version)
        log.info("loaded version %d in %.2fs", version, time.time() - t0)

    async def _load_into_server(self, version: int, path: str) -> None:
        if self.interruptible and self._in_flight:
            # One call aborts the in-flight requests (they come back partial and are
            # resubmitted at once) and loads; the server holds what arrives meanwhile until
            # the new weights are in (SGLang: its weight-update lock), so every resumed
            # token is generated, and labelled, with the new version.
            await self._from_disk(version, path, abort_all_requests=True)
        else:
            # Nothing to interrupt, or the ablation (let the in-flight ones finish): hold
            # back new submissions and load into an idle server (at max_staleness=0 every
            # update finds the server idle).
            self._open.clear()
            try:
                await self._idle.wait()
                await self._from_disk(version, path)
            finally:
                self._open.set()

    def _server_down(self, reason: str) -> None:
        if not self._alive.is_set():
            return
        self._alive.clear()
        self._group = None  # a restarted server is in no group
        log.warning("inference server %s is down (%s); recovering", self.client.base_url, reason)
        self._recovery = asyncio.create_task(self._recover())
        self._recovery.add_done_callback(
            lambda t: t.cancelled() or t.exception() is None or self.on_fatal(t.exception())
        )

    async def _recover(self) -> None:
        """Until the (restarted) server is healthy and holds the latest version; gives up
        with TimeoutError after recovery_timeout_s (the launcher has given up on it too)."""
        deadline = time.monotonic() + self.recovery_timeout_s
        while True:
            try:
                url = await asyncio.to_thread(self.find_server)
                if url.rstrip("/") != self.client.base_url:
                    await self.client.close()
                    self.client = self.client_factory(url, api_key=self.api_key)
                if await self.client.health():
                    async with self._update_lock:
                        # A restarted server starts from the weights the run started from.
                        if self._latest is not None:
                            await self._load(*self._latest)
                        self._alive.set()
                        log.info("inference server %s is back at version %d", url, self.version)
                        return
            except Exception as e:  # keep trying: the launcher stops the run if it cannot
                log.warning("inference server %s is not usable yet: %s", self.client.base_url, e)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"inference server {self.client.base_url} was not back within "
                    f"{self.recovery_timeout_s:g} s (inference.startup_timeout_s + the weight "
                    "load's time): giving up on it; see its log"
                )
            await asyncio.sleep(_RECOVERY_POLL_S)

    async def wait_ready(self) -> dict:
        """Answers once the server serves (at once when it is up): {"version"}."""
        await self._alive.wait()
        return {"version": self.version}

    async def stats(self) -> dict:
        n, self.n_interrupted = self.n_interrupted, 0
        abandoned, self.n_abandoned = self.n_abandoned, 0
        return {"n_interrupted": n, "n_abandoned": abandoned, "in_flight": self._in_flight}


async def _complete(path: str) -> None:
    """Until the version directory exists (weights are renamed into place when complete)."""
    while not os.path.isdir(path):
        await asyncio.sleep(0.05)
