"""Reading pepsi.conf: INI text into raw sections, or one ConfigError naming the line.

configparser does the parsing (keys upper-cased, no interpolation); what is
here first refuses, each with its line, what it would misread or report badly:
text that is not UTF-8, header lines it takes for keys or odd section names,
duplicates, a key before any section.
"""

from __future__ import annotations

import configparser
from pathlib import Path

from pepsi.config.model import RawSections, RawValue
from pepsi.errors import ConfigError


def read_file(path: Path) -> RawSections:
    """Read an INI file into raw sections; ConfigError on anything unreadable."""
    name = str(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError("configuration file not found", file=name) from None
    except (PermissionError, IsADirectoryError) as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", file=name) from None
    try:
        text = data.decode("utf-8-sig")  # an editor's byte-order mark is not content
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        hint = " (it looks like UTF-16)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise ConfigError(f"line {lineno}: not UTF-8 text{hint}", file=name) from None
    return parse_ini(text, name)


def _strip_comment(line: str) -> str:
    """The line without its comment: `#` or `;` at the start or after whitespace."""
    for index, char in enumerate(line):
        if char in "#;" and (index == 0 or line[index - 1].isspace()):
            return line[:index].strip()
    return line.strip()


def _check_headers(text: str, name: str) -> None:
    """The header lines configparser misreads, as one error naming the line.

    configparser takes an unclosed `[stage-x` for a key (and reports a later
    line), and `[stage-x] y` or `[]` for sections of odd names.
    """
    for lineno, line in enumerate(text.splitlines(), start=1):
        content = _strip_comment(line)
        if not content.startswith("["):
            continue
        close = content.find("]")
        if close < 0:
            raise ConfigError(
                f"line {lineno}: section header {content!r} is not closed (expected [NAME])",
                file=name,
            )
        section, rest = content[1:close], content[close + 1 :].strip()
        if rest:
            raise ConfigError(
                f"line {lineno}: unexpected {rest!r} after the section header [{section}]",
                file=name,
            )
        if not section.strip():
            raise ConfigError(f"line {lineno}: empty section name {content!r}", file=name)


def parse_ini(text: str, name: str) -> RawSections:
    """Parse INI text with configparser (keys upper-cased, no interpolation)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # any editor's line endings
    _check_headers(text, name)
    parser = configparser.ConfigParser(
        interpolation=None,
        strict=True,
        inline_comment_prefixes=("#", ";"),
        default_section="\x00unused",  # so a [DEFAULT] section is just an unknown section
    )
    parser.optionxform = str.upper  # type: ignore[assignment,method-assign]
    try:
        parser.read_string(text, source=name)
    except configparser.DuplicateSectionError as exc:
        raise ConfigError(
            f"section appears twice (line {exc.lineno})", file=name, section=exc.section
        ) from None
    except configparser.DuplicateOptionError as exc:
        raise ConfigError(
            f"key appears twice (line {exc.lineno})",
            file=name,
            section=exc.section,
            key=exc.option,
        ) from None
    except configparser.MissingSectionHeaderError as exc:
        raise ConfigError(
            f"line {exc.lineno}: a key before any [section] header", file=name
        ) from None
    except configparser.ParsingError as exc:
        lineno, line = exc.errors[0]
        text = line.strip().strip("'\"").removesuffix("\\n").strip()
        raise ConfigError(
            f"line {lineno}: cannot parse {text!r} (expected KEY = VALUE)", file=name
        ) from None
    return {
        section: {key: RawValue(value, name) for key, value in parser.items(section)}
        for section in parser.sections()
    }
