"""Which node of a multi-node job stopped, for the one line the surviving nodes print.

When a node dies (its launcher killed, the machine lost), the other nodes' ranks fail in their next
collective with a bare "connection closed by peer", which names no node. So every rank of a job of
several nodes counts heartbeats in the job's store (the rendezvous store node 0 hosts, at
MASTER_ADDR:MASTER_PORT); a rank that fails reads the counters twice, a few seconds apart: a node
none of whose ranks advanced has stopped. Its own node is never named (this rank runs), and the
store gone altogether means node 0, which hosts it, stopped.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

INTERVAL_S = 0.5


class NodeStoppedError(RuntimeError):
    """Another node of the job stopped; `str()` is the one line naming it."""


def _attempt(env: Mapping[str, str]) -> str:
    """This start's key in the store: the agent's restart count where the agent's store outlives the
    starts; none where each start's rank 0 hosts a fresh store (an elastic job, whose agents count
    their restarts each on its own)."""
    return (
        env.get("TORCHELASTIC_RESTART_COUNT", "0")
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        else "0"
    )


@dataclass
class NodeWatch:
    """This rank's heartbeat, and the check of the other nodes' (see the module docstring)."""

    addr: str
    port: int
    rank: int
    world_size: int
    ranks_per_node: int
    prefix: str
    _stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NodeWatch | None:
        """The watch of a torchrun rank in a job of more than one node (else None)."""
        env = os.environ if env is None else env
        try:
            nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
            if nodes < 2 or "MASTER_ADDR" not in env:
                return None
            return cls(
                addr=env["MASTER_ADDR"],
                port=int(env["MASTER_PORT"]),
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                ranks_per_node=int(env["LOCAL_WORLD_SIZE"]),
                prefix=f"automodel/beat/{env.get('TORCHELASTIC_RUN_ID', '')}/{_attempt(env)}",
            )
        except (KeyError, ValueError):
            return None

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def _client(self) -> dist.TCPStore:
        return dist.TCPStore(
            self.addr, self.port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False
        )

    def start(self) -> NodeWatch:
        threading.Thread(target=self._beat, name="automodel-node-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        try:
            store = dist.PrefixStore(self.prefix, self._client())
            while not self._stop.is_set():
                store.add(str(self.rank), 1)
                self._stop.wait(INTERVAL_S)
        except Exception:  # noqa: BLE001 - the store is gone: the check says so, the beat just ends
            return

    def silent_nodes(self, wait_s: float = 6 * INTERVAL_S) -> tuple[list[int], str | None]:
        """(the other nodes none of whose ranks beat within `wait_s`, why the store cannot say)."""
        try:
            store = dist.PrefixStore(self.prefix, self._client())
            first = [store.add(str(r), 0) for r in range(self.world_size)]
            time.sleep(wait_s)
            second = [store.add(str(r), 0) for r in range(self.world_size)]
        except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError / DistStoreError / RuntimeError
            return [], (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        mine = self.node_of(self.rank)
        alive = {self.node_of(r) for r in range(self.world_size) if second[r] > first[r]}
        nodes = range(self.world_size // self.ranks_per_node)
        return [n for n in nodes if n != mine and n not in alive], None

    def failed_node_line(self) -> str | None:
        """The line naming the node that stopped, or None when every other node still beats."""
        silent, unreachable = self.silent_nodes()
        if unreachable is not None:
            if self.node_of(self.rank) == 0:
                return None  # this node hosts the store: its own trouble, not a lost node
            return (
                f"node 0 stopped: the job's store it hosts at {self.addr}:{self.port} is unreachable "
                f"({unreachable}); the ranks of node {self.node_of(self.rank)} stopped with it (see node 0's output)"
            )
        if not silent:
            return None
        names = ", ".join(f"node {n} (ranks {self._ranks(n)})" for n in silent)
        return (
            f"{names} stopped during the run (no heartbeat for {6 * INTERVAL_S:.0f} s); the ranks of node "
            f"{self.node_of(self.rank)} stopped with it (see the output of {'that node' if len(silent) == 1 else 'those nodes'})"
        )

    def _ranks(self, node: int) -> str:
        first = node * self.ranks_per_node
        last = first + self.ranks_per_node - 1
        return str(first) if first == last else f"{first}-{last}"
