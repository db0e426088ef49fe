"""A whole run in one Python process: `python -m areal.train --config configs/tiny.yaml
launcher.type=inline`.

```
 main thread            trainer loop (trainer/worker.py train): get_batch -> train_step
   |                      (ppo.py's loss) -> publish weights/vN -> weights_ready
   |  BlockingRpc: the call runs on the roles' loop; the trainer waits for its answer
 thread "inline-roles"  one asyncio loop: Controller (gate, buffer, episodes),
   |                      RolloutWorker k --EngineClient--> DecodeEngine k, RewardService
 thread "decode" (per engine)  continuous batching, as in the embedded server
```

The roles are the objects a normal run builds, wired without sockets: an RPC client is an
InProcessRpc that awaits the object's method, its arguments and result round-tripped
through the wire's msgpack (comm/wire.py) so that they are what a peer would receive. The
rollout worker's inference client is an EngineClient (no HTTP). The trainer trains while
the engines generate (the staleness bound, metrics.jsonl and checkpoints are the normal
run's); weights still go through weights/vN on disk. Only the embedded engine on CPU, one
trainer rank, no restarts. A breakpoint anywhere (e.g. in ppo.py's loss) stops its thread
with the others running on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from areal.comm.rpc import RpcError, RpcTimeout
from areal.comm.wire import pack, unpack
from areal.config import ConfigError, ExperimentConfig

if TYPE_CHECKING:
    from areal.checkpoint import Checkpoint

log = logging.getLogger("areal.inline")


class InProcessRpc:
    """An RpcClient stand-in (call, call_soon, close) that runs the methods on the caller's
    event loop. As over the wire: arguments and results travel through pack/unpack, each
    call's method runs in its own task, which a caller's timeout or cancellation leaves
    running (the controller abandons a generate explicitly), and a failing method raises
    RpcError (its cause chained, for the debugger)."""

    def __init__(self, methods: dict[str, Callable[..., Awaitable[Any]]], address: str) -> None:
        self.methods = methods
        self.address = address
        self._soon: set[asyncio.Task] = set()
        self._handlers: set[asyncio.Task] = set()

    async def call(self, method: str, timeout: float | None = None, **args: Any) -> Any:
        fn = self.methods.get(method)
        if fn is None:
            raise RpcError(f"unknown method {method!r}; {self.address} has {sorted(self.methods)}")
        handler = asyncio.create_task(fn(**unpack(pack(args))))
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        try:
            result = await asyncio.wait_for(asyncio.shield(handler), timeout)
        except asyncio.TimeoutError:
            msg = f"no reply to {method!r} from {self.address} within {timeout:g} s"
            raise RpcTimeout(msg) from None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise RpcError(f"{type(e).__name__}: {e}") from e
        return unpack(pack(result))

    def call_soon(self, method: str, timeout: float, **args: Any) -> asyncio.Task:
        task = asyncio.create_task(self.call(method, timeout=timeout, **args))
        self._soon.add(task)
        task.add_done_callback(self._soon.discard)
        return task

    def close(self) -> None:
        """Cancel the call_soon calls and the methods still running (as RpcServer.close)."""
        for task in [*self._soon, *self._handlers]:
            task.cancel()


class BlockingRpc:
    """The trainer's SyncRpcClient stand-in: runs an InProcessRpc call on the roles' loop
    and waits; raises the roles' failure instead of waiting forever."""

    def __init__(self, rpc: InProcessRpc, roles: _Roles) -> None:
        self.rpc = rpc
        self.roles = roles

    def call(self, method: str, timeout: float | None = None, **args: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(
            self.rpc.call(method, timeout, **args), self.roles.loop
        )
        while True:
            try:
                return future.result(timeout=0.2)
            except FutureTimeout:
                if self.roles.failure is not None:
                    future.cancel()
                    raise self.roles.failure from None

    def close(self) -> None:
        pass


@dataclass
class _Roles:
    """The asyncio side: the loop's thread and what runs on it."""

    loop: asyncio.AbstractEventLoop
    controller_rpc: InProcessRpc | None = None
    failure: BaseException | None = None
    """Set when the controller stops making progress or a loop fails."""
    stop: Callable[[], Awaitable[None]] | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)


async def _start_roles(
    roles: _Roles,
    cfg: ExperimentConfig,
    engines: list,
    tokenizer: Any,
    rows: list[dict],
    resume_from: Checkpoint | None,
) -> None:
    """Build reward service, rollout workers and controller on this loop, as
    areal/worker.py and controller.run_controller do, and start admitting."""
    from areal.controller.controller import Controller
    from areal.controller.failures import NoProgress
    from areal.reward.service import RewardService
    from areal.rollout.engine_client import EngineClient
    from areal.rollout.worker import RolloutWorker

    inf = cfg.inference
    reward = RewardService(cfg.reward)
    workers = []
    for k, engine in enumerate(engines):
        client = EngineClient(engine, f"inline://engine{k}")
        workers.append(
            RolloutWorker(
                client.base_url,
                client_factory=lambda url, api_key=None, client=client: client,
                interruptible=cfg.rollout.interruptible,
                update_timeout_s=inf.update_timeout_s,
                update_retries=inf.update_retries,
                recovery_timeout_s=inf.startup_timeout_s,
            )
        )
    worker_rpcs = [
        InProcessRpc({n: getattr(w, n) for n in RolloutWorker.RPC_METHODS}, f"rollout{k}")
        for k, w in enumerate(workers)
    ]
    reward_rpc = InProcessRpc({"grade": reward.grade, "stats": reward.stats}, "reward0")
    # One process: every object shares the tokens already, there is nothing to pull.
    controller = Controller(cfg, rows, tokenizer, worker_rpcs, reward_rpc, data_plane="relay")
    if resume_from is not None:
        controller.load_state_dict(
            unpack(resume_from.controller_state.read_bytes()), resume_from.version
        )
    roles.controller_rpc = InProcessRpc(
        {
            "get_batch": controller.get_batch,
            "weights_ready": controller.weights_ready,
            "save_state": controller.save_state,
        },
        "controller0",
    )
    admit = asyncio.create_task(controller.admit_loop())
    stalled = asyncio.create_task(controller.stalled.wait())

    def failed(task: asyncio.Task) -> None:
        if task.cancelled() or roles.failure is not None:
            return
        if task is stalled:
            roles.failure = NoProgress(controller.no_progress)
        else:
            roles.failure = task.exception() or RuntimeError("the admit loop ended unexpectedly")

    for task in (admit, stalled):
        task.add_done_callback(failed)

    async def stop() -> None:
        admit.cancel()
        stalled.cancel()
        await asyncio.gather(admit, stalled, return_exceptions=True)
        controller.pool.close()
        for rpc in [*worker_rpcs, reward_rpc, roles.controller_rpc]:
            rpc.close()
        for w in workers:
            await w.client.close()
        await controller.workflow.aclose()
        reward.close()

    roles.stop = stop


def run_inline(cfg: ExperimentConfig, resume_from: Checkpoint | None = None) -> int:
    """Every role of the run in this process (the experiment directory prepared by
    train.prepare_experiment); returns the exit code, as a launcher's run()."""
    import torch

    from areal.controller.failures import NO_PROGRESS_EXIT, NoProgress
    from areal.data.dataset import load_rows, tokenize_rows
    from areal.models.tokenizer import load_tokenizer
    from areal.rollout.backends import load_backend
    from areal.rollout.engine import DecodeEngine
    from areal.trainer.backends import load_backend as load_trainer_backend
    from areal.trainer.parallel import DataParallel
    from areal.trainer.worker import train

    if not load_backend(cfg.inference.backend).in_process:
        raise ConfigError(
            f"launcher.type=inline runs the embedded engine in this process, not "
            f"inference.backend={cfg.inference.backend}: set inference.backend=embedded"
        )
    if (
        cfg.trainer.parallel.world_size != 1
        or not load_trainer_backend(cfg.trainer.backend).in_process
    ):
        raise ConfigError(
            "launcher.type=inline trains on one torch rank: set trainer.backend=torch and "
            "trainer.parallel.dp=tp=pp=1"
        )
    inf = cfg.inference
    tokenizer = load_tokenizer(cfg.model.path)
    rows = tokenize_rows(load_rows(cfg.dataset, cfg.seed), tokenizer, cfg.dataset.max_prompt_len)
    lora = cfg.model.lora.enabled  # a LoRA checkpoint's model/ is the adapter: base + it
    model_dir = str(resume_from.model_dir) if resume_from and not lora else cfg.model.path
    engines = [
        DecodeEngine.from_dir(
            model_dir,
            max_batch_size=inf.max_batch_size,
            max_total_tokens=inf.max_total_tokens,
            seed=cfg.seed + k,  # as launch.server_command gives server k
            num_threads=max(1, inf.num_threads),
            weight_version=resume_from.version if resume_from else 0,
            dtype=getattr(torch, cfg.model.dtype),
        ).start()
        for k in range(cfg.rollout.n_servers)
    ]
    if resume_from and lora:
        for engine in engines:
            ok, message, _ = engine.update_weights(str(resume_from.model_dir))
            assert ok, message
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="inline-roles", daemon=True)
    thread.start()
    roles = _Roles(loop)
    on_loop = functools.partial(asyncio.run_coroutine_threadsafe, loop=loop)
    try:
        on_loop(_start_roles(roles, cfg, engines, tokenizer, rows, resume_from)).result()
        train(cfg, DataParallel(), lambda: BlockingRpc(roles.controller_rpc, roles))
        return 0
    except NoProgress as e:
        print(e, file=sys.stderr, flush=True)
        return NO_PROGRESS_EXIT
    finally:
        if roles.stop is not None:
            stopped: Future = on_loop(roles.stop())
            stopped.result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
        for engine in engines:
            engine.shutdown()
