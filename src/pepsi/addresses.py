"""What an address and a text field of a message may be: one rule for every writer. Pure.

The publisher checks what it stores, a stage's edits are checked the same
way before they are written, and the mail ingress refuses at RCPT what a
row could not carry. Imported by workers: standard library only.
"""

from __future__ import annotations

import re

MAX_TEXT = 4096  # characters in one envelope or header field
# local@domain: no spaces, control characters or angle brackets; one '@' that
# separates two non-empty parts (quoted local parts are not supported).
ADDRESS = re.compile(r"[^\s<>@\x00-\x1f\x7f]+@[^\s<>@\x00-\x1f\x7f]+")


def is_address(text: str) -> bool:
    """Whether `text` is an address a message can carry (local@domain)."""
    return len(text) <= MAX_TEXT and ADDRESS.fullmatch(text) is not None
