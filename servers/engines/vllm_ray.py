"""vLLM replicas after the first as Ray actors in the server's placement group (`run.ray`, docs/ray.md).

A server with `vllm.data_parallel_size: R > 1` under `run.ray` runs its first replica beside itself (a subprocess, as
without Ray) and replicas 1..R-1 each in a `_ReplicaActor` in one of the last R-1 bundles of its placement group
(marl/topology/bundles.py), on whatever node Ray reserved it. The actor starts the replica's vLLM as a subprocess of
its own (`VLLMProcess`: listening on its node's 127.0.0.1 only, seeing the GPUs Ray gave the actor) and a `Relay` on
the node's address that passes connections from the server's machine through to it and closes every other one at
once: vLLM's control routes (weight reload, pause, sleep, collective_rpc) have no authentication, so no vLLM listens
beyond loopback. On the server's side `RayVLLMProcess` has `VLLMProcess`'s interface (its URL is the relay's), so the
replica's `VLLMSupervisor` watches it, restarts it (a new actor in the same bundle) and replays the engine's weights
and adapters into it as it does a local one. Those go through the disk (`VLLMLaunch.weight_sync`), so the server's
data directory must be on a filesystem every node shares, as `marl run` under Ray already assumes of it and of the
model's directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayError

from servers.engines.vllm_process import VLLMLaunch, VLLMProcess
from servers.ray_group import bundles_of, join, last_line, place

__all__ = ["LOST_CODE", "RayVLLMProcess", "Relay", "ray_replica_spawner"]

log = logging.getLogger(__name__)

#: The exit code a replica reports once its actor is gone (killed, or its node lost): no process told us one.
LOST_CODE = -1
_PLACE_TIMEOUT_S = 300.0  # its bundle is reserved already: placing the actor is starting a Ray worker
_CALL_TIMEOUT_S = 30.0
_CHUNK = 1 << 16


class Relay:
    """Listens on `host` (a free port) and passes each connection from one of the `allowed` IP addresses through to
    127.0.0.1:`target`, every byte both ways; a connection from anywhere else is closed at once, and logged
    (`refused` counts them: a server whose machine connects from another address than Ray's node address for it
    would be refused every time). Runs its own event loop on a thread."""

    def __init__(self, host: str, target: int, allowed: Iterable[str]) -> None:
        self.target, self.allowed, self.refused = target, frozenset(allowed), 0
        self._open: set[asyncio.StreamWriter] = set()  # connections being passed through, cut by `close`
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, host, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._thread = threading.Thread(target=self._loop.run_forever, name="marl-vllm-relay", daemon=True)
        self._thread.start()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = (writer.get_extra_info("peername") or ("",))[0]
        if peer not in self.allowed:
            self.refused += 1
            log.warning("vLLM relay on port %d: refused a connection from %s (allowed: %s)", self.port, peer,
                        ", ".join(sorted(self.allowed)))  # fmt: skip
            writer.close()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:  # vLLM is not up: the caller sees its connection closed, as vLLM's own would be
            writer.close()
            return
        self._open.update((writer, upstream_writer))
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            for end in (writer, upstream_writer):
                end.close()
                self._open.discard(end)

    def close(self) -> None:
        """Stop listening, cut the connections still open and end the loop (idempotent)."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shut(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    async def _shut(self) -> None:
        self._server.close()
        for end in list(self._open):
            end.close()
        await asyncio.sleep(0)  # let the pipes see their ends closed


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy `reader` to `writer` until it ends, then end that direction (a half close, as TCP has it)."""
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:  # either end went away: cut both
        writer.close()


@ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)
class _ReplicaActor:
    """One vLLM replica on the node Ray placed it on: vLLM on loopback, and the relay the server reaches it through
    (`wait`, called once, blocks a thread of its own while the other calls go on)."""

    def __init__(self, launch: VLLMLaunch, log_path: str, allowed: list[str]) -> None:
        gpus = [str(gpu) for gpu in ray.get_gpu_ids()]
        tp = launch.settings.tensor_parallel_size
        if not launch.on_cpu and len(gpus) != tp:
            raise RuntimeError(f"a vLLM replica runs on tensor_parallel_size = {tp} GPU(s), but its Ray bundle gave"
                               f" it {len(gpus)} (replica_resources: {{GPU: {tp}}})")
        self.process = VLLMProcess(replace(launch, cuda_visible_devices=",".join(gpus) or None), Path(log_path))
        self.host = ray.util.get_node_ip_address()
        self.relay = Relay(self.host, self.process.port, allowed)

    def where(self) -> tuple[str, int]:
        """The relay's URL, and vLLM's process id on this node."""
        return f"http://{self.host}:{self.relay.port}", self.process.pid

    def wait(self) -> int:
        return self.process.wait()

    def describe_log(self, lines: int) -> str:
        refused = f"its relay refused {self.relay.refused} connection(s) from elsewhere; " if self.relay.refused else ""
        return refused + self.process.describe_log(lines)

    def stop(self, grace_s: float) -> None:
        self.process.stop(grace_s)
        self.relay.close()


class RayVLLMProcess(VLLMProcess):
    """The server's handle on a replica in a `_ReplicaActor` in bundle `index` of placement group `group`, with
    `VLLMProcess`'s interface; `url` is the replica's relay. Once the actor is gone (killed, its node lost) the
    replica reads as exited with `LOST_CODE`. Whether it ended is read from one call of the actor's `wait`, made at
    the start, so that asking never blocks (the engine asks on its event loop when a request fails)."""

    def __init__(self, launch: VLLMLaunch, log_path: Path, *, group: str, index: int, name: str) -> None:
        self.log_path, self.name, self._gone = log_path, name, None  # the log is written on the replica's node
        allowed = [ray.util.get_node_ip_address(), "127.0.0.1"]  # this server's machine alone
        self._actor = place(_ReplicaActor, group, index, name).remote(launch, str(log_path), allowed)
        try:
            self.url, self._pid = ray.get(self._actor.where.remote(), timeout=_PLACE_TIMEOUT_S)
        except GetTimeoutError:
            self._kill()  # not started: nothing to stop gracefully
            raise RuntimeError(f"the vLLM replica's Ray actor {name} was not placed in bundle {index} of {group}"
                               f" within {_PLACE_TIMEOUT_S:g} s (`ray status`)") from None
        except RayError as exc:
            self._kill()
            raise RuntimeError(f"the vLLM replica's Ray actor {name} did not start in bundle {index} of {group}:"
                               f" {last_line(exc)}") from None
        self.port = int(self.url.rsplit(":", 1)[1])
        self._exit = self._actor.wait.remote()  # ready once vLLM exits, or the actor is gone

    @property
    def pid(self) -> int:
        """vLLM's process id on the replica's node."""
        return self._pid

    def exit_code(self) -> int | None:
        ready, _ = ray.wait([self._exit], timeout=0)
        return self.wait() if ready else None

    def wait(self) -> int:
        try:
            return ray.get(self._exit)
        except RayError as exc:
            self._gone = self._gone or last_line(exc)
            return LOST_CODE

    def ended(self, code: int) -> str:
        if code == LOST_CODE and self._gone is not None:
            return f"the vLLM replica's Ray actor {self.name} is gone ({self._gone})"
        return f"the vLLM replica in Ray actor {self.name} exited with code {code}"

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop vLLM through its actor, then end the actor (idempotent; a dead actor is just ended)."""
        with contextlib.suppress(RayError):
            ray.get(self._actor.stop.remote(grace_s), timeout=grace_s + _CALL_TIMEOUT_S)
        self._kill()

    def _kill(self) -> None:
        with contextlib.suppress(RayError, ValueError):
            ray.kill(self._actor, no_restart=True)

    def describe_log(self, lines: int = 25) -> str:
        if self._gone is None:
            with contextlib.suppress(RayError):
                return ray.get(self._actor.describe_log.remote(lines), timeout=_CALL_TIMEOUT_S)
        # its node may be gone too: the log as this machine sees it (the same file on a shared filesystem)
        return f"its Ray actor {self.name} is gone ({self._gone or 'not answering'}); {super().describe_log(lines)}"


def ray_replica_spawner(launch: VLLMLaunch, index: int) -> Callable[[VLLMLaunch, Path], VLLMProcess]:
    """How replica `index` (1..R-1) of an engine under Ray starts: a `RayVLLMProcess` in its bundle, the
    (R-1-index)-th from the end of the server's placement group (marl/topology/bundles.py), each start a new actor."""
    join(launch.ray_address)
    bundles = bundles_of(launch.ray_group)
    bundle = len(bundles) - launch.replicas + index
    if bundle < 1:
        raise ValueError(f"the placement group {launch.ray_group} has {len(bundles) - 1} bundles after the server's,"
                         f" too few for {launch.replicas - 1} vLLM replicas after the first (data_parallel_size)")

    def spawn(replica_launch: VLLMLaunch, log_path: Path) -> VLLMProcess:
        name = f"{launch.ray_group}.replica{index}.{uuid.uuid4().hex[:8]}"
        # paths as this server resolves them (the same on every node: a shared filesystem), not the actor's cwd or
        # environment
        absolute = replace(replica_launch, python=replica_launch.interpreter(),
                           model_dir=Path(replica_launch.model_dir).resolve())  # fmt: skip
        return RayVLLMProcess(absolute, Path(log_path).resolve(), group=launch.ray_group, index=bundle, name=name)

    return spawn
