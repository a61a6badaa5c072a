"""Every flag of `carpool` explains itself in --help: the whole argparse tree, every subcommand down."""

import argparse

from carpool.cli import build_parser


def walk(parser: argparse.ArgumentParser, path: str):
    """(command path, parser, action) for every action of `parser` and of every subcommand below it."""
    for action in parser._actions:
        yield path, parser, action
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from walk(child, f"{path} {name}")


def undocumented(parser: argparse.ArgumentParser) -> set[str]:
    missing = set()
    for path, _, action in walk(parser, "carpool"):
        if isinstance(action, argparse._SubParsersAction):
            documented = {choice.dest for choice in action._choices_actions if choice.help}
            missing |= {f"{path} {name}" for name in action.choices if name not in documented}
        elif not action.help or action.help == argparse.SUPPRESS:
            missing.add(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_option_argument_and_subcommand_has_help():
    assert undocumented(build_parser()) == set()


def test_every_help_page_renders():
    """A stray % in a help string breaks argparse's formatting only when --help is asked for."""
    for path, parser, _ in walk(build_parser(), "carpool"):
        assert parser.format_help(), path


def test_the_check_sees_nested_subcommands_and_missing_help():
    parser = build_parser()
    paths = {path for path, _, _ in walk(parser, "carpool")}
    assert {"carpool serve", "carpool keys create", "carpool bench batch"} <= paths
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands.choices["serve"].add_argument("--undocumented")
    assert "carpool serve --undocumented" in undocumented(parser)
