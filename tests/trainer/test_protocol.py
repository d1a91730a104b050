"""The coordinator ↔ rank protocol: subjects outside the event streams, bodies that carry what a step can produce."""

from __future__ import annotations

import pytest

from services.trainer.protocol import (
    ErrorReply,
    RankAnsweredError,
    StepReply,
    decode_reply,
    rank_subject,
)
from shared.bus import FAMILIES


def test_rank_subjects_are_outside_every_event_familys_stream() -> None:
    """A family's JetStream stream takes `<prefix>.<family>.>`: a request there would be stored and acknowledged
    by the stream (the requester could take the stream's ack for the rank's answer)."""
    subject = rank_subject("gyre", "n-cell0", "step")
    assert subject == "gyre.trainer-rank.n-cell0.step"
    assert not any(subject.startswith(f"gyre.{family}.") for family in FAMILIES)


def test_a_diverged_steps_metrics_cross_the_wire_and_an_error_reply_is_an_error() -> None:
    reply = StepReply(rank_id="r", rank=0, metrics={"grad_norm": float("inf"), "loss": 1.5}, micro_batches=1, tokens=3,
                      seconds=0.1, checkpoint_s=0.1, step_count=1, policy_version=1)
    back = decode_reply("step", reply.model_dump_json().encode())
    assert isinstance(back, StepReply) and back.metrics["grad_norm"] == float("inf")
    with pytest.raises(RankAnsweredError, match="RuntimeError: gloo"):
        decode_reply("step", ErrorReply(rank_id="r", error="RuntimeError: gloo").model_dump_json().encode())
    with pytest.raises(RankAnsweredError):  # what shared.bus.Bus.serve answers for a handler that raised
        decode_reply("form", b'{"error": "ValueError: bad"}')
