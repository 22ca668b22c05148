"""`[pepsi-ingress]`'s mail server keys: defaults, values, and the checks across keys."""

from __future__ import annotations

from ipaddress import ip_network
from pathlib import Path

import pytest

from pepsi.config import load_config
from pepsi.config.model import MIB, IngressOptions
from pepsi.errors import ConfigError

STAGE = "[stage-inbox]\nHANDLER = m:f\n"


def load(tmp_path: Path, ingress: str, stages: str = STAGE) -> IngressOptions:
    path = tmp_path / "pepsi.conf"
    path.write_text(f"[pepsi-ingress]\n{ingress}\n{stages}")
    return load_config(path).ingress


def error(tmp_path: Path, ingress: str, stages: str = STAGE) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, ingress, stages)
    return str(info.value)


def test_the_server_is_off_by_default_with_the_issue_s_limits(tmp_path: Path) -> None:
    options = load(tmp_path, "")
    assert options.listen == ()
    assert options.lmtp_listen is None
    assert options.max_size == 25 * MIB
    assert options.max_recipients == 100
    assert options.relay_networks == ()  # nobody is trusted by default, loopback included
    assert options.domains == ()


def test_every_key_parses(tmp_path: Path) -> None:
    options = load(
        tmp_path,
        "LISTEN = 127.0.0.1:25, [::1]:2525\nLMTP_LISTEN = /run/pepsi/lmtp\nSTAGE = inbox\n"
        "DOMAINS = Example.COM, .lists.example.com example.org.\n"
        "RELAY_NETWORKS = 10.0.0.0/8 2001:db8::/32, 192.0.2.7\n"
        "MAX_SIZE = 10M\nMAX_RECIPIENTS = 500\nHOSTNAME = mx.example.com\n"
        "TLS_CERT = /etc/ssl/mx.pem\nTLS_KEY = /etc/ssl/mx.key\nTIMEOUT = 1m\n"
        "MAX_CONNECTIONS = 300\nCLIENT_CONNECTION_LIMIT = 0\n",
    )
    assert options.listen == (("127.0.0.1", 25), ("::1", 2525))
    assert options.lmtp_listen == Path("/run/pepsi/lmtp")
    assert options.stage == "inbox"
    assert options.domains == ("example.com", ".lists.example.com", "example.org")
    assert options.relay_networks == (
        ip_network("10.0.0.0/8"),
        ip_network("2001:db8::/32"),
        ip_network("192.0.2.7/32"),
    )
    assert (options.max_size, options.max_recipients) == (10 * MIB, 500)
    assert options.hostname == "mx.example.com"
    assert options.tls_cert == Path("/etc/ssl/mx.pem")
    assert options.timeout == 60.0
    assert (options.max_connections, options.client_connection_limit) == (300, 0)


def test_lmtp_on_tcp(tmp_path: Path) -> None:
    assert load(tmp_path, "LMTP_LISTEN = 127.0.0.1:24\nSTAGE = inbox").lmtp_listen == (
        "127.0.0.1",
        24,
    )


@pytest.mark.parametrize(
    ("ingress", "problem"),
    [
        ("LISTEN = 127.0.0.1:25", "LISTEN: the mail server needs STAGE"),
        ("LMTP_LISTEN = /tmp/x.sock", "LMTP_LISTEN: the mail server needs STAGE"),
        ("STAGE = outbox", "STAGE: no stage named 'outbox'"),
        ("TLS_CERT = /x.pem", "TLS_CERT: set TLS_KEY too"),
        ("TLS_KEY = /x.key", "TLS_KEY: set TLS_CERT too"),
        ("STAGE = inbox\nLISTEN = 127.0.0.1:25\nMAX_SIZE = 64M", "must leave 16K under"),
        ("STAGE = inbox\nLISTEN = 127.0.0.1:25\nMAX_MESSAGE_SIZE = 1M", "MAX_SIZE: 26214400 b"),
        ("LISTEN = localhost", "LISTEN: expected HOST:PORT"),
        ("LMTP_LISTEN = lmtp.sock", "LMTP_LISTEN: expected HOST:PORT, the absolute path"),
        ("DOMAINS = exa mple..com", "DOMAINS: not a domain name: 'mple..com'"),
        ("RELAY_NETWORKS = 10.0.0.0/33", "RELAY_NETWORKS: not an IP network"),
        ("HOSTNAME = mx_1 example", "HOSTNAME: not a host name"),
        ("MAX_RECIPIENTS = 0", "MAX_RECIPIENTS: must be between 1 and 100000"),
        ("LISTEN_ON = 127.0.0.1:25", "unknown key (did you mean LISTEN?)"),
    ],
)
def test_mistakes_are_one_line_naming_the_key(tmp_path: Path, ingress: str, problem: str) -> None:
    message = error(tmp_path, ingress)
    assert problem in message
    assert "[pepsi-ingress]" in message


def test_a_larger_max_size_needs_a_larger_max_message_size(tmp_path: Path) -> None:
    options = load(tmp_path, "MAX_SIZE = 100M\nMAX_MESSAGE_SIZE = 101M")
    assert options.max_size == 100 * MIB


@pytest.mark.parametrize(
    ("servers", "found"),
    [
        ("127.0.0.1:5353", (("127.0.0.1", 5353),)),
        ("192.0.2.1, [2001:db8::1]:53 ::1", (("192.0.2.1", 53), ("2001:db8::1", 53), ("::1", 53))),
    ],
)
def test_name_servers_are_addresses_with_an_optional_port(
    tmp_path: Path, servers: str, found: tuple[tuple[str, int], ...]
) -> None:
    path = tmp_path / "pepsi.conf"
    path.write_text(
        f"[stage-out]\nPROGRAM = pepsi-stage-relay-to-internet\nNAMESERVERS = {servers}\n"
    )
    assert load_config(path).stages["out"].builtin_options.nameservers == found


@pytest.mark.parametrize(
    ("servers", "problem"),
    [
        ("dns.google", "expected name servers by IP address"),
        ("off", "expected name servers by IP address"),
        ("127.0.0.1:0", "expected a port from 1 to 65535"),
    ],
)
def test_a_name_server_that_is_not_an_address_is_refused(
    tmp_path: Path, servers: str, problem: str
) -> None:
    path = tmp_path / "pepsi.conf"
    path.write_text(
        f"[stage-out]\nPROGRAM = pepsi-stage-relay-to-internet\nNAMESERVERS = {servers}\n"
    )
    with pytest.raises(ConfigError, match=f"NAMESERVERS: {problem}"):
        load_config(path)
