"""argparse pieces shared by the package's command lines (``python -m megamoe.bench``, ``megamoe.bench.model``,
``megamoe.train``): argument types that refuse an impossible value with argparse's one-line error, before anything
is built, the help formatter, and the compile options the two model command lines share."""

from __future__ import annotations

import argparse


def _int_from(minimum: int):
    """argparse type: an integer of at least ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value
    return parse


positive_int = _int_from(1)
non_negative_int = _int_from(0)


def positive_float(text: str) -> float:
    """argparse type: a float greater than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, not {text}")
    return value


def step_range(text: str) -> tuple[int, int]:
    """argparse type: ``"A-B"`` (or ``"A"``: one step) → (A, B), training steps counted from 1, ``1 <= A <= B``."""
    first, _, last = text.partition("-")
    try:
        bounds = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--profile takes steps as A-B (or A), counted from 1; got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"--profile {text}: the steps must be 1 <= A <= B")
    return bounds


def csv_of(allowed):
    """argparse type: a comma-separated list, each item in ``allowed`` (or converted by it, when it is callable)."""
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"an empty list: {text!r}")
        if callable(allowed):
            return [allowed(item) for item in items]
        bad = [item for item in items if item not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not in {sorted(allowed)}")
        return items
    return parse


def add_compile_mode(parser: argparse.ArgumentParser, modes) -> None:
    """``--compile-mode`` (one of ``modes``: each decoder layer compiled, or the whole model in one graph) and its
    shorthand ``--compile`` (``layers``), either or neither: ``args.compile_mode`` None runs the model eagerly."""
    compiling = parser.add_mutually_exclusive_group()
    compiling.add_argument("--compile-mode", choices=modes,
                           help="torch.compile each decoder layer (layers) or the whole model, fullgraph (model); "
                                "without it (or --compile) the model runs eagerly")
    compiling.add_argument("--compile", dest="compile_mode", action="store_const", const="layers",
                           help="the same as --compile-mode layers")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and each argument's default once: appended where its help does not already say
    it, left out for flags and for arguments without one."""

    def _get_help_string(self, action):
        if "default" in (action.help or "") or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return action.help
        return super()._get_help_string(action)
