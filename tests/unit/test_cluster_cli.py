"""`pepsi cluster`: a user's mistakes are one line and an exit status, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from pepsi.cli import main


def test_a_missing_cluster_is_named_with_the_command_that_makes_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cluster", "--dir", str(tmp_path), "status"]) == 1
    err = capsys.readouterr().err
    assert f"no cluster in {tmp_path}" in err
    assert "pepsi cluster create" in err
    assert "Traceback" not in err


def test_destroy_asks_for_yes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "cluster.json").write_text('{"base_port": 40000}')
    assert main(["cluster", "--dir", str(tmp_path), "destroy"]) == 2
    assert "add --yes" in capsys.readouterr().err
    assert (tmp_path / "cluster.json").exists()


def test_a_base_port_out_of_range_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cluster", "--dir", str(tmp_path), "create", "--port", "80"]) == 2
    assert "--port 80" in capsys.readouterr().err
    assert not (tmp_path / "cluster.json").exists()


def test_an_unknown_node_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "kill", "n9"]) == 2
    assert "invalid choice: 'n9'" in capsys.readouterr().err
