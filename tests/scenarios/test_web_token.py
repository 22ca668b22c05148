"""The dispatcher's console without a PASSWORD (issue 33): its token stays out of the
dispatcher's log, `pepsi web url` prints its link, and the link lets one in."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path

import pytest

from tests.postfix import free_port
from tests.scenarios.conftest import Pipeline, wait_until


def test_the_dispatchers_console_is_opened_by_its_link_only(
    pipeline: Pipeline, tmp_path: Path
) -> None:
    port = free_port()
    pipeline.extra_env["XDG_DATA_HOME"] = str(tmp_path / "xdg")  # its token file goes here
    pipeline.configure(
        f"[stage-a]\nHANDLER = tests.stages:noop\n[pepsi-web]\nLISTEN = 127.0.0.1:{port}\n"
    )
    dispatcher = pipeline.start()
    wait_until(lambda: "web console at" in dispatcher.log, what="the console")
    printed = subprocess.run(
        [sys.executable, "-m", "pepsi", "-c", str(pipeline.conf), "web", "url"],
        env=pipeline.env(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    link = printed.stdout.split()[0]
    assert link.startswith(f"http://127.0.0.1:{port}/?token=")
    assert "(pepsi dispatch, pid" in printed.stdout
    token = link.split("token=", 1)[1]
    assert token not in dispatcher.log  # logged: the address, and where to find the link
    assert "`pepsi web url` prints its link" in dispatcher.log

    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/stages?token=not-it", timeout=10)
    assert refused.value.code == 401
    refused.value.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stages", timeout=10) as anonymous:
        assert anonymous.url.endswith("/login?next=/stages")  # to log in, even from here
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))
    with opener.open(link, timeout=10) as page:
        assert page.status == 200
        assert page.url == f"http://127.0.0.1:{port}/"  # the token out of the address
        assert "read-only" in page.read().decode()
    dispatcher.stop()
    assert list((tmp_path / "xdg" / "pepsi" / "web").iterdir()) == []
