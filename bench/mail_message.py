"""A text message as mail is sent, for `bench/mail.py --message FILE`.

    .venv/bin/python bench/mail_message.py [--prose FILE] [--size 28000] > message.eml

smtp-source's own filler is a few lines repeated, which compresses to almost
nothing; real mail is prose. This writes a `multipart/alternative` message,
a plain text part and an HTML part of the same kind (a newsletter, a report),
made of the paragraphs of --prose (by default the GPL's text, which every
Debian system has), about --size bytes in all: zlib shrinks it about 3 times,
as it does English text.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Iterator
from itertools import cycle
from pathlib import Path

PROSE = Path("/usr/share/common-licenses/GPL-3")
HEADER = [
    "From: Load <load@sender.example>",
    "To: Bob <bob@example.com>",
    "Subject: Your weekly project update",
    "Date: Sat, 05 Dec 2026 12:00:00 +0000",
    "Message-ID: <weekly-1@sender.example>",
    "MIME-Version: 1.0",
    'Content-Type: multipart/alternative; boundary="part"',
]
HTML_ROW = '<tr><td style="padding:8px 16px;font-size:14px;line-height:20px">'


def paragraphs(prose: str) -> Iterator[str]:
    """The text's paragraphs, each on one line, over and over."""
    found = [" ".join(p.split()) for p in prose.split("\n\n") if len(p) > 200]
    if not found:
        raise SystemExit("bench/mail_message.py: no paragraph of 200 characters in --prose")
    return cycle(found)


def message(prose: str, size: int) -> str:
    source = paragraphs(prose)
    text: list[str] = []
    while sum(len(line) + 2 for line in text) < size // 3:
        text += [*textwrap.wrap(next(source), 72), ""]
    html = ["<html><body>", '<table width="100%" cellpadding="0" border="0">']
    while sum(len(line) + 2 for line in html) < size - size // 3:
        html += [HTML_ROW, *textwrap.wrap(f"<p>{next(source)}</p>", 72), "</td></tr>"]
    html.append("</table></body></html>")
    parts = [
        *HEADER, "", "--part", "Content-Type: text/plain; charset=us-ascii", "", *text,
        "--part", "Content-Type: text/html; charset=us-ascii", "", *html, "--part--",
    ]  # fmt: skip
    return "\n".join(parts) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prose", type=Path, default=PROSE, help=f"default {PROSE}")
    parser.add_argument("--size", type=int, default=28000, help="bytes, about")
    args = parser.parse_args()
    try:
        prose = args.prose.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        parser.error(f"--prose: {exc.strerror}: {args.prose}")
    sys.stdout.write(message(prose, args.size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
