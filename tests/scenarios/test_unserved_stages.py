"""Issue 33: messages published to a stage the running dispatcher does not serve are
named by `pepsi queue status`, `pepsi top` and the publisher itself, instead of waiting
without a word (one embedded database, several configurations)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pepsi.config import load_config
from pepsi.publishing import OutgoingMessage, Publisher
from tests.scenarios.conftest import Pipeline


def test_messages_at_a_stage_nobody_serves_are_named(
    pipeline: Pipeline, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pipeline.configure("[stage-a]\nHANDLER = tests.stages:noop\n")
    dispatcher = pipeline.start()
    other = tmp_path / "other.conf"  # another project's configuration, the same database
    other.write_text(
        "[stage-a]\nHANDLER = tests.stages:noop\n[stage-b]\nHANDLER = tests.stages:noop\n"
    )
    with Publisher.connect(load_config(other), pipeline.dsn) as publisher:
        publisher.publish("a", b"served")
        publisher.publish_many([OutgoingMessage("b", b"x")] * 3)
        publisher.publish("b", b"said once only")
    said = [r.getMessage() for r in caplog.records if "does not serve" in r.getMessage()]
    assert said == [
        "publishing to stage b, which the running dispatcher does not serve (its "
        "configuration has no [stage-b]): the messages wait there"
    ]
    pepsi = [sys.executable, "-m", "pepsi", "-c", str(other)]
    status = subprocess.run(
        [*pepsi, "queue", "status"], env=pipeline.env(), capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert "warning: stage b: 4 pending message(s) that the running dispatcher does not " in (
        " ".join(status.stdout.split())
    )
    frame = subprocess.run(
        [*pepsi, "top", "--json", "--count", "1"], env=pipeline.env(), capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    assert json.loads(frame.stdout.splitlines()[0])["unserved"] == [{"stage": "b", "pending": 4}]
    assert dispatcher.stop() == 0
