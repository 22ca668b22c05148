#!/usr/bin/env python3
"""Set up a development environment and run Pepsi or its tests.

Needs only Python >= 3.11 with pip and venv. Creates `.venv/` in the checkout,
installs the project (editable, with the dev extras) when pyproject.toml
changed since the last install, then:

    python3 scripts/dev.py run    # the main job on the embedded database
    python3 scripts/dev.py test   # ruff, mypy and the whole test suite
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
STAMP = VENV / ".pepsi-install-stamp"
# Programs from the system the tests need -> the Debian package of each: etcd is
# Patroni's store in the three-node cluster tests (tests/cluster/), Chromium and its
# driver run the browser tests, swaks is a real SMTP client for the mail ingress
# tests, openssl makes their certificate, Postfix receives the mail the relay tests
# send (and its smtp-source drives bench/mail.py), dnsmasq serves their MX records.
SYSTEM_PACKAGES = {
    "etcd": "etcd-server",
    "chromium": "chromium",
    "chromedriver": "chromium-driver",
    "swaks": "swaks libnet-ssleay-perl",  # the Perl module is its TLS (a Recommends)
    "openssl": "openssl",
    "postfix": "postfix",
    "dnsmasq": "dnsmasq-base",
}
QUICK = "not cluster and not browser"  # the tests run four at a time
NO_TESTS_COLLECTED = 5  # pytest's status when a selection matches no test


def _run(*cmd: str | Path) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], cwd=ROOT)


def ensure_venv() -> None:
    if not (BIN / "python").exists():
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == digest:
        return
    pip = [BIN / "python", "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if _run(*pip, "--upgrade", "pip") != 0 or _run(*pip, "-e", f"{ROOT}[dev]") != 0:
        sys.exit("dev.py: installing the project failed (see pip's output above)")
    STAMP.write_text(digest)


def ensure_system_packages() -> None:
    """Install the missing system packages with apt-get (as root); else say what is missing."""
    missing = [
        package
        for program, packages in SYSTEM_PACKAGES.items()
        if shutil.which(program) is None
        for package in packages.split()
    ]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print(
            f"dev.py: {', '.join(missing)} missing: the tests that need them will be skipped "
            f"(install with: sudo apt-get install {' '.join(missing)})",
            file=sys.stderr,
        )
        return
    os.environ["DEBIAN_FRONTEND"] = "noninteractive"
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if _run(*install) != 0 and (_run("apt-get", "update", "-q") != 0 or _run(*install) != 0):
        sys.exit(f"dev.py: installing {', '.join(missing)} failed (see apt-get's output above)")


def cmd_run(args: list[str]) -> int:
    """The demo pipeline end to end on the embedded database (examples/orders)."""
    return _run(BIN / "python", ROOT / "examples" / "orders" / "run.py", *args)


def cmd_test(args: list[str]) -> int:
    checks: list[list[str | Path]] = [
        [BIN / "ruff", "check", "src", "tests", "scripts", "examples", "bench"],
        [BIN / "ruff", "format", "--check", "src", "tests", "scripts", "examples", "bench"],
        [BIN / "mypy"],
        # Four processes on any machine: the tests mostly wait on processes
        # and timers (about 40 % of one core each), so even two cores run four
        # at once; a module's tests stay together (loadscope), so a module-wide
        # fixture (the 1 M-row backlog) is built once. `-n 0` runs serially.
        [BIN / "pytest", "-n", "4", "--dist", "loadscope", "-m", QUICK, *args],
        # Then the three-node cluster tests and the browser tests, alone: they wait on
        # failovers and a headless Chromium and would slow the timing-sensitive rest.
        # `-m "not cluster and not browser"` skips them.
        [BIN / "pytest", "-n", "0", "-m", "cluster or browser", *args],
    ]
    ensure_system_packages()
    failed = [c for c in checks if _run(*c) not in (0, NO_TESTS_COLLECTED)]
    if failed:
        print(f"dev.py: {len(failed)} check(s) failed", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    commands = {"run": cmd_run, "test": cmd_test}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(f"usage: python3 scripts/dev.py {{{'|'.join(commands)}}} [ARGS...]", file=sys.stderr)
        return 2
    ensure_venv()
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
