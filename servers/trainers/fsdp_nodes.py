"""Trainer ranks on other nodes: the server's side (`NodeRendezvous`) and the other node's (`run_trainer_node`).

With `--trainer-nodes N` (a topology's `placement.nodes`) the ranks of a server's FSDP trainer span N machines:
node 0 is the server's, with ranks 0..L-1 (L = the trainer GPUs per node); node n runs ranks nL..nL+L-1, started by
`marl trainer-node --server HOST --node-rank n` there. How they meet:

1. When the server's trainer starts (its engine starts), `RankGroup` hosts the group's TCPStore (on a free port,
   which the store binds on every interface) and opens a `multiprocessing.connection.Listener` on the rendezvous
   port (29500 by default), authenticated with the server's admin token (HMAC challenge; the traffic itself is not
   encrypted: use a private network).
2. `marl trainer-node` connects (retrying until the trainer starts), says ("node", n) and receives its `NodeJob`:
   the ranks' spec, L, the store's port and the trainer GPUs. It spawns its L ranks with torchrun's variables
   (MASTER_ADDR: the server's host as it reached it) and CUDA_VISIBLE_DEVICES = its trainer GPUs.
3. Each rank connects on its own, says ("rank", r), is welcomed, and from then on that connection is its command
   pipe, exactly as a local rank's `Pipe` (`RankGroup.call` cannot tell them apart); the collectives go through
   torch.distributed (gloo or nccl) between the ranks directly.
4. The listener closes once every rank has joined. When the group ends (the engine stops, or a rank fails), the
   remote ranks exit, and `marl trainer-node` waits for the server's next trainer.

Every node reads the model from the server's path, and every rank writes its checkpoint shards into the server's
checkpoint directory: both must be on a filesystem the nodes share, at the same path.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path

from servers.placement import visible_devices
from servers.trainers.fsdp_worker import RankPlace, RankSpec, run_rank

__all__ = ["NodeJob", "NodeRendezvous", "run_trainer_node"]

log = logging.getLogger(__name__)

#: A joining process that says nothing for this long is dropped (it is not one of ours).
_HELLO_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class NodeJob:
    """What a node needs to start its share of the ranks."""

    spec: RankSpec
    node_rank: int
    local_world_size: int
    store_port: int
    trainer_gpus: tuple[int, ...] | None  # indices into the GPUs that node sees (None: local rank r on GPU r)


class NodeRendezvous:
    """The server's door for the ranks of other nodes, open while a group starts."""

    def __init__(self, port: int, authkey: bytes, host: str = "0.0.0.0"):
        try:
            # multiprocessing's Listener, taken apart: its blocking accept keeps the port bound after close, and
            # it authenticates on the accepting thread (see _admit)
            self._socket = socket.create_server((host, port))
            self._socket.settimeout(0.5)
        except OSError as exc:
            raise OSError(f"cannot wait for the trainer's other nodes on port {port} ({exc}): another trainer may"
                          " use it; set placement.rendezvous_port (marl serve --rendezvous-port)") from None
        self._authkey = authkey
        self._arrivals: queue.Queue[Connection] = queue.Queue()
        self._closed = False
        threading.Thread(target=self._accept, name="trainer-nodes", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                peer, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            peer.setblocking(True)
            conn = Connection(peer.detach())
            threading.Thread(target=self._admit, args=(conn,), name="trainer-node-auth", daemon=True).start()

    def _admit(self, conn: Connection) -> None:
        """The HMAC handshake of `Listener(authkey=...)`, on a thread of its own: a peer that says nothing (a port
        scanner) is dropped after a while instead of holding the door shut."""
        silent = threading.Timer(_HELLO_TIMEOUT_S, conn.close)
        silent.start()
        try:
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
        except (OSError, EOFError, mp.AuthenticationError):  # no admin token, or gone
            conn.close()
            return
        finally:
            silent.cancel()
        self._arrivals.put(conn)

    def gather(self, job: NodeJob, nodes: int, deadline: float) -> dict[int, Connection]:
        """Hand every node its job and return the connections of ranks L..world_size-1, by rank. TimeoutError
        naming the missing nodes at `deadline` (time.monotonic())."""
        first, world = job.local_world_size, job.spec.world_size
        ranks: dict[int, Connection] = {}
        while len(ranks) < world - first:
            try:
                conn = self._arrivals.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted({r // first for r in range(first, world) if r not in ranks})
                raise TimeoutError(f"trainer nodes {missing} did not join: run `marl trainer-node --server HOST"
                                   f" --node-rank N` on each (with this server's admin token)") from None
            self._greet(conn, job, nodes, ranks)
        return ranks

    def _greet(self, conn: Connection, job: NodeJob, nodes: int, ranks: dict[int, Connection]) -> None:
        try:
            hello = conn.recv() if conn.poll(_HELLO_TIMEOUT_S) else None
            kind, number = hello if isinstance(hello, tuple) and len(hello) == 2 else (None, None)
            if kind == "node" and isinstance(number, int) and 1 <= number < nodes:
                conn.send(("job", NodeJob(job.spec, number, job.local_world_size, job.store_port, job.trainer_gpus)))
            elif kind == "rank" and number in range(job.local_world_size, job.spec.world_size) and number not in ranks:
                conn.send(("welcome",))
                ranks[number] = conn
                return
            else:
                conn.send(("refused", f"{hello!r}: this trainer has nodes 1..{nodes - 1} and ranks"
                                      f" {job.local_world_size}..{job.spec.world_size - 1}, each joining once"))
        except (OSError, EOFError):
            pass  # gone: a node that means it comes back
        conn.close()

    def close(self) -> None:
        """Stop listening; the port is free once this returns (a node that comes now is refused and retries)."""
        self._closed = True
        try:
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread at once
        except OSError:
            pass  # not connected: nothing to wake on some systems
        self._socket.close()


def run_trainer_node(host: str, port: int, node_rank: int, authkey: bytes, *, once: bool = False,
                     retry_s: float = 1.0) -> None:  # fmt: skip
    """`marl trainer-node`: run this node's ranks of the trainer at host:port, again for every new trainer (the
    server builds one at every engine start), until interrupted (or after one, with `once`)."""
    context = mp.get_context("spawn")  # a fresh interpreter: CUDA_VISIBLE_DEVICES is set before CUDA starts
    while True:
        job = _ask_for_job((host, port), authkey, node_rank, retry_s)
        if not Path(job.spec.model_dir).is_dir():
            raise RuntimeError(f"the server's model directory {job.spec.model_dir} is not on this node: the trainer's"
                               " nodes need the model and the server's data directory at the same paths (a shared"
                               " filesystem)")
        visible = None if job.trainer_gpus is None else visible_devices(job.trainer_gpus)
        first = node_rank * job.local_world_size
        processes = []
        for local_rank in range(job.local_world_size):
            place = RankPlace(first + local_rank, local_rank, job.local_world_size, host, job.store_port, visible)
            process = context.Process(target=_remote_rank, args=((host, port), authkey, place, job.spec),
                                      name=f"fsdp-rank-{place.rank}")  # fmt: skip
            process.start()
            processes.append(process)
        log.info("node %d: ranks %d..%d started", node_rank, first, first + job.local_world_size - 1)
        for process in processes:
            process.join()
        log.info("node %d: ranks exited with %s", node_rank, [p.exitcode for p in processes])
        if once:
            return


def _ask_for_job(address: tuple[str, int], authkey: bytes, node_rank: int, retry_s: float) -> NodeJob:
    while True:
        try:
            with Client(address, authkey=authkey) as conn:
                conn.send(("node", node_rank))
                answer = conn.recv()
        except (ConnectionRefusedError, EOFError, ConnectionResetError):
            time.sleep(retry_s)  # the server's trainer is not starting (yet)
            continue
        if answer[0] != "job":
            raise RuntimeError(f"the server refused node {node_rank}: {answer[1]}")
        return answer[1]


def _remote_rank(address: tuple[str, int], authkey: bytes, place: RankPlace, spec: RankSpec) -> None:
    conn = Client(address, authkey=authkey)
    conn.send(("rank", place.rank))
    answer = conn.recv()
    if answer[0] != "welcome":
        raise SystemExit(f"rank {place.rank}: the server refused it: {answer[1]}")
    run_rank(place, spec, conn)
