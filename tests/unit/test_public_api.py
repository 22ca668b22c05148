"""The public API: every name the docs use is exported, typed, and cheap to import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest

import pepsi
from pepsi import Message, Needs, OutgoingMessage, stage
from pepsi.stage import needs_of

ROOT = Path(__file__).resolve().parents[2]
MYPY = Path(sys.executable).with_name("mypy")


def test_all_is_complete_and_every_name_resolves() -> None:
    public = {
        name
        for name, value in vars(pepsi).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    } - {"TYPE_CHECKING", "Any", "annotations"}
    assert public <= set(pepsi.__all__)
    for name in pepsi.__all__:
        assert getattr(pepsi, name) is not None


@pytest.mark.parametrize(
    "name",
    [
        "Publisher",
        "AsyncPublisher",
        "OutgoingMessage",
        "load_config",
        "Config",
        "DatabaseUnavailable",
        "DatabaseLost",
        "DatabaseBusy",
        "SchemaMismatch",
        "InvalidMessage",
        "NoRoute",
        "Rejected",
        "NotConfirmed",
        "PermanentError",
        "stage",
        "Message",
    ],
)
def test_names_the_docs_use_are_exported(name: str) -> None:
    assert name in pepsi.__all__
    getattr(pepsi, name)


def test_importing_pepsi_does_not_load_the_publishing_clients() -> None:
    code = "import sys, pepsi; print('psycopg_pool' in sys.modules, 'psycopg' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["False", "False"]


def test_public_names_are_real_types_for_mypy(tmp_path: Path) -> None:
    """Each line assigns a public name to an int: mypy must refuse every one (no Any)."""
    names = [
        "Publisher",
        "AsyncPublisher",
        "OutgoingMessage",
        "Pipeline",
        "load_config",
        "Config",
        "DatabaseUnavailable",
        "SchemaMismatch",
        "InvalidMessage",
        "Rejected",
        "Message",
        "stage",
    ]
    lines = [f"from pepsi import {', '.join(names)}"]
    lines += [f"x{i}: int = {name}" for i, name in enumerate(names)]
    lines.append("reveal_type(Publisher.connect)")
    snippet = tmp_path / "snippet.py"
    snippet.write_text("\n".join(lines) + "\n")
    result = subprocess.run(
        [str(MYPY), "--strict", "--no-incremental", "--cache-dir=/dev/null", str(snippet)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    out = result.stdout
    for i in range(len(names)):
        assert f"snippet.py:{i + 2}: error: Incompatible types in assignment" in out, out
    assert "Any" not in out, out


def test_a_stage_using_the_public_api_type_checks(tmp_path: Path) -> None:
    snippet = tmp_path / "good.py"
    snippet.write_text(
        textwrap.dedent(
            """
            from pepsi import Message, Outcome, Publisher, stage

            @stage
            def bare(msg: Message) -> None:
                msg.state["n"] = msg.json()

            @stage(needs="body")
            def parse(msg: Message) -> Outcome:
                return msg.finish()

            def send(pub: Publisher) -> int:
                return pub.publish("inbound", json={"a": 1}, origin_user="u")
            """
        )
    )
    result = subprocess.run(
        [str(MYPY), "--strict", "--no-incremental", "--cache-dir=/dev/null", str(snippet)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout


def test_bare_stage_decorator_and_called_forms() -> None:
    @stage
    def bare(msg: Message) -> None:
        pass

    @stage()
    def called(msg: Message) -> None:
        pass

    @stage("header")
    def positional(msg: Message) -> None:
        pass

    @stage(needs=Needs.BODY)
    def keyword(msg: Message) -> None:
        pass

    assert needs_of(bare) is Needs.METADATA
    assert needs_of(called) is Needs.METADATA
    assert needs_of(positional) is Needs.HEADER
    assert needs_of(keyword) is Needs.BODY
    assert bare.__name__ == "bare"  # the function itself, not a wrapper


def test_old_field_names_still_work_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match="use properties="):
        msg = OutgoingMessage("s", headers={"a": 1})
    assert msg.properties == {"a": 1}
    with pytest.warns(DeprecationWarning, match="use origin_user="):
        msg = OutgoingMessage("s", user="alice", origin_peer="::1")
    assert msg.origin_user == "alice"
    with pytest.warns(DeprecationWarning, match="use origin_peer="):
        msg = OutgoingMessage("s", peer="::1")
    with pytest.warns(DeprecationWarning, match="OutgoingMessage.peer is deprecated"):
        assert msg.peer == "::1"
    with pytest.warns(DeprecationWarning, match="OutgoingMessage.user is deprecated"):
        assert msg.user is None
    with pytest.warns(DeprecationWarning, match="OutgoingMessage.headers is deprecated"):
        assert msg.headers == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OutgoingMessage("s", origin_user="u", origin_peer="::1", properties={})  # no warning
    with pytest.raises(TypeError, match="both user= and origin_user="):
        OutgoingMessage("s", user="a", origin_user="b")
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        OutgoingMessage("s", colour="red")  # type: ignore[call-arg]
