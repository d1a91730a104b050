"""The coordinator's side of the rank protocol: one typed request per verb to a member, failures told apart (the
rank is gone, or it answered with an error), and the group-wide operations: form, step, publish, leave.

A member is gone when its subject has no responders (the process died), when another process answers on its cell
(the agent restarted it), or when it does not answer in time. While a form, a step or a publication runs, the members
that have not answered yet are pinged every `probe_every_s`: a rank killed mid-step never answers its request, but
its subjects lose their responders at once, and the survivors' collectives fail (or time out) soon after. When
the bus itself reconnected meanwhile (NATS restarted), every subject lost its responders for a moment: a member
that answers a ping again within `reconnect_grace_s` failed the operation but is not gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import nats.errors

from services.trainer.membership import Member
from services.trainer.protocol import (
    Body,
    FormReply,
    FormRequest,
    LeaveReply,
    LeaveRequest,
    PingReply,
    PingRequest,
    PublishReply,
    PublishRequest,
    RankAnsweredError,
    StepReply,
    StepRequest,
    Verb,
    decode_reply,
    rank_subject,
)
from shared.bus import Bus
from shared.events import BlobRef

R = TypeVar("R", bound=Body)
PING_TIMEOUT_S = 10.0  # a rank's event loop answers at once; a slow answer is no proof of death


class GroupError(Exception):
    pass


GoneHow = Literal["no responders", "replaced", "timed out"]


class RankGone(GroupError):
    def __init__(self, member: Member, how: GoneHow, detail: str) -> None:
        super().__init__(f"rank {member.rank_id} on {member.cell_id} is gone ({how}): {detail}")
        self.member = member
        self.how = how


class GroupBroken(GroupError):
    """A group-wide operation failed: `gone` are the members that are gone, `errors` what the others said."""

    def __init__(self, what: str, gone: Sequence[Member], errors: dict[Member, str]) -> None:
        parts = [f"gone: {', '.join(m.cell_id for m in gone)}"] if gone else []
        parts += [f"{m.cell_id}: {e}" for m, e in errors.items()]
        super().__init__(f"{what} failed ({'; '.join(parts) or 'no detail'})")
        self.gone = tuple(gone)
        self.errors = dict(errors)


@dataclass(frozen=True)
class Group:
    generation: int
    members: tuple[Member, ...]  # in rank order

    @property
    def world_size(self) -> int:
        return len(self.members)


class RankClient:
    def __init__(self, bus: Bus, probe_every_s: float = 1.0, reconnect_grace_s: float = 20.0) -> None:
        self.bus = bus
        self.probe_every_s = probe_every_s
        # While the bus reconnects (NATS restarting) every subject loses its responders for a moment: a member
        # that seemed gone then is pinged for this long before it is given up.
        self.reconnect_grace_s = reconnect_grace_s

    def _reconnects(self) -> int:
        return int(self.bus.nc.stats.get("reconnects", 0))

    async def _answers_again(self, member: Member) -> bool:
        """Whether `member`, which seemed gone while the bus reconnected, answers a ping within the grace."""
        deadline = asyncio.get_running_loop().time() + self.reconnect_grace_s
        while True:
            try:
                await self.call(member, "ping", PingRequest(), PingReply, PING_TIMEOUT_S)
                return True
            except RankGone as exc:
                if exc.how == "replaced":
                    return False
            except Exception:  # this side still reconnecting
                pass
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.5)

    async def call(self, member: Member, verb: Verb, request: Body, reply_type: type[R], timeout_s: float) -> R:
        subject = rank_subject(self.bus.prefix, member.cell_id, verb)
        try:
            data = await self.bus.request(subject, request.model_dump_json().encode(), timeout=timeout_s)
        except nats.errors.NoRespondersError as exc:
            raise RankGone(member, "no responders", f"no process answers {verb} on its cell") from exc
        except nats.errors.TimeoutError as exc:
            raise RankGone(member, "timed out", f"no answer to {verb} within {timeout_s:g} s") from exc
        try:
            reply = decode_reply(verb, data)
        except RankAnsweredError as exc:
            if exc.reply.rank_id and exc.reply.rank_id != member.rank_id:
                raise RankGone(member, "replaced", f"{exc.reply.rank_id} answers on its cell now") from exc
            raise
        if not isinstance(reply, reply_type):
            raise GroupError(f"{verb} to {member.cell_id} answered with a {type(reply).__name__}")
        answered = getattr(reply, "rank_id", member.rank_id)
        if answered != member.rank_id:
            raise RankGone(member, "replaced", f"{answered} answers on its cell now")
        return reply

    async def alive(self, member: Member) -> bool:
        """False when the member's process is gone: no responders, or another process answers on its cell. A slow
        answer proves nothing (a loaded machine); the request of the verb itself has its own timeout."""
        try:
            await self.call(member, "ping", PingRequest(), PingReply, PING_TIMEOUT_S)
        except RankGone as exc:
            return exc.how == "timed out"
        return True

    async def form(self, group: Group, requests: Sequence[FormRequest], timeout_s: float) -> list[FormReply]:
        """Every member joins `group` (they meet in the coordinator's store, so all must come)."""
        calls = {m: self.call(m, "form", r, FormReply, timeout_s) for m, r in zip(group.members, requests, strict=True)}
        return await self._on_every_member("the form", calls)

    async def step(self, group: Group, request: StepRequest, timeout_s: float) -> list[StepReply]:
        """The step on every member at once; raises `GroupBroken` when any member fails or is found gone."""
        return await self._on_every_member(
            "the step", {m: self.call(m, "step", request, StepReply, timeout_s) for m in group.members})

    async def publish(self, group: Group, timeout_s: float) -> PublishReply:
        """The weights the group holds, stored by rank 0 (gathering them is a collective: every member takes part)."""
        request = PublishRequest(generation=group.generation)
        calls = {m: self.call(m, "publish", request, PublishReply, timeout_s) for m in group.members}
        replies = await self._on_every_member("publishing the weights", calls)
        if replies[0].weights is None:
            raise GroupError(f"rank 0 ({group.members[0].cell_id}) stored no weights")
        return replies[0]

    async def _on_every_member(self, what: str, calls: dict[Member, Coroutine[Any, Any, R]]) -> list[R]:
        """The replies of every member in rank order, or `GroupBroken` once every member still alive has answered
        (the survivors of a dead peer return from their collectives with an error, or after the group's timeout).
        The members that have not answered are pinged every `probe_every_s`; one found gone is not waited for."""
        tasks = {m: asyncio.ensure_future(c) for m, c in calls.items()}
        gone: list[Member] = []
        reconnects = self._reconnects()
        try:
            pending = set(tasks.values())
            while pending:
                _, pending = await asyncio.wait(
                    pending, timeout=self.probe_every_s, return_when=asyncio.FIRST_COMPLETED)
                waiting = [m for m, t in tasks.items() if t in pending]
                for member, ok in zip(waiting, await asyncio.gather(*(self.alive(m) for m in waiting)), strict=True):
                    if not ok:
                        tasks[member].cancel()
                        pending.discard(tasks[member])
                        gone.append(member)
        finally:
            for task in tasks.values():
                task.cancel()
        errors: dict[Member, str] = {}
        for member, task in tasks.items():
            if member in gone:
                continue
            if task.cancelled() or isinstance(task.exception(), RankGone):
                gone.append(member)
            elif (exc := task.exception()) is not None:
                errors[member] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RankAnsweredError) else str(exc)
        if gone and (self._reconnects() != reconnects or self.bus.nc.is_reconnecting):
            # Cut off by the bus, perhaps not dead: a member that answers again failed this operation (its
            # answer was lost) and stays for the next group; the rest are gone.
            back = await asyncio.gather(*(self._answers_again(m) for m in gone))
            for member, answers in zip(list(gone), back, strict=True):
                if answers:
                    gone.remove(member)
                    errors[member] = "its answer was lost while the bus reconnected"
        if gone or errors:
            raise GroupBroken(what, gone, errors)
        return [task.result() for task in tasks.values()]

    async def leave(self, members: Sequence[Member], generation: int, timeout_s: float) -> dict[Member, float]:
        """Let `members` go back to standing by; returns each one's seconds (a member that is gone has left)."""

        async def one(member: Member) -> float:
            try:
                reply = await self.call(member, "leave", LeaveRequest(generation=generation), LeaveReply, timeout_s)
                return reply.seconds
            except (GroupError, RankAnsweredError):
                return 0.0

        seconds = await asyncio.gather(*(one(m) for m in members))
        return dict(zip(members, seconds, strict=True))


__all__ = ["Group", "GroupBroken", "GroupError", "RankClient", "RankGone"]
