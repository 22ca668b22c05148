from __future__ import annotations

import gc
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from pepsi.cli import main, split_globals
from pepsi.commands.serve import dispatch_cmd
from pepsi.db.queries import parse_named

CONF = """
[stage-inbound]
HANDLER = tests.stages:noop
NEXT = deliver
[stage-deliver]
PROGRAM = /usr/bin/deliver
"""


def test_split_globals() -> None:
    assert split_globals(["-c", "f", "-v", "config", "check"]) == (
        ["-c", "f", "-v"],
        ["config", "check"],
    )
    assert split_globals(["--config=f", "-Ldebug", "db", "url"]) == (
        ["--config=f", "-Ldebug"],
        ["db", "url"],
    )
    assert split_globals(["db"]) == ([], ["db"])


@pytest.mark.parametrize("flag", ["-v", "--verbose", "-c", "--config=x", "-L", "--log", "-V"])
def test_trailing_global_flag_is_rejected_in_one_line(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "check", flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "must come before the subcommand" in err


def test_help_after_subcommand_is_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["config", "check", "--help"])
    assert info.value.code == 0
    assert "stage graph" in capsys.readouterr().out


def test_help_lists_only_working_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("setup", "config", "db"):
        assert command in out
    assert "Global options must precede the subcommand" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["-V"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("pepsi 0.1.0 (schema version ")


def test_bad_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-L", "loud", "config", "check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pepsi: argument -L/--log: invalid choice: 'loud'")
    assert err.endswith("(see pepsi --help)\n")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["nosuch"], "argument COMMAND: invalid choice: 'nosuch'"),
        (["queue"], "the following arguments are required: ACTION (see pepsi queue --help)"),
        (["queue", "retry", "x"], "argument ID: invalid int value: 'x' (see pepsi queue retry"),
        (["queue", "move", "1"], "the following arguments are required: --to"),
        (["queue", "status", "--nope"], "unrecognized arguments: --nope"),
        (["top", "--count", "1.5"], "argument --count: invalid int value: '1.5'"),
        (["-c"], "argument -c/--config: expected one argument"),
        (["queue", "list", "--status", "gone"], "argument --status: invalid choice: 'gone'"),
        # a second "--" left Python 3.11's argparse giving READ an empty list
        (["amqp", "permissions", "set", "--", "u", "c", "w", "--"], "argument READ: expected one"),
    ],
)
def test_argparse_mistakes_are_one_line_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("pepsi: ")
    assert message in captured.err
    assert captured.err.count("\n") == 1


def test_an_alias_names_itself_in_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["retry", "x"], command="queue") == 2
    err = capsys.readouterr().err
    assert err.startswith("pepsi-queue: argument ID: invalid int value: 'x'")
    assert "(see pepsi-queue queue retry --help)" in err


def test_a_newline_in_an_argument_stays_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["queue", "status", "a\nb\rc"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_undecodable_bytes_in_an_argument_are_one_line(
    isolated_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What Python makes of `pepsi queue move 1 --to $'\xff'` (surrogateescape).
    (isolated_env / "pepsi.conf").write_text(CONF)
    code = main(["queue", "move", "1", "--to", b"\xff".decode("utf-8", "surrogateescape")])
    err = capsys.readouterr().err
    assert code == 1
    assert err == "pepsi: no stage named '\\udcff'\n"


def test_a_bug_keeps_its_traceback() -> None:
    """Only domain and database errors are turned into one line; a bug is not hidden."""
    code = (
        "import pepsi.commands.operate.config_cmd as c\n"
        "def broken(args, ctx): raise RuntimeError('a bug')\n"
        "c.run_check = broken\n"
        "from pepsi.cli import main\n"
        "main(['config', 'check'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert "Traceback" in done.stderr
    assert "RuntimeError: a bug" in done.stderr


def test_ctrl_c_is_130_and_quiet() -> None:
    code = (
        "import pepsi.commands.operate.config_cmd as c\n"
        "def interrupted(args, ctx): raise KeyboardInterrupt\n"
        "c.run_check = interrupted\n"
        "from pepsi.cli import main\n"
        "raise SystemExit(main(['config', 'check']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert (done.returncode, done.stderr) == (130, "")


def test_config_check_prints_the_graph(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    assert main(["-c", str(path), "config", "check"]) == 0
    out = capsys.readouterr().out
    assert "inbound → deliver → done" in out
    assert "tests.stages:noop" in out
    assert f"{path}: OK" in out.replace("\n", "")


def test_config_check_error_is_one_line_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF + "NEXT = nowhere\n")
    assert main(["-c", str(path), "config", "check"]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == f"pepsi: {path}: [stage-deliver] NEXT: no stage named 'nowhere' (no [stage-nowhere])\n"
    )


def test_config_check_imports_each_handler_as_its_worker_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A HANDLER that cannot be imported was OK here, and its worker then refused to start
    every 5 s: now config check says so, for each stage, as the worker would."""
    (tmp_path / "beside.py").write_text("def run(msg):\n    return None\n")
    path = tmp_path / "pepsi.conf"
    path.write_text(
        "[stage-a]\nHANDLER = beside:run\nNEXT = b\n"  # next to the file: found
        "[stage-b]\nHANDLER = nosuch.module:fn\nNEXT = c\n"
        "[stage-c]\nHANDLER = beside:missing\nNEXT = d\n"
        "[stage-d]\nPROGRAM = /usr/bin/deliver\n"  # an executable: nothing to import
    )
    assert main(["-c", str(path), "config", "check"]) == 1
    captured = capsys.readouterr()
    errors = [line for line in captured.out.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: [stage-b] HANDLER: cannot import nosuch.module: No module named 'nosuch'",
        "error: [stage-c] HANDLER: beside has no missing",
    ]
    assert (
        captured.err
        == f"pepsi: {path}: 2 stage(s) would not start (see above); a worker refuses the same way\n"
    )
    assert main(["-c", str(path), "config", "check", "--no-import"]) == 0


def test_config_check_without_any_file(
    isolated_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "check"]) == 1
    assert "no configuration file found" in capsys.readouterr().err


def test_alias_behaves_like_the_subcommand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    assert main(["-c", str(path), "check"], command="config") == 0
    via_alias = capsys.readouterr().out
    assert main(["-c", str(path), "config", "check"]) == 0
    assert capsys.readouterr().out == via_alias
    assert main(["check", "-v"], command="config") == 2
    assert "pepsi-config: global option -v" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["pepsi", "pepsi-config", "pepsi-setup"])
def test_console_scripts_are_installed(script: str, tmp_path: Path) -> None:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    exe = Path(sys.executable).parent / script
    args = ["-c", str(path), "config", "check"] if script == "pepsi" else ["--help"]
    done = subprocess.run([exe, *args], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


def test_named_queries_parse() -> None:
    text = "-- name: a_get\nSELECT 1;\n\n-- name: b_set\nUPDATE x SET y = 1;\n"
    assert parse_named(text) == {"a_get": "SELECT 1;", "b_set": "UPDATE x SET y = 1;"}
    with pytest.raises(ValueError, match="defined twice"):
        parse_named(text + "-- name: a_get\nSELECT 2;\n")


def test_a_worker_loads_only_its_own_command() -> None:
    """`pepsi worker` starts for every worker process: no dispatcher, publisher or rich."""
    heavy = ("pepsi.dispatch", "pepsi.publishing", "pepsi.commands.", "rich", "prometheus_client")
    code = (
        "import sys; from pepsi.cli import build_parser; build_parser('pepsi', 'worker'); "
        f"print(sorted(m for m in sys.modules if m.startswith({heavy!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # its command module, and the (docstring-only) package it sits in
    assert out.stdout.strip() == "['pepsi.commands.serve', 'pepsi.commands.serve.worker_cmd']"


def test_help_lists_every_command_without_importing_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("setup", "dispatch", "ingress", "failure-bouncer", "queue", "top", "worker"):
        assert command in out


def test_the_dispatcher_tunes_its_garbage_collector() -> None:
    before = gc.get_threshold()
    try:
        dispatch_cmd.tune_garbage_collector()
        assert gc.get_threshold() == dispatch_cmd.GC_THRESHOLDS
        assert gc.get_freeze_count() > 0  # what was loaded is out of later collections
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_log_record_is_one_line_whatever_its_arguments_hold() -> None:
    """Issue 34, finding 9: a peer's text (an AMQP mechanism, an SMTP command) logged
    with a newline or an escape sequence wrote lines of its own."""
    from pepsi.cli import OneLineFormatter  # noqa: PLC0415

    formatter = OneLineFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord(
        "pepsi.amqp", logging.INFO, __file__, 1, "unknown mechanism %s",
        ("PLAIN\n2026-12-05 CRITICAL forged\r\x1b[31m\u2028",), None,
    )  # fmt: skip
    assert formatter.format(record) == (
        "INFO unknown mechanism PLAIN\\n2026-12-05 CRITICAL forged\\r\\x1b[31m\\u2028"
    )
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord(
            "pepsi", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    assert formatter.format(failed).startswith("ERROR failed\nTraceback")  # kept below
