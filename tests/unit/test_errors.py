"""The one classifier of database errors (DESIGN.md §4), over every SQLSTATE psycopg knows."""

from __future__ import annotations

import inspect
import subprocess
import sys

import psycopg
import psycopg.errors
import pytest
from psycopg_pool import PoolTimeout

from pepsi import errors
from pepsi.errors import (
    DatabaseBusy,
    DatabaseLost,
    DatabaseReadOnly,
    DatabaseUnavailable,
    classify,
    database_exit_code,
    is_reconnect,
    one_line,
)

# Every SQLSTATE with a class of its own (the map also holds each class by its name).
SQLSTATES = sorted(
    code for code, cls in psycopg.errors._sqlcodes.items() if getattr(cls, "sqlstate", None) == code
)


def expected(code: str) -> type[DatabaseUnavailable] | None:
    """The table of DESIGN.md §4, written out independently of errors.py."""
    if code == "53300":
        return DatabaseBusy
    if code == "25006":
        return DatabaseReadOnly
    if code.startswith("08") or code in {"57P01", "57P02", "57P03", "57P04", "57P05", "25P03"}:
        return DatabaseLost
    return None


def test_the_table_covers_every_sqlstate_class() -> None:
    classes = {code[:2] for code in SQLSTATES}
    assert {"08", "22", "23", "25", "40", "42", "53", "57", "XX"} <= classes
    assert len(SQLSTATES) > 200


@pytest.mark.parametrize("code", SQLSTATES)
def test_classify_every_sqlstate(code: str) -> None:
    exc = psycopg.errors.lookup(code)("server says no")
    assert exc.sqlstate == code
    error = classify(exc)
    want = expected(code)
    if want is None:
        assert error is None
        assert database_exit_code(exc) is None
        assert not is_reconnect(exc)
    else:
        assert type(error) is want
        assert error is not None
        assert error.sqlstate == code
        assert "server says no" in str(error)
        assert database_exit_code(exc) == error.exit_code
        assert is_reconnect(exc)


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        # A refusal at connect time has no SQLSTATE: libpq gives only the text.
        (psycopg.OperationalError("FATAL:  sorry, too many clients already"), DatabaseBusy),
        (
            psycopg.OperationalError(
                "FATAL:  remaining connection slots are reserved for roles with SUPERUSER"
            ),
            DatabaseBusy,
        ),
        (PoolTimeout("couldn't get a connection after 10.00 sec"), DatabaseBusy),
        (psycopg.OperationalError("server closed the connection unexpectedly"), DatabaseLost),
        (psycopg.OperationalError("consuming input failed: SSL SYSCALL error: EOF"), DatabaseLost),
        (psycopg.InterfaceError("the connection is closed"), DatabaseLost),
        (psycopg.errors.ConnectionTimeout("connection timeout expired"), DatabaseLost),
        (
            psycopg.errors.ObjectNotInPrerequisiteState("recovery is in progress"),
            DatabaseReadOnly,
        ),
        (
            psycopg.errors.SerializationFailure(
                "canceling statement due to conflict with recovery"
            ),
            DatabaseReadOnly,
        ),
        (
            psycopg.errors.FeatureNotSupported("cannot execute LISTEN during recovery"),
            DatabaseReadOnly,
        ),
    ],
)
def test_classify_by_text_where_there_is_no_sqlstate(
    exc: Exception, kind: type[DatabaseUnavailable]
) -> None:
    assert type(classify(exc)) is kind


@pytest.mark.parametrize(
    "exc",
    [
        psycopg.ProgrammingError("the query has 1 placeholder but 2 parameters were passed"),
        psycopg.DataError("invalid input"),
        psycopg.errors.NumericValueOutOfRange("bigint out of range"),
        psycopg.errors.QueryCanceled("canceling statement due to statement timeout"),
        ValueError("not a database error"),
        OSError("neither"),
        KeyboardInterrupt(),
    ],
)
def test_host_failures_are_not_classified(exc: BaseException) -> None:
    assert classify(exc) is None
    assert not is_reconnect(exc)
    assert database_exit_code(exc) is None


def test_exit_codes() -> None:
    assert DatabaseUnavailable("x").exit_code == 1
    assert DatabaseLost("x").exit_code == 74
    assert DatabaseReadOnly("x").exit_code == 74
    assert DatabaseBusy("x").exit_code == 75
    assert issubclass(DatabaseReadOnly, DatabaseLost)
    assert issubclass(DatabaseLost, DatabaseUnavailable)
    assert issubclass(DatabaseBusy, DatabaseUnavailable)


def test_a_domain_error_is_its_own_class() -> None:
    refused = DatabaseUnavailable("cannot connect")
    assert classify(refused) is refused
    assert is_reconnect(refused)
    assert database_exit_code(refused) == 74  # a worker that cannot connect answers "lost"
    assert database_exit_code(DatabaseBusy("full")) == 75


def test_one_line() -> None:
    assert one_line(ValueError("a\n  b\n\nc ")) == "a; b; c"
    assert one_line(ValueError()) == "ValueError"


def test_every_error_class_is_exported() -> None:
    defined = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, BaseException)
    }
    assert defined <= set(errors.__all__)
    assert {"classify", "is_reconnect", "database_exit_code"} <= set(errors.__all__)
    for name in errors.__all__:
        assert hasattr(errors, name)


def test_moved_errors_are_the_same_classes() -> None:
    from pepsi.admin import database, queue  # noqa: PLC0415

    assert queue.NoSuchMessage is errors.NoSuchMessage
    assert queue.RepairRefused is errors.RepairRefused
    assert queue.UnknownStage is errors.UnknownStage
    assert queue.QueueError is errors.QueueError
    assert database.NotEmbedded is errors.NotEmbedded


def test_errors_is_importable_without_the_driver() -> None:
    code = (
        "import sys; sys.modules['psycopg'] = None; sys.modules['psycopg_pool'] = None\n"
        "from pepsi.errors import classify, is_reconnect\n"
        "assert classify(ValueError()) is None and not is_reconnect(OSError())\n"
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "ok\n"
