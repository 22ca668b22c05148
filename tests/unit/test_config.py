from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pepsi.config import (
    Config,
    Overflow,
    RawSections,
    RawValue,
    load_config,
    merge_overlay,
    parse_config,
    read_file,
)
from pepsi.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pepsi.conf"
    path.write_text(text, encoding="utf-8")
    return path


def load(tmp_path: Path, text: str) -> Config:
    return load_config(write(tmp_path, text))


def error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(tmp_path / "pepsi.conf"))
    return message


PIPELINE = """
[stage-inbound]
HANDLER = examples.demo:inbound
NEXT = deliver
[stage-deliver]
PROGRAM = /usr/bin/deliver
BOUNCE_STAGE = bounce
[stage-bounce]
HANDLER = pepsi.stages.bounce:run
"""


def test_defaults_follow_the_manual(tmp_path: Path) -> None:
    config = load(tmp_path, "[stage-a]\nHANDLER = m:f\n")
    stage = config.stages["a"]
    # QUEUE_LIMIT and MAX_MESSAGES depart from the manual's 4 and 1000 on
    # purpose (docs/performance.md): the window adapts below QUEUE_LIMIT.
    assert (stage.parallelism, stage.queue_limit, stage.max_messages) == (4, 512, 100_000)
    assert stage.max_lifetime == 120 * 3600
    assert stage.capacity == 2048
    assert stage.overflow is Overflow.REJECT_PUBLISH
    assert stage.next is None
    assert stage.bounce_stage is None
    assert stage.fusion is None
    assert config.pepsi.allow_fusion is True
    assert config.dispatch.fair_scheduling is True
    assert config.dispatch.fair_half_life == 60
    assert config.dispatch.fair_fifo_percent == 10
    assert config.dispatch.worker_idle_timeout == 5
    assert config.postgres.worker_synchronous_commit is False
    assert config.postgres.dsn is None


def test_full_file_parses(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
[pepsi]
ALLOW_FUSION = no
share_telemetry = yes   # keys are case-insensitive, kept upper-case
[pepsi-dispatch]
CONFIG_FILE = /etc/pepsi/pepsi.conf
POLL_INTERVAL = 2s
STATS_INTERVAL = 1m
FAIR_SCHEDULING = off
FAIR_HALF_LIFE = 2m
FAIR_FIFO_PERCENT = 25
WORKER_IDLE_TIMEOUT = 500ms
[pepsi-postgres]
DSN = postgresql://u@h/db
DATA_DIR = data
WORKER_SYNCHRONOUS_COMMIT = yes
POOL_MIN_SIZE = 2
POOL_MAX_SIZE = 8
[stage-a]
HANDLER = pkg.mod:func
PARALLELISM = 2
QUEUE_LIMIT = 8
MAX_MESSAGES = 50
MAX_RUNTIME = 30s
MAX_LIFETIME = 1h
FUSION = yes
MAX_LENGTH = 1000
OVERFLOW = drop-head
TTL = 10m
"""
        + PIPELINE.replace("[stage-inbound]", "[stage-inbound]\nMAX_RUNTIME=1h30m"),
    )
    assert config.pepsi == config.pepsi.__class__(allow_fusion=False, share_telemetry=True)
    assert config.dispatch.config_file == Path("/etc/pepsi/pepsi.conf")
    assert config.dispatch.poll_interval == 2
    assert config.dispatch.worker_idle_timeout == 0.5
    assert config.dispatch.fair_fifo_percent == 25
    assert config.postgres.data_dir == tmp_path / "data"  # relative to the file
    assert config.postgres.worker_synchronous_commit is True
    a = config.stages["a"]
    assert (a.parallelism, a.queue_limit, a.max_messages, a.max_runtime) == (2, 8, 50, 30)
    assert (a.max_length, a.overflow, a.ttl, a.fusion) == (1000, Overflow.DROP_HEAD, 600, True)
    assert config.stages["inbound"].max_runtime == 5400
    assert config.entry_stages() == ["a", "inbound"]
    assert config.warnings == ()


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("[stage-a]\nHANDLER = m:f\nPARALLELISM = many\n", "[stage-a] PARALLELISM:", "integer"),
        (
            "[stage-a]\nHANDLER = m:f\nPARALLELISM = 0\n",
            "[stage-a] PARALLELISM:",
            "between 1 and 1000",
        ),
        ("[stage-a]\nHANDLER = m:f\nQUEUE_LIMIT = -1\n", "[stage-a] QUEUE_LIMIT:", "between 1"),
        ("[stage-a]\nHANDLER = m:f\nMAX_RUNTIME = soon\n", "[stage-a] MAX_RUNTIME:", "duration"),
        ("[stage-a]\nHANDLER = m:f\nMAX_RUNTIME = 0s\n", "[stage-a] MAX_RUNTIME:", "at least"),
        ("[stage-a]\nHANDLER = m:f\nFUSION = maybe\n", "[stage-a] FUSION:", "yes or no"),
        ("[stage-a]\nHANDLER = m:f\nOVERFLOW = drop\n", "[stage-a] OVERFLOW:", "drop-head"),
        ("[stage-a]\nHANDLER = m:f\nMAX_LENGTH = 0\n", "[stage-a] MAX_LENGTH:", "at least 1"),
        ("[stage-a]\nHANDLER = m:f\nPARALLELISIM = 2\n", "[stage-a] PARALLELISIM:", "PARALLELISM?"),
        ("[stage-a]\nHANDLER = module\n", "[stage-a] HANDLER:", "package.module:function"),
        ("[stage-a]\nPROGRAM = bin/worker\n", "[stage-a] PROGRAM:", "absolute path"),
        ("[stage-a]\nPROGRAM =\n", "[stage-a] PROGRAM:", "must not be empty"),
        ("[stage-a]\nHANDLER = m:f\nPROGRAM = /bin/x\n", "[stage-a]", "exactly one"),
        ("[stage-a]\nNEXT = a\n", "[stage-a]", "set PROGRAM"),
        ("[stage-a]\nHANDLER = m:f\nNEXT = b\n", "[stage-a] NEXT:", "no stage named 'b'"),
        ("[stage-a]\nHANDLER = m:f\nNEXT = Bad!\n", "[stage-a] NEXT:", "not a stage name"),
        ("[stage-a]\nHANDLER = m:f\nBOUNCE_STAGE = x\n", "[stage-a] BOUNCE_STAGE:", "no stage"),
        ("[stage-a]\nHANDLER = m:f\nBOUNCE_STAGE = a\n", "[stage-a] BOUNCE_STAGE:", "itself"),
        ("[stage-A]\nHANDLER = m:f\n", "[stage-A]", "stage names are lower-case"),
        ("[stages-a]\nHANDLER = m:f\n", "[stages-a]", "unknown section"),
        ("[DEFAULT]\nX = 1\n", "[DEFAULT]", "unknown section"),
        ("[pepsi]\nALLOW_FUSION = sure\n", "[pepsi] ALLOW_FUSION:", "yes or no"),
        ("[pepsi]\nFUSION = yes\n", "[pepsi] FUSION:", "unknown key"),
        ("[pepsi-dispatch]\nPOLL_INTERVAL = x\n", "[pepsi-dispatch] POLL_INTERVAL:", "duration"),
        ("[pepsi-dispatch]\nFAIR_FIFO_PERCENT = 101\n", "FAIR_FIFO_PERCENT:", "between 0 and 100"),
        (
            "[pepsi-dispatch]\nCONFIG_FILE = pepsi.conf\n",
            "[pepsi-dispatch] CONFIG_FILE:",
            "absolute",
        ),
        ("[pepsi-postgres]\nPOOL_MIN_SIZE = 0\n", "[pepsi-postgres] POOL_MIN_SIZE:", "between 1"),
        ("[pepsi-postgres]\nPOOL_MIN_SIZE = 5\nPOOL_MAX_SIZE = 2\n", "POOL_MAX_SIZE:", "at least"),
        ("[pepsi-postgres]\nDSN =\n", "[pepsi-postgres] DSN:", "must not be empty"),
        ("[pepsi]\nALLOW_FUSION = yes\nALLOW_FUSION = no\n", "[pepsi] ALLOW_FUSION:", "twice"),
        ("[pepsi]\n[pepsi]\n", "[pepsi]", "section appears twice"),
        ("ALLOW_FUSION = yes\n", "line 1", "before any [section]"),
        (
            "[pepsi-ingress]\nMAX_MESSAGE_SIZE = 2G\n",
            "[pepsi-ingress] MAX_MESSAGE_SIZE:",
            "between",
        ),
        ("[pepsi-ingress]\nMAX_MESSAGE_SIZE = lots\n", "MAX_MESSAGE_SIZE:", "a size such as"),
        ("[pepsi-ingress]\nDEDUP_WINDOW = 0s\n", "[pepsi-ingress] DEDUP_WINDOW:", "at least"),
        (
            "[pepsi-failure-bouncer]\nSINK = nowhere\n",
            "[pepsi-failure-bouncer] SINK:",
            "no stage named",
        ),
        ("[pepsi-dispatch]\nSTRIKE_DELAY = never\n", "[pepsi-dispatch] STRIKE_DELAY:", "duration"),
        ("[stage-a]\nHANDLER = m:f\nRETRY_DELAY = -1s\n", "[stage-a] RETRY_DELAY:", "duration"),
        ("[pepsi]\nthis line has no equals sign\n", "line 2", "cannot parse"),
    ],
)
def test_errors_name_file_section_and_key(
    tmp_path: Path, text: str, where: str, problem: str
) -> None:
    message = error(tmp_path, text)
    assert where in message
    assert problem in message


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="configuration file not found"):
        load_config(tmp_path / "nope.conf")
    with pytest.raises(ConfigError, match="cannot read"):
        read_file(tmp_path)
    bad = tmp_path / "latin1.conf"
    bad.write_bytes(b"[pepsi]\n# caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)


def test_default_locations_searched_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    assert load_config().path is None  # nothing found: defaults, no stages
    (xdg / "pepsi").mkdir(parents=True)
    (xdg / "pepsi" / "pepsi.conf").write_text("[stage-x]\nHANDLER = m:f\n")
    assert list(load_config().stages) == ["x"]
    (tmp_path / "pepsi.conf").write_text("[stage-y]\nHANDLER = m:f\n")
    config = load_config()
    assert list(config.stages) == ["y"]
    assert config.path == tmp_path / "pepsi.conf"


def test_ingress_and_bouncer_sections(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "[pepsi-ingress]\nMAX_MESSAGE_SIZE = 512K\nDEDUP_WINDOW = 2h\n"
        "[pepsi-failure-bouncer]\nSINK = dead\nINTERVAL = 5s\n"
        "[stage-dead]\nHANDLER = m:f\n",
    )
    assert config.ingress.max_message_size == 512 * 1024
    assert config.ingress.dedup_window == 7200
    assert (config.bouncer.sink, config.bouncer.interval) == ("dead", 5)
    assert load(tmp_path, "[pepsi-failure-bouncer]\nSINK = table\n").bouncer.sink is None
    defaults = load(tmp_path, "")
    assert defaults.ingress.max_message_size == 64 * 1024 * 1024
    assert defaults.dispatch.strike_delay == 60
    assert defaults.dispatch.db_error_pause == 30
    assert defaults.dispatch.tempfail_window == 300


def test_warnings_for_cycles_and_idle_overflow(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "[stage-a]\nHANDLER = m:f\nNEXT = b\nOVERFLOW = drop-head\n"
        "[stage-b]\nHANDLER = m:f\nNEXT = a\n",
    )
    assert any("OVERFLOW has no effect" in w for w in config.warnings)
    assert any("a -> b -> a" in w for w in config.warnings)


def test_overlay_overrides_and_removes(tmp_path: Path) -> None:
    raw = read_file(write(tmp_path, PIPELINE + "PARALLELISM = 3\n"))
    merged = merge_overlay(
        raw,
        [
            ("stage-bounce", "parallelism", None),
            ("stage-deliver", "PARALLELISM", "7"),
            ("stage-extra", "HANDLER", "m:f"),
        ],
    )
    config = parse_config(merged, tmp_path / "pepsi.conf")
    assert config.stages["bounce"].parallelism == 4
    assert config.stages["deliver"].parallelism == 7
    assert "extra" in config.stages


def test_overlay_errors_name_the_overlay(tmp_path: Path) -> None:
    raw: RawSections = {"stage-a": {"HANDLER": RawValue("m:f", "pepsi.conf")}}
    merged = merge_overlay(raw, [("stage-a", "PARALLELISM", "lots")])
    with pytest.raises(ConfigError, match=r"^pepsi.config_override: \[stage-a\] PARALLELISM:"):
        parse_config(merged)
    with pytest.raises(ConfigError, match="not reloadable"):
        merge_overlay(raw, [("pepsi-dispatch", "POLL_INTERVAL", "1s")])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("[::1]:0", ("::1", 0)),
        ("localhost:9464", ("localhost", 9464)),
        ("off", None),
    ],
)
def test_metrics_address(tmp_path: Path, value: str, expected: tuple[str, int] | None) -> None:
    config = load(tmp_path, f"[pepsi-dispatch]\nMETRICS_ADDRESS = {value}\n")
    assert config.dispatch.metrics_address == expected


@pytest.mark.parametrize("value", ["9464", "host:", ":9464", "host:port", "host:70000"])
def test_metrics_address_errors(tmp_path: Path, value: str) -> None:
    message = error(tmp_path, f"[pepsi-dispatch]\nMETRICS_ADDRESS = {value}\n")
    assert "[pepsi-dispatch] METRICS_ADDRESS: expected HOST:PORT" in message


def test_metrics_are_off_by_default(tmp_path: Path) -> None:
    assert load(tmp_path, "").dispatch.metrics_address is None


def test_dispatcher_timings(tmp_path: Path) -> None:
    defaults = load(tmp_path, "").dispatch
    assert (
        defaults.lock_wait,
        defaults.worker_ready_timeout,
        defaults.worker_stop_timeout,
        defaults.worker_kill_grace,
        defaults.reconnect_max_delay,
    ) == (10, 60, 10, 2, 1)
    config = load(
        tmp_path,
        "[pepsi-dispatch]\nLOCK_WAIT = 500ms\nWORKER_READY_TIMEOUT = 2m\n"
        "WORKER_STOP_TIMEOUT = 3s\nWORKER_KILL_GRACE = 0.25\nRECONNECT_MAX_DELAY = 1m\n",
    ).dispatch
    assert (
        config.lock_wait,
        config.worker_ready_timeout,
        config.worker_stop_timeout,
        config.worker_kill_grace,
        config.reconnect_max_delay,
    ) == (0.5, 120, 3, 0.25, 60)


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("LOCK_WAIT", "soon", "duration"),
        ("WORKER_READY_TIMEOUT", "-1s", "duration"),
        ("WORKER_STOP_TIMEOUT", "0s", "at least"),
        ("WORKER_KILL_GRACE", "0", "at least"),
        ("RECONNECT_MAX_DELAY", "50ms", "at least 0.1s"),
    ],
)
def test_dispatcher_timing_errors(tmp_path: Path, key: str, value: str, problem: str) -> None:
    message = error(tmp_path, f"[pepsi-dispatch]\n{key} = {value}\n")
    assert f"[pepsi-dispatch] {key}:" in message
    assert problem in message


# Issue 13, defect 4: the reader's edge cases, each one line naming file and line.
@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("[stage-x\nHANDLER = m:f\n", "line 1", "section header '[stage-x' is not closed"),
        (
            "[stage-a]\nHANDLER = m:f\n[stage-b\nHANDLER = m:g\n",
            "line 3",
            "section header '[stage-b' is not closed",
        ),
        ("[stage-x] y\nHANDLER = m:f\n", "line 1", "unexpected 'y' after the section header"),
        ("[[pepsi]]\n", "line 1", "unexpected ']' after the section header [[pepsi]"),
        ("[]\n", "line 1", "empty section name '[]'"),
        ("[pepsi]\n[ ]\n", "line 2", "empty section name"),
        ("[pepsi]\nALLOW_FUSION = yes\n[pepsi]\n", "[pepsi]", "section appears twice (line 3)"),
        ("[pepsi]\n= yes\n", "line 2", "cannot parse '= yes'"),
        ("hello\n[pepsi]\n", "line 1", "a key before any [section] header"),
        ("[pepsi]\nnonsense\n", "line 2", "cannot parse 'nonsense'"),
    ],
)
def test_reader_edge_cases(tmp_path: Path, text: str, where: str, problem: str) -> None:
    message = error(tmp_path, text)
    assert where in message
    assert problem in message


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "pepsi.conf"
    path.write_bytes(b"\xef\xbb\xbf[pepsi]\nALLOW_FUSION = no\n")
    assert load_config(path).pepsi.allow_fusion is False


@pytest.mark.parametrize("newline", ["\r\n", "\r", "\n"])
def test_any_line_ending_is_accepted(tmp_path: Path, newline: str) -> None:
    text = "[pepsi]\nALLOW_FUSION = no  # inline\n\n[pepsi-postgres]\nDSN = host=x port=5\n"
    path = tmp_path / "pepsi.conf"
    path.write_bytes(text.replace("\n", newline).encode())
    config = load_config(path)
    assert config.pepsi.allow_fusion is False
    assert config.postgres.dsn == "host=x port=5"


def test_comments_and_indentation(tmp_path: Path) -> None:
    text = "  # a comment\n  [stage-a]   ; why\n  HANDLER: m:f\n\tPARALLELISM = 2 # two\n"
    config = load(tmp_path, text)
    assert config.stages["a"].handler == "m:f"
    assert config.stages["a"].parallelism == 2


def test_text_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "pepsi.conf"
    path.write_bytes(b"[pepsi]\n# ok\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"line 3: not UTF-8 text$"):
        load_config(path)
    path.write_bytes("[pepsi]\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=r"line 1: not UTF-8 text \(it looks like UTF-16\)"):
        load_config(path)


# --------------------------------------------------------------------------
# Built-in stages (PROGRAM = pepsi-stage-NAME) and their options.

BUILTINS = """
[stage-check]
PROGRAM = pepsi-stage-if
IF = sender ~ "@spam\\.example$" and not state.seen
THEN = drop
ELSE = mark
[stage-mark]
PROGRAM = pepsi-stage-set
SET = seen=true, score=3
NEXT = drop
[stage-drop]
PROGRAM = pepsi-stage-discard
"""


def test_builtins_parse_into_the_unified_program(tmp_path: Path) -> None:
    config = load(tmp_path, BUILTINS)
    check = config.stages["check"]
    assert (check.builtin, check.program, check.handler) == (
        "if",
        "pepsi-stage-if",
        "pepsi.stages.if_:run",
    )
    assert check.routes == (("THEN", "drop"), ("ELSE", "mark"))
    assert check.fusion is None  # the stage's own default: yes for built-ins (W-10)
    assert config.stages["mark"].builtin_options.values == (("seen", True), ("score", 3))
    assert config.entry_stages() == ["check"]  # THEN and ELSE targets are not entries
    assert config.warnings == ()
    assert hash(check) == hash(load(tmp_path, BUILTINS).stages["check"])  # still frozen


def test_a_pepsi_stage_program_that_is_not_a_builtin_is_an_external_program(
    tmp_path: Path,
) -> None:
    # (the manual's mailing-list manager, not a built-in of this release)
    stage = load(tmp_path, "[stage-a]\nPROGRAM = pepsi-stage-list\n").stages["a"]
    assert (stage.builtin, stage.handler, stage.program) == (None, None, "pepsi-stage-list")


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("[stage-a]\nPROGRAM = pepsi-stage-if\nIFF = 1\nTHEN = a\n", "[stage-a] IFF",
         "unknown key (did you mean IF?)"),
        ("[stage-a]\nHANDLER = m:f\nIF = sender\n", "[stage-a] IF", "unknown key"),
        ("[stage-a]\nPROGRAM = pepsi-stage-discard\nSET = x=1\n", "[stage-a] SET",
         "unknown key"),
        ("[stage-a]\nPROGRAM = pepsi-stage-if\nTHEN = b\n[stage-b]\nHANDLER = m:f\n",
         "[stage-a] IF", "required by pepsi-stage-if"),
        ("[stage-a]\nPROGRAM = pepsi-stage-if\nIF = sender\n", "[stage-a] THEN", "required"),
        ("[stage-a]\nPROGRAM = pepsi-stage-if\nIF = sender ==\nTHEN = a\n", "[stage-a] IF",
         "column 10: expected a field"),
        ("[stage-a]\nPROGRAM = pepsi-stage-if\nIF = subject ~ '['\nTHEN = b\n",
         "[stage-a] IF", "bad regular expression"),
        ("[stage-a]\nPROGRAM = pepsi-stage-if\nIF = sender\nTHEN = nowhere\n",
         "[stage-a] THEN", "no stage named 'nowhere'"),
        ("[stage-a]\nPROGRAM = pepsi-stage-if\nIF = sender\nTHEN = b\nELSE = c\n"
         "[stage-b]\nHANDLER = m:f\n", "[stage-a] ELSE", "no stage named 'c'"),
        ("[stage-a]\nPROGRAM = pepsi-stage-if\nIF = sender\nTHEN = a\n", "[stage-a] THEN",
         "cannot route to itself"),
        ("[stage-a]\nPROGRAM = pepsi-stage-if\nIF = sender\nTHEN = B!\n", "[stage-a] THEN",
         "not a stage name"),
        ("[stage-a]\nPROGRAM = pepsi-stage-set\n", "[stage-a] SET", "required"),
        ("[stage-a]\nPROGRAM = pepsi-stage-set\nSET = x\n", "[stage-a] SET",
         "expected KEY=VALUE"),
        ("[stage-a]\nPROGRAM = pepsi-stage-set\nSET = strikes=0\n", "[stage-a] SET",
         "Pepsi's own bookkeeping"),
        ("[stage-a]\nPROGRAM = pepsi-stage-set\nSET = a=1, a=2\n", "[stage-a] SET",
         "a is set twice"),
        ("[stage-a]\nPROGRAM = pepsi-stage-set\nSET = a='x\n", "[stage-a] SET",
         "string not closed"),
        ("[stage-a]\nPROGRAM = pepsi-stage-set\nSET = a='x' y\n", "[stage-a] SET",
         "not one quoted string"),
        ("[stage-a]\nPROGRAM = pepsi-stage-bounce\nREASON =\n", "[stage-a] REASON",
         "must not be empty"),
        ("[stage-a]\nPROGRAM = pepsi-stage-discard\nHANDLER = m:f\n", "[stage-a]",
         "not both"),
    ],
)  # fmt: skip
def test_builtin_option_errors_are_one_line(
    tmp_path: Path, text: str, where: str, problem: str
) -> None:
    message = error(tmp_path, text)
    assert where in message
    assert problem in message


def test_cycles_through_routes_are_warnings(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "[stage-a]\nPROGRAM = pepsi-stage-if\nIF = state.done\nTHEN = end\nELSE = b\n"
        "[stage-b]\nPROGRAM = pepsi-stage-set\nSET = done=true\nNEXT = a\n"
        "[stage-end]\nPROGRAM = pepsi-stage-discard\n",
    )
    assert len(config.warnings) == 1
    assert "a -> b -> a form a cycle through a built-in's routes" in config.warnings[0]


def test_builtin_options_can_come_from_the_overlay(tmp_path: Path) -> None:
    raw = read_file(write(tmp_path, BUILTINS))
    merged = merge_overlay(
        raw, [("stage-check", "if", "subject == 'x'"), ("stage-check", "else", None)]
    )
    stage = parse_config(merged).stages["check"]
    assert stage.routes == (("THEN", "drop"),)
    assert stage.builtin_options.describe() == 'if subject == "x"'


def test_config_check_prints_builtins_and_routes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pepsi.cli import main  # noqa: PLC0415

    assert main(["-c", str(write(tmp_path, BUILTINS)), "config", "check"]) == 0
    out = capsys.readouterr().out
    assert "built-in if" in out
    assert "then drop, else mark" in out
    assert 'check: if sender ~ "@spam\\.example$" and not state.seen: THEN drop, ELSE mark' in out
    assert "check → (routes)" in out


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_any_if_condition_is_config_or_a_config_error(text: str) -> None:
    value = text.replace("\n", " ").replace("\r", " ")
    raw: RawSections = {
        "stage-a": {
            "PROGRAM": RawValue("pepsi-stage-if", "f.conf"),
            "IF": RawValue(value, "f.conf"),
            "THEN": RawValue("b", "f.conf"),
        },
        "stage-b": {"PROGRAM": RawValue("pepsi-stage-discard", "f.conf")},
    }
    problem = "f.conf: [stage-a] IF: "  # what an error starts with
    try:
        parse_config(raw)
    except ConfigError as exc:
        problem = str(exc)
    assert "\n" not in problem
    assert problem.startswith("f.conf: [stage-a] IF: ")


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["SET", "REASON"]), st.text(max_size=40))
def test_any_set_or_reason_is_config_or_a_config_error(key: str, text: str) -> None:
    program = "pepsi-stage-set" if key == "SET" else "pepsi-stage-bounce"
    raw: RawSections = {
        "stage-a": {
            "PROGRAM": RawValue(program, "f.conf"),
            key: RawValue(text.replace("\n", " ").replace("\r", " "), "f.conf"),
        }
    }
    problem = f"f.conf: [stage-a] {key}: "  # what an error starts with
    try:
        parse_config(raw)
    except ConfigError as exc:
        problem = str(exc)
    assert "\n" not in problem
    assert problem.startswith(f"f.conf: [stage-a] {key}: ")


def test_branches_that_join_again_are_no_cycle(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "[stage-a]\nPROGRAM = pepsi-stage-if\nIF = state.x\nTHEN = b\nELSE = c\n"
        "[stage-b]\nPROGRAM = pepsi-stage-set\nSET = y=1\nNEXT = d\n"
        "[stage-c]\nPROGRAM = pepsi-stage-set\nSET = y=2\nNEXT = d\n"
        "[stage-d]\nPROGRAM = pepsi-stage-if\nIF = state.y == 1\nTHEN = e\n"
        "[stage-e]\nPROGRAM = pepsi-stage-discard\n",
    )
    assert config.warnings == ()
    assert config.entry_stages() == ["a"]


def test_next_that_a_builtin_never_takes_is_a_warning(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "[stage-a]\nPROGRAM = pepsi-stage-if\nIF = state.x\nTHEN = b\nELSE = c\nNEXT = c\n"
        "[stage-b]\nPROGRAM = pepsi-stage-discard\nNEXT = c\n"
        "[stage-c]\nPROGRAM = pepsi-stage-bounce\n",
    )
    assert config.warnings == (
        "[stage-a] NEXT has no effect: pepsi-stage-if goes to THEN or ELSE",
        "[stage-b] NEXT has no effect: pepsi-stage-discard never advances",
    )


def test_a_stage_may_go_on_to_an_amqp_queue(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "[stage-a]\nHANDLER = m:f\nNEXT = amqp:orders\nBOUNCE_STAGE = amqp:/b2b:dead\n"
        "[pepsi-amqp]\nSTAGES = a\n",
    )
    assert config.stages["a"].next == "amqp:/:orders"
    assert config.stages["a"].bounce_stage == "amqp:/b2b:dead"
    assert config.amqp.stages == ("a",)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[stage-a]\nHANDLER = m:f\nNEXT = amqp:\n", "amqp:QUEUE"),
        ("[stage-a]\nHANDLER = m:f\n[pepsi-amqp]\nSTAGES = a, b\n", "no stage named 'b'"),
        ("[stage-a]\nHANDLER = m:f\n[pepsi-amqp]\nSTAGES = a:b\n", "not a stage name"),
    ],
)
def test_amqp_stage_references_are_checked(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load(tmp_path, text)


def test_publish_buffers_hold_at_least_one_message(tmp_path: Path) -> None:
    """Issue 34, finding 1: the buffers bounding AMQP bodies being received."""
    config = load(tmp_path, "[pepsi-amqp]\nPUBLISH_BUFFER = 1G\nCONNECTION_PUBLISH_BUFFER = 300M\n")
    assert (config.amqp.publish_buffer, config.amqp.connection_publish_buffer) == (
        1024**3,
        300 * 1024**2,
    )
    assert "CONNECTION_PUBLISH_BUFFER" in error(
        tmp_path, "[pepsi-amqp]\nCONNECTION_PUBLISH_BUFFER = 64M\n"
    )  # less than MAX_MESSAGE_SIZE (128M)
    assert "less than CONNECTION_PUBLISH_BUFFER" in error(
        tmp_path, "[pepsi-amqp]\nPUBLISH_BUFFER = 200M\n"
    )
