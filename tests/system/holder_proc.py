"""A holder process for the data-plane tests: `python tests/system/holder_proc.py KEY_HEX
BATCH_FILE LO HI NAME REFS_FILE` holds trajectories LO..HI of the msgpack batch file in a
TrajectoryStore served over the real RPC layer, and writes their references to REFS_FILE."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from areal.comm import wire
from areal.comm.rpc import RpcServer
from areal.data_plane import TrajectoryStore
from areal.trajectory import Trajectory


async def main(key_hex: str, batch_file: str, lo: str, hi: str, name: str, refs: str) -> None:
    server = RpcServer(bytes.fromhex(key_hex), host="127.0.0.1")
    store = TrajectoryStore(name, server.address)
    batch = wire.unpack(Path(batch_file).read_bytes())[int(lo) : int(hi)]
    held = store.hold([Trajectory.from_wire(d) for d in batch])
    for method in store.RPC_METHODS:
        server.register(method, getattr(store, method))
    Path(refs + ".tmp").write_bytes(wire.pack([r.to_wire() for r in held]))
    os.rename(refs + ".tmp", refs)
    await server.serve()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
