"""Which session a request is lent: how much of its conversation a session holds."""

from __future__ import annotations

from typing import Any

import pytest

import kvrt
from kvrt.serve.pool import Pool, shared

SYSTEM = kvrt.Message(role="system", content="Be brief.")
ASK = kvrt.Message(role="user", content="Weather in Paris?")
CALL = kvrt.Message(
    role="assistant", content="", tool_calls=(("c1", "weather", '{"city": "Paris"}'),)
)
AS_JSON = kvrt.Message(role="assistant", content='{"city": "Paris"}')
NEXT = kvrt.Message(role="user", content="And in Rome?")


def test_a_session_holding_the_whole_start_of_a_request_counts_all_of_it() -> None:
    assert shared((SYSTEM, ASK, CALL), (SYSTEM, ASK, CALL, NEXT)) == 3
    assert shared((SYSTEM, ASK), (SYSTEM, ASK)) == 2
    assert shared("Once upon", "Once upon a time") == len("Once upon")


def test_a_reply_sent_back_changed_leaves_everything_before_it() -> None:
    assert shared((SYSTEM, ASK, CALL), (SYSTEM, ASK, AS_JSON, NEXT)) == 2


def test_another_conversation_on_the_same_system_prompt_counts_nothing() -> None:
    # Lending it would push that conversation's turns out for one shared message.
    other = kvrt.Message(role="user", content="Weather in Oslo?")
    assert shared((SYSTEM, ASK, CALL), (SYSTEM, other)) == 0
    assert shared((SYSTEM, ASK, CALL), (SYSTEM, other, AS_JSON, NEXT)) == 0
    assert shared((SYSTEM, ASK, CALL), (SYSTEM, ASK)) == 0  # shorter: a retry of ASK
    assert shared("Once upon", "Twice upon") == 0


def test_a_negative_number_of_idle_sessions_is_a_config_error() -> None:
    runtime: Any = None  # refused before the runtime is looked at
    with pytest.raises(kvrt.ConfigError, match="idle_sessions must be 0 or more"):
        Pool(runtime, max_sessions=4, max_queue=16, hot_tokens=None, idle_sessions=-1)
