"""Sticking executions to one of a run's gateways (pure)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.gateways import GatewayListError, gateway_for, gateway_urls

URLS = ["http://127.0.0.1:8400", "http://127.0.0.1:8401", "http://127.0.0.1:8402"]


def test_a_gateway_list_is_read_from_one_setting_and_a_bad_one_is_named() -> None:
    assert gateway_urls("http://a:1") == ["http://a:1"]
    assert gateway_urls(" http://a:1/, http://b:2 ") == ["http://a:1", "http://b:2"]
    with pytest.raises(GatewayListError, match="at least one"):
        gateway_urls(" , ")
    with pytest.raises(GatewayListError, match="like http://host:port"):
        gateway_urls("http://a:1,b:2")
    with pytest.raises(GatewayListError, match="listed twice"):
        gateway_urls("http://a:1,http://a:1/")


@given(st.text(min_size=1, max_size=40))
def test_every_process_picks_the_same_gateway_whatever_the_order_of_the_list(execution_id: str) -> None:
    chosen = gateway_for(execution_id, URLS)
    assert chosen in URLS and gateway_for(execution_id, list(reversed(URLS))) == chosen


def test_executions_spread_evenly_and_a_new_gateway_takes_only_its_share() -> None:
    ids = [f"q{q}-{i}" for q in range(200) for i in range(8)]
    spread = Counter(gateway_for(e, URLS) for e in ids)
    assert set(spread) == set(URLS) and min(spread.values()) > len(ids) / len(URLS) * 0.85
    grown = [*URLS, "http://127.0.0.1:8403"]
    moved = [e for e in ids if gateway_for(e, grown) != gateway_for(e, URLS)]
    # Only executions the new gateway takes move (about a quarter), none between the old ones.
    assert all(gateway_for(e, grown) == grown[-1] for e in moved)
    assert 0.18 < len(moved) / len(ids) < 0.32
    with pytest.raises(GatewayListError):
        gateway_for("x", [])
