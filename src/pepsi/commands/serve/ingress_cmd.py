"""`pepsi ingress` (alias `pepsi-ingress`, and `pepsi publish`): the producer, and the mail server.

Reads one message from stdin, one per FILE, or a stream of JSON lines, and
publishes with the same guarantees as the API: an id is printed only once
its batch is committed (the confirm). `--count`/`--rate` make it a load
generator. Any refusal exits non-zero with one line saying why.

`--serve` runs the SMTP/LMTP server of `[pepsi-ingress]` instead
(`pepsi.mail.ingress.server`, docs/mail.md) until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pepsi.commands import Context, summary
from pepsi.durations import parse_duration
from pepsi.errors import EX_OK
from pepsi.publishing import InvalidMessage, OutgoingMessage, Retry
from pepsi.publishing.retry import DEFAULT_DEADLINE

if TYPE_CHECKING:
    from pepsi.publishing.sync_client import Publisher

JSON_RENAMED: dict[str, str] = {
    "user": "origin_user",
    "peer": "origin_peer",
    "headers": "properties",
}
JSON_FIELDS = {
    "stage", "body", "body_base64", "header", "header_base64", "sender", "recipients", "user",
    "peer", "message_id", "dedup", "header_from", "subject", "content_type", "correlation_id",
    "headers", "expires", "priority",
}  # fmt: skip


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "ingress",
        aliases=["publish"],
        help=summary("ingress"),
        description="Publish messages and print each new id once committed. Without FILE, "
        "stdin is one message (or, with --format jsonl, one JSON object per line). Exit "
        "65 invalid message, 67 no such stage, 75 stage full, 74 confirm lost, 1 other errors. "
        "With --serve: run the SMTP/LMTP server configured in [pepsi-ingress] (LISTEN, "
        "LMTP_LISTEN, STAGE, DOMAINS, RELAY_NETWORKS ...; see docs/mail.md); each message is "
        "answered 250 only once its row is committed. It stops on SIGTERM or SIGINT (exit 0); "
        "exit 1 for a configuration it cannot serve or a database it cannot reach, 78 for a "
        "schema of another version.",
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="run the SMTP/LMTP server of [pepsi-ingress] instead of publishing (docs/mail.md)",
    )
    parser.add_argument(
        "files", nargs="*", metavar="FILE", help="one message per file ('-': stdin)"
    )
    parser.add_argument("--stage", help="the first stage (jsonl lines may name their own)")
    parser.add_argument(
        "--format",
        choices=("raw", "jsonl"),
        default="raw",
        help="raw: the input is the body; jsonl: one message per line",
    )
    parser.add_argument("--sender", help="envelope sender ('' for the null sender)")
    parser.add_argument(
        "--recipient",
        action="append",
        default=[],
        dest="recipients",
        help="envelope recipient (repeatable)",
    )
    parser.add_argument("--user", help="authenticated submitter (origin user)")
    parser.add_argument("--peer", help="IP address of the connecting peer")
    parser.add_argument("--message-id", help="the message's id (travels with it)")
    parser.add_argument(
        "--dedup",
        action="store_true",
        help="idempotent: a message id seen within DEDUP_WINDOW is not published again",
    )
    parser.add_argument("--subject", help="extracted Subject:")
    parser.add_argument("--header-from", help="extracted From:")
    parser.add_argument("--content-type")
    parser.add_argument("--correlation-id")
    parser.add_argument(
        "--property",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="producer property (repeatable; stored as JSON headers)",
    )
    parser.add_argument("--expires", metavar="DURATION", help="per-message expiry, e.g. 10m")
    parser.add_argument(
        "--priority",
        type=int,
        default=0,
        metavar="N",
        help="0 to 255, higher first (default 0: none)",
    )
    parser.add_argument("--count", type=int, default=1, help="copies of each message (default 1)")
    parser.add_argument("--rate", type=float, help="at most this many messages per second")
    parser.add_argument(
        "--batch", type=int, default=100, help="messages per transaction (default 100)"
    )
    parser.add_argument(
        "--retry",
        action="store_true",
        help="try a failed publish again (a failover, a restart, a read-only node) until "
        "--retry-deadline; messages get a message id and dedup, so none is stored twice",
    )
    parser.add_argument(
        "--retry-deadline",
        metavar="DURATION",
        help=f"how long --retry keeps trying (default {DEFAULT_DEADLINE:g}s; implies --retry)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="print a summary on stderr instead of the ids"
    )
    # What the producer's options are when none is given: --serve takes none of them.
    unset = {k: v for k, v in vars(parser.parse_args([])).items() if k != "serve"}
    parser.set_defaults(handler=run_ingress, producer_defaults=unset)


class _Usage(InvalidMessage):
    exit_code = 2


def _common(args: argparse.Namespace) -> dict[str, Any]:
    properties = {}
    for item in args.property:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise _Usage(f"--property wants NAME=VALUE, got {item!r}")
        properties[name] = value
    expires = None
    if args.expires is not None:
        try:
            expires = parse_duration(args.expires)
        except ValueError as exc:
            raise _Usage(f"--expires: {exc}") from None
    return {
        "sender": args.sender, "recipients": tuple(args.recipients), "origin_user": args.user,
        "origin_peer": args.peer, "message_id": args.message_id, "dedup": args.dedup,
        "subject": args.subject, "header_from": args.header_from,
        "content_type": args.content_type, "correlation_id": args.correlation_id,
        "properties": properties, "expires": expires, "priority": args.priority,
    }  # fmt: skip


def from_json_line(
    line: str, number: int, stage: str | None, base: dict[str, Any]
) -> OutgoingMessage:
    """One JSON object → a message; command-line options fill what the line omits."""
    try:
        item = json.loads(line)
    except ValueError as exc:
        raise InvalidMessage(f"line {number}: not JSON: {exc}") from None
    if not isinstance(item, dict):
        raise InvalidMessage(f"line {number}: expected a JSON object")
    unknown = sorted(set(item) - JSON_FIELDS)
    if unknown:
        raise InvalidMessage(f"line {number}: unknown field(s) {', '.join(unknown)}")
    fields = {k: v for k, v in base.items() if v not in (None, (), {}, False)}
    for name in ("body", "header"):
        encoded = item.pop(f"{name}_base64", None)
        if encoded is not None:
            try:
                item[name] = base64.b64decode(encoded, validate=True)
            except ValueError:
                raise InvalidMessage(f"line {number}: {name}_base64 is not base64") from None
    if "recipients" in item:
        if not isinstance(item["recipients"], list):
            raise InvalidMessage(f"line {number}: recipients must be a list")
        item["recipients"] = tuple(item["recipients"])
    # A line keeps the field names it always had; OutgoingMessage's are the new ones.
    fields.update({JSON_RENAMED.get(key) or key: value for key, value in item.items()})
    target = fields.pop("stage", None) or stage
    if not target:
        raise InvalidMessage(f'line {number}: no stage (give --stage or a "stage" field)')
    body = fields.pop("body", None)
    return OutgoingMessage(target, body, **fields)


def messages(args: argparse.Namespace, stdin: IO[bytes]) -> Iterator[OutgoingMessage]:
    base = _common(args)
    if args.format == "jsonl":
        sources: Sequence[str] = args.files or ["-"]
        number = 0
        for source in sources:
            with contextlib.ExitStack() as stack:
                try:
                    handle = (
                        stdin if source == "-" else stack.enter_context(Path(source).open("rb"))
                    )
                except OSError as exc:
                    raise InvalidMessage(f"cannot read {source}: {exc.strerror}") from None
                for raw in handle:
                    number += 1
                    if raw.strip():
                        line = raw.decode("utf-8", "replace")
                        yield from_json_line(line, number, args.stage, base)
        return
    if not args.stage:
        raise _Usage("--stage is required (or use --format jsonl with a stage per line)")
    for source in args.files or ["-"]:
        try:
            body = stdin.read() if source == "-" else Path(source).read_bytes()
        except OSError as exc:
            raise InvalidMessage(f"cannot read {source}: {exc.strerror}") from None
        yield OutgoingMessage(args.stage, body, **base)


def run_ingress(args: argparse.Namespace, ctx: Context) -> int:
    if args.serve:
        return _serve(args, ctx)
    if args.count < 1 or args.batch < 1 or (args.rate is not None and args.rate <= 0):
        raise _Usage("--count and --batch must be at least 1, --rate above 0")
    stdin = sys.stdin.buffer
    if args.format == "raw" and not args.files and sys.stdin.isatty():
        raise _Usage("reading the message body from a terminal: pipe it in or give FILE")
    retry = _retry(args)
    from pepsi.publishing.sync_client import Publisher  # noqa: PLC0415  # psycopg_pool loads slowly

    publisher = Publisher.connect(ctx.config(), retry=retry or False)
    out = sys.stdout
    started = time.monotonic()
    sent = 0
    try:
        pending: list[OutgoingMessage] = []
        for msg in messages(args, stdin):
            for _ in range(args.count):
                pending.append(msg)
                if len(pending) >= args.batch:
                    sent += _flush(publisher, pending, out, args, started=started, sent=sent)
        if pending:
            sent += _flush(publisher, pending, out, args, started=started, sent=sent)
    finally:
        publisher.close()
    if args.quiet:
        elapsed = max(time.monotonic() - started, 1e-9)
        print(
            f"published {sent} messages in {elapsed:.2f}s ({sent / elapsed:.0f}/s)", file=sys.stderr
        )
    return EX_OK


def _retry(args: argparse.Namespace) -> Retry | None:
    if args.retry_deadline is None:
        return Retry() if args.retry else None
    try:
        return Retry(deadline=parse_duration(args.retry_deadline))
    except ValueError as exc:
        raise _Usage(f"--retry-deadline: {exc}") from None


def _flush(
    publisher: Publisher, pending: list[OutgoingMessage], out: IO[str], args: argparse.Namespace,
    *, started: float, sent: int,
) -> int:  # fmt: skip
    if args.rate:
        delay = started + (sent + len(pending)) / args.rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    ids = publisher.publish_many(pending)
    if not args.quiet:
        out.write("".join(f"{i}\n" for i in ids))
        out.flush()
    count = len(pending)
    pending.clear()
    return count


_OPTION_NAMES = {"files": "FILE", "recipients": "--recipient"}


def _serve(args: argparse.Namespace, ctx: Context) -> int:
    unset: dict[str, object] = args.producer_defaults
    given = sorted(k for k, default in unset.items() if getattr(args, k) != default)
    if given:
        names = ", ".join(_OPTION_NAMES.get(k) or "--" + k.replace("_", "-") for k in given)
        raise _Usage(f"--serve takes no publishing option (got {names})")
    from pepsi.mail.ingress.server import serve  # noqa: PLC0415  # aiosmtpd only for the server

    return serve(ctx.config(), verbose=ctx.verbose)
