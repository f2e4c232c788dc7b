"""Admission control: how many requests this server lets wait (--max-waiting-requests). A request that would
make the queue longer gets 503 + Retry-After at once, before any tokenising, instead of waiting in memory."""
from __future__ import annotations

from tdpipe.core.engine_client import EngineClient
from tdpipe.entrypoints.openai.errors import OpenAIError

__all__ = ["Admission", "Ticket"]


class Admission:
    """Bounds the requests queued in this server (--max-waiting-requests): a request that would make the
    queue longer gets 503 + Retry-After instead of waiting in memory.

    Waiting = the larger of the engine's waiting queue (its last snapshot, one step old) and what this server
    knows without delay: its requests that have no output token yet, and its requests still unfinished in
    the engine (the client's `num_unfinished`, else this server's open ones) beyond the most the engine can
    run at once (max_num_seqs). A request that finished in the engine no longer counts, even while a slow
    client has not read its end."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.unstarted = 0  # accepted, no output token yet
        self.open = 0  # accepted, not finished

    def waiting(self, engine: EngineClient) -> int:
        try:
            stats = engine.stats()
            engine_waiting = int(stats.get("num_waiting", 0))
            unfinished = int(stats.get("num_unfinished", self.open))
        except Exception:  # noqa: BLE001 - a dying engine: the local counts still hold
            engine_waiting, unfinished = 0, self.open
        return max(engine_waiting, self.unstarted, unfinished - int(engine.max_num_seqs or 0))

    def admit(self, engine: EngineClient, n: int) -> list["Ticket"]:
        waiting = self.waiting(engine)
        if waiting + n > self.limit:
            raise OpenAIError(503, f"the server is busy: {waiting} requests are waiting (at most "
                              f"{self.limit}, --max-waiting-requests); retry later", code="server_busy",
                              headers={"Retry-After": "1"})
        return [Ticket(self) for _ in range(n)]


class Ticket:
    """One admitted prompt's place in the counts; `release` is idempotent and also runs when the ticket is
    garbage-collected, so no path (a cancelled task, a response never sent) leaves a count behind."""

    __slots__ = ("adm", "unstarted", "open")

    def __init__(self, adm: Admission) -> None:
        self.adm = adm
        self.unstarted = self.open = True
        adm.unstarted += 1
        adm.open += 1

    def started(self) -> None:
        if self.unstarted:
            self.unstarted = False
            self.adm.unstarted -= 1

    def release(self) -> None:
        self.started()
        if self.open:
            self.open = False
            self.adm.open -= 1

    __del__ = release
