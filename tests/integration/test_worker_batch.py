"""W-8: a metadata-only stage handles a buffer of ids in about two round trips.

Round trips are counted as transactions the worker's backend commits
(pg_stat_database.xact_commit; every autocommit statement is one), read from
another database once the worker has exited and its statistics are flushed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import conninfo

from pepsi.protocol import encode_ids, is_ready, parse_status, takes_rows
from tests.commits import committed
from tests.scenarios.conftest import REPO

CONF = """
[stage-meta]
HANDLER = tests.stages:count
QUEUE_LIMIT = 8
NEXT = body
[stage-body]
HANDLER = tests.stages:reverse_body_len
QUEUE_LIMIT = 8
NEXT = hdr
[stage-hdr]
HANDLER = tests.stages:header_only
QUEUE_LIMIT = 8
"""


def run_worker(
    dsn: str, conf: Path, stage: str, ids: list[int], rows: dict[int, bytes] | None = None
) -> list[bytes]:
    """Run a worker over `ids` (with `rows`, as a claim hands them); its status lines."""
    return worker_lines(dsn, conf, stage, ids, rows)[1]


def worker_lines(
    dsn: str, conf: Path, stage: str, ids: list[int], rows: dict[int, bytes] | None = None
) -> tuple[bytes, list[bytes]]:
    """A worker's ready line and its status lines for `ids`."""
    with subprocess.Popen(
        [sys.executable, "-m", "pepsi", "-c", str(conf), "worker"],
        env={**os.environ, "PEPSI_STAGE": stage, "PEPSI_DSN": dsn},
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as proc:
        assert proc.stdin is not None
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        assert is_ready(ready)
        proc.stdin.write(encode_ids(ids, rows if takes_rows(ready) else None))  # one buffer
        proc.stdin.flush()
        lines = [proc.stdout.readline() for _ in ids]
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    return ready, lines


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    return path


def startup_commits(admin: psycopg.Connection[Any], dsn: str, conf: Path, dbname: str) -> int:
    """The commits a worker's start and stop cost (counted out of each batch's)."""
    before = committed(admin, dbname)
    run_worker(dsn, conf, "meta", [])
    return committed(admin, dbname) - before


@pytest.fixture
def rows(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [
            int(str(r[0]))
            for r in conn.execute(
                "WITH b AS (INSERT INTO pepsi.workqueue_body (body)"
                " SELECT 'hello' FROM generate_series(1, 8) RETURNING body_id)"
                " INSERT INTO pepsi.workqueue (stage, status, body_id)"
                " SELECT 'meta', 'running', body_id FROM b ORDER BY body_id"
                " RETURNING workqueue_id"
            ).fetchall()
        ]


@pytest.mark.usefixtures("no_autovacuum")
def test_bodyless_stage_batches_round_trips(
    dsn: str, admin_dsn: str, rows: list[int], conf: Path
) -> None:
    dbname = str(conninfo.conninfo_to_dict(dsn)["dbname"])
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        startup = startup_commits(admin, dsn, conf, dbname)

        before = committed(admin, dbname)
        lines = run_worker(dsn, conf, "meta", rows)
        batched = committed(admin, dbname) - before - startup

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE pepsi.workqueue SET status = 'running'")
        before = committed(admin, dbname)
        body_lines = run_worker(dsn, conf, "body", rows)
        body_batch = committed(admin, dbname) - before - startup

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE pepsi.workqueue SET status = 'running', state = '{}'")
            conn.execute("UPDATE pepsi.workqueue_body SET header = 'Subject: hi'")
        before = committed(admin, dbname)
        run_worker(dsn, conf, "hdr", rows)
        header_stage = committed(admin, dbname) - before - startup

    assert [parse_status(line).status for line in lines] == [0] * 8
    assert all(parse_status(line).report for line in lines)  # timing reports ride along
    assert batched == 2  # one SELECT for the 8 rows, one statement for their outcomes
    assert [parse_status(line).status for line in body_lines] == [0] * 8
    # a stage that reads bodies loads its batch the same way, the bodies with the rows
    # (issue 32), but writes each outcome before the next message runs: 1 + 8, plus
    # one PREPARE once psycopg starts preparing the write (its 5th execution)
    assert 9 <= body_batch <= 10
    assert 9 <= header_stage <= 10  # the header came with the row: no extra SELECT
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pepsi.workqueue").fetchone() == (0,)


def test_only_a_metadata_stage_asks_for_its_rows(dsn: str, conf: Path) -> None:
    assert worker_lines(dsn, conf, "meta", [])[0] == b"ready rows\n"
    assert worker_lines(dsn, conf, "body", [])[0] == b"ready\n"  # it loads its content anyway
    assert worker_lines(dsn, conf, "hdr", [])[0] == b"ready\n"


@pytest.mark.usefixtures("no_autovacuum")
def test_rows_handed_with_their_ids_are_run_without_a_load(
    dsn: str, admin_dsn: str, rows: list[int], conf: Path
) -> None:
    dbname = str(conninfo.conninfo_to_dict(dsn)["dbname"])
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            "SELECT pepsi.workqueue_claimed_rows(%s, '{meta}')", (rows,)
        ).fetchone()
        assert found is not None
        handed = {wid: str(row).encode() for wid, row in zip(rows, found[0], strict=True)}
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        startup = startup_commits(admin, dsn, conf, dbname)
        before = committed(admin, dbname)
        lines = run_worker(dsn, conf, "meta", rows, handed)
        handed_batch = committed(admin, dbname) - before - startup
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "UPDATE pepsi.workqueue SET stage = 'meta', status = 'running', state = '{}'"
            )
        before = committed(admin, dbname)
        # one row without its row (one the claim did not return): loaded, alone
        mixed = run_worker(dsn, conf, "meta", rows, {**handed, rows[3]: b"not json"})
        mixed_batch = committed(admin, dbname) - before - startup
    assert [parse_status(line).status for line in lines + mixed] == [0] * 16
    assert handed_batch == 1  # the outcomes only
    assert mixed_batch == 2  # the one row's load, the outcomes
    with psycopg.connect(dsn, autocommit=True) as conn:
        moved = conn.execute(
            "SELECT stage, status::text, state FROM pepsi.workqueue ORDER BY workqueue_id"
        ).fetchall()
    assert moved == [("body", "pending", {"passes": 1, "stages": ["meta"]})] * 8


def test_a_stage_added_in_the_database_overlay_runs(
    dsn: str, rows: list[int], tmp_path: Path
) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF.replace("[stage-meta]", "[stage-other]"))  # no [stage-meta] in the file
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pepsi.config_override (section, key, value)"
            " VALUES ('stage-meta', 'HANDLER', 'tests.stages:count'),"
            " ('stage-meta', 'NEXT', 'body')"
        )
        lines = run_worker(dsn, conf, "meta", rows)
        assert [parse_status(line).status for line in lines] == [0] * 8
        moved = conn.execute(
            "SELECT DISTINCT stage, status::text, state FROM pepsi.workqueue"
        ).fetchall()
    assert moved == [("body", "pending", {"passes": 1, "stages": ["meta"]})]


def test_a_stage_found_nowhere_is_refused_in_one_line(dsn: str, tmp_path: Path) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)
    done = subprocess.run(
        [sys.executable, "-m", "pepsi", "-c", str(conf), "worker"],
        env={**os.environ, "PEPSI_STAGE": "nowhere", "PEPSI_DSN": dsn},
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert done.returncode == 78
    assert done.stdout == ""  # never ready
    assert done.stderr.strip().endswith("no [stage-nowhere] in the configuration")
    assert "Traceback" not in done.stderr
