"""What every parser of the `appliance` command shares, applied once the tree is built: help that
states each option's default and valid values, and -v/--verbose taken anywhere on the line."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

# Options many commands take, described once (where a command gives no help of its own).
_COMMON_HELP = {
    "config": "the config file (default: $APPLIANCE_CONFIG, else ./models.toml, else the data directory's)",
    "json": "print one JSON document on stdout, and nothing else there",
}


def stated_default(action: argparse.Action) -> bool:
    """Whether an option has a default a user needs told (the test walks the same rule)."""
    return (bool(action.option_strings) and action.default is not argparse.SUPPRESS
            and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._VersionAction,
                                        argparse._HelpAction))
            # None: given no default; an empty list or mapping: a repeatable given none (0 is a default to state)
            and action.default is not None and action.default is not False
            and not (isinstance(action.default, (list, tuple, dict, str)) and not action.default))


def shown(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends `(default: X)` where an option's help does not say its default, and `(one of: ...)`
    where its valid values are hidden behind a metavar. Descriptions and epilogs keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.help is argparse.SUPPRESS:
            return action.help
        if action.choices is not None and action.metavar is not None and not all(str(c) in text for c in action.choices):
            text += f" (one of: {', '.join(map(str, action.choices))})"
        if stated_default(action) and "%(default)" not in text and "default" not in text:
            text += f" (default: {shown(action.default).replace('%', '%%')})"
        return text.strip() or None


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser and every subparser under it, each once (argparse keeps no public list of them)."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for child in action.choices.values():
                if id(child) not in seen:
                    seen.add(id(child))
                    yield from parsers(child)


def finish(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """-v/--verbose on every subparser, the help formatter on every parser, and the help of the
    common options. SUPPRESS keeps a subparser from writing False over a -v given before the subcommand."""
    for each in parsers(parser):
        each.formatter_class = HelpFormatter
        for action in each._actions:
            if action.help is None and action.option_strings and action.dest in _COMMON_HELP:
                action.help = _COMMON_HELP[action.dest]
        if each is not parser:
            each.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log debug detail")
    return parser
