"""pepsi-dispatch.service and `pepsi systemd unit` (SPEC P-15)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pepsi.cli import main
from pepsi.commands.serve.systemd_cmd import (
    DEFAULT_CONFIG,
    UNIT_NAME,
    quote_word,
    render_unit,
    shipped_unit,
)
from pepsi.config.model import DispatchOptions

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
# Keys systemd learnt in 254: an older one warns that it ignores them, and nothing else.
NEWER_KEYS = ("RestartSteps", "RestartMaxDelaySec")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values]}} (a key may repeat, as in systemd)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            assert line.endswith("]"), raw
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"a setting outside any section: {raw}"
        assert not raw.endswith("\\"), "no continuation lines"
        key, equals, value = line.partition("=")
        assert equals, raw
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def split_command(line: str) -> list[str]:
    """A systemd command line as its words (systemd.syntax(7) quoting, specifiers, $$)."""
    words = []
    for match in re.finditer(r'"((?:[^"\\]|\\.)*)"|(\S+)', line):
        quoted, plain = match.groups()
        word = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else plain
        words.append(word.replace("%%", "%").replace("$$", "$"))
    return words


def only(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section][key]
    assert len(values) == 1, (key, values)
    return values[0]


def test_the_shipped_unit_has_the_restart_policy_of_p15() -> None:
    unit = parse_unit(shipped_unit())
    assert set(unit) == {"Unit", "Service", "Install"}
    assert only(unit, "Unit", "StartLimitIntervalSec") == "0"  # no start limit
    assert "network-online.target" in only(unit, "Unit", "Wants").split()
    assert set(only(unit, "Unit", "After").split()) == {
        "network-online.target",
        "postgresql.service",
    }
    service = {key: values[-1] for key, values in unit["Service"].items()}
    assert service["Restart"] == "always"
    assert service["RestartSec"] == "2s"
    assert service["RestartMaxDelaySec"] == "1min"
    assert int(service["RestartSteps"]) > 0
    assert service["KillSignal"] == "SIGTERM"
    assert service["KillMode"] == "mixed"
    assert service["Type"] == "exec"
    assert only(unit, "Install", "WantedBy") == "multi-user.target"


def test_the_stop_timeout_outlasts_the_dispatchers_own_stop() -> None:
    seconds = int(only(parse_unit(shipped_unit()), "Service", "TimeoutStopSec").removesuffix("s"))
    # Workers: SIGTERM, then SIGKILL after the grace; then the final writes and
    # up to 10 s for a VACUUM in progress (Vacuum.close).
    assert seconds > DispatchOptions.worker_kill_grace + 10.0 + 5.0


def test_printed_unit_fills_in_the_paths(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    program = tmp_path / "pepsi"
    assert (
        main(
            [
                "systemd",
                "unit",
                "--exec",
                str(program),
                "--config-file",
                "/srv/pepsi/pepsi.conf",
                "--environment-file=-/srv/pepsi/env",
                "--user",
                "mail",
            ]
        )
        == 0
    )
    unit = parse_unit(capsys.readouterr().out)
    assert split_command(only(unit, "Service", "ExecStart")) == [
        str(program),
        "-c",
        "/srv/pepsi/pepsi.conf",
        "dispatch",
        "serve",
    ]
    assert only(unit, "Service", "EnvironmentFile") == "-/srv/pepsi/env"
    assert only(unit, "Service", "User") == "mail"
    assert only(unit, "Service", "Restart") == "always"


def test_defaults_are_etc_and_the_pepsi_beside_python(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["systemd", "unit"]) == 0
    unit = parse_unit(capsys.readouterr().out)
    words = split_command(only(unit, "Service", "ExecStart"))
    beside = Path(sys.executable).parent / "pepsi"
    expected = str(beside) if beside.is_file() else shutil.which("pepsi")
    assert words == [expected, "-c", str(DEFAULT_CONFIG), "dispatch", "serve"]
    assert Path(words[0]).is_absolute()
    assert only(unit, "Service", "EnvironmentFile") == "-/etc/default/pepsi"
    assert only(unit, "Service", "User") == "pepsi"


def test_the_global_c_is_the_default_config_and_relative_paths_become_absolute(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["-c", "conf/pepsi.conf", "systemd", "unit", "--exec", "bin/pepsi"]) == 0
    words = split_command(only(parse_unit(capsys.readouterr().out), "Service", "ExecStart"))
    assert words[:3] == [str(tmp_path / "bin/pepsi"), "-c", str(tmp_path / "conf/pepsi.conf")]


def test_empty_user_and_environment_file_drop_their_lines(tmp_path: Path) -> None:
    unit = parse_unit(render_unit(tmp_path / "pepsi", "/etc/p.conf", "", ""))
    assert "User" not in unit["Service"]
    assert "EnvironmentFile" not in unit["Service"]


@pytest.mark.parametrize(
    "path",
    [
        "/etc/pepsi/my pepsi.conf",
        '/etc/pe"p\\si.conf',
        "/etc/100%/pepsi.conf",
        "/etc/$HOME/${X}/pepsi.conf",
        "/etc/a;b/'c'/pepsi.conf",
        "/etc/été/pepsi.conf",
    ],
)
def test_config_paths_are_quoted_for_systemd(path: str, tmp_path: Path) -> None:
    unit = parse_unit(render_unit(tmp_path / "pepsi", path))
    assert split_command(only(unit, "Service", "ExecStart"))[1:3] == ["-c", path]


def test_quote_word() -> None:
    assert quote_word("/etc/pepsi/pepsi.conf") == "/etc/pepsi/pepsi.conf"
    assert quote_word("/a b") == '"/a b"'
    assert quote_word("/a%b") == "/a%%b"
    assert quote_word('/a"$b\\') == '"/a\\"$$b\\\\"'


def test_special_program_and_environment_paths(tmp_path: Path) -> None:
    unit = parse_unit(
        render_unit("/opt/my pepsi/100%/pepsi", "/etc/p.conf", "/etc/my env/100%", "0")
    )
    # systemd takes the program's path as it stands: quoted, specifiers doubled, no $$.
    assert only(unit, "Service", "ExecStart").startswith('"/opt/my pepsi/100%%/pepsi" -c ')
    # EnvironmentFile= is not unquoted: spaces stay as they are.
    assert only(unit, "Service", "EnvironmentFile") == "/etc/my env/100%%"
    assert only(unit, "Service", "User") == "0"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--user", "a b"], "--user: not a user name or id"),
        (["--user", "root\n"], "--user: not a user name or id"),
        (["--exec", '/opt/"pepsi"'], "--exec: systemd cannot run a path with quotes"),
        (["--exec", ""], "--exec: an empty path"),
        (["--config-file", "/etc/a\nb"], "a control character cannot go into a unit file"),
        (["--environment-file", "/etc/env "], "a path cannot end in whitespace"),
        (["--environment-file=-"], "--environment-file: an empty path"),
    ],
)
def test_a_bad_value_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["systemd", "unit", "--exec", "/usr/bin/pepsi", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert message in captured.err


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["systemd", "unit", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--config-file", "--environment-file", "--user", "--exec", "RestartSteps"):
        assert option in out


def _verify(unit_text: str, directory: Path) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    path = directory / UNIT_NAME
    path.write_text(unit_text, encoding="utf-8")
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _ignored(line: str, key: str) -> bool:
    # "Unknown key 'K'" (252); other versions say "Unknown key name 'K'".
    return f"Unknown key '{key}'" in line or f"Unknown key name '{key}'" in line


def _unexpected(stderr: str) -> list[str]:
    """systemd-analyze's complaints, but the warnings of a systemd older than 254."""
    return [
        line
        for line in stderr.splitlines()
        if line.strip() and not any(_ignored(line, key) for key in NEWER_KEYS)
    ]


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    # A program and a config in paths that need quoting and escaping.
    folder = tmp_path / "my pepsi 100%"
    folder.mkdir()
    program = folder / "pepsi"
    program.write_text("#!/bin/sh\n", encoding="utf-8")
    program.chmod(0o755)
    unit = render_unit(program, tmp_path / 'conf $dir %i/pe"psi.conf', "-/etc/de fault/pepsi")
    result = _verify(unit, tmp_path)
    assert result.returncode == 0, result.stderr
    assert _unexpected(result.stderr) == []


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_catches_a_missing_program(tmp_path: Path) -> None:
    # The check above is not vacuous: verify does look at ExecStart.
    result = _verify(render_unit(tmp_path / "absent" / "pepsi", "/etc/p.conf"), tmp_path)
    assert result.returncode != 0
    assert "is not executable" in result.stderr


def test_the_ingress_unit_runs_the_server_and_may_bind_port_25(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["systemd", "unit", "ingress", "--exec", "/usr/bin/pepsi"]) == 0
    unit = parse_unit(capsys.readouterr().out)
    service = unit["Service"]
    assert split_command(only(unit, "Service", "ExecStart")) == [
        "/usr/bin/pepsi", "-c", str(DEFAULT_CONFIG), "ingress", "--serve",
    ]  # fmt: skip
    assert service["Restart"] == ["always"]
    assert unit["Unit"]["StartLimitIntervalSec"] == ["0"]
    assert service["AmbientCapabilities"] == ["CAP_NET_BIND_SERVICE"]
    assert service["KillSignal"] == ["SIGTERM"]
    assert int(service["LimitNOFILE"][0]) > 1024  # one file per session
    assert shipped_unit("ingress") != shipped_unit()


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_ingress_unit(tmp_path: Path) -> None:
    program = tmp_path / "pepsi"
    program.write_text("#!/bin/sh\n", encoding="utf-8")
    program.chmod(0o755)
    result = _verify(render_unit(program, tmp_path / "pepsi.conf", unit="ingress"), tmp_path)
    assert result.returncode == 0, result.stderr
    assert _unexpected(result.stderr) == []
