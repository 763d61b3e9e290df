"""The `bistouri` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from . import __version__
from .errors import BistouriError
from .gckeep import kept

DESCRIPTION = """\
Bistouri is a reactive profiler: the agent stays dormant until Linux PSI
(pressure stall information) says a watched process's cgroup stalls on CPU,
memory or I/O, then samples that process's stacks with eBPF and ships them to
the symbolizer, which names, stores and shows them as flamegraphs.
"""

EPILOG = """\
examples:
  bistouri check                              can the agent run here? what to fix
  bistouri check --config trigger.yaml        validate a targets file too
  bistouri check-config trigger.yaml          validate a targets file only, start nothing
  bistouri agent --config /etc/bistouri/trigger.yaml --symbolizer-endpoint http://sym:8470
  bistouri symbolizer --listen-addr 0.0.0.0:8470 --debug-dir /usr/lib/debug
  bistouri record --duration 10 -- ./myprog --flag   profile a command now, write a flamegraph

Run `bistouri COMMAND --help` for the options of each command.
"""


def _setup_logging(level: str) -> None:
    # Under systemd the journal adds timestamps: do not print them twice.
    fmt = "%(levelname)s %(name)s: %(message)s"
    if not os.environ.get("JOURNAL_STREAM"):
        fmt = "%(asctime)s " + fmt
    from .logtext import OneLineFormatter

    handler = logging.StreamHandler()
    # Comms, cgroups and paths in messages come from watched processes: one line each, escaped.
    handler.setFormatter(OneLineFormatter(fmt))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


def cmd_check(args: argparse.Namespace) -> int:
    from .agent import preflight

    results = preflight.run_checks(config=args.config, config_only=args.config_only)
    if args.json:
        import json

        print(
            json.dumps(
                [{"status": r.status, "name": r.name, "detail": r.detail, "fix": r.fix} for r in results]
            )
        )
    else:
        print(preflight.format_results(results))
    status = preflight.exit_status(results)
    if status and not args.config_only:
        print("\nThe agent cannot run until the FAIL lines above are fixed.", file=sys.stderr)
    return status


def cmd_agent(args: argparse.Namespace) -> int:
    from .agent.daemon import run_agent
    from .agent.settings import settings_from_args

    settings = settings_from_args(args, os.environ)
    return run_agent(settings)


def _add_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="check that this host can run the agent (and validate a config file)",
        description="Report, one line each, what the agent needs: kernel, BTF, libbpf, PSI, cgroup2, "
        "capabilities, perf events, kernel symbols, and that the BPF object loads. "
        "Exit status 1 only when something prevents the agent from running.",
    )
    p.add_argument("--config", metavar="FILE", help="also validate this targets file")
    p.add_argument("--config-only", action="store_true", help="only validate --config, skip the host checks")
    p.add_argument("--json", action="store_true", help="print the results as JSON (for automation)")
    p.set_defaults(func=cmd_check)

    # What config management runs before restarting the agent (Ansible's validate=, CI).
    p = sub.add_parser(
        "check-config",
        help="validate a targets file, start nothing (same as: check --config FILE --config-only)",
        description="Validate a targets file and report every problem with its path. Exit status 1 if any.",
    )
    p.add_argument("config", metavar="FILE", help="the targets file")
    p.add_argument("--json", action="store_true", help="print the results as JSON (for automation)")
    p.set_defaults(func=cmd_check, config_only=True)


def _add_agent(sub: argparse._SubParsersAction) -> None:
    from .agent.settings import add_agent_arguments

    p = sub.add_parser(
        "agent",
        help="run the agent: watch PSI, capture stacks under pressure, ship sessions",
        description="Run the bistouri agent in the foreground (systemd runs it as bistouri-agent.service). "
        "Every option also reads an environment variable, shown in brackets.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_agent_arguments(p)
    p.set_defaults(func=cmd_agent)


def _add_symbolizer(sub: argparse._SubParsersAction) -> None:
    try:
        from .symbolizer.service import cli as symbolizer_cli
    except ImportError as e:
        missing = str(e)

        def unavailable(_args: argparse.Namespace) -> int:
            print(
                f"error: the symbolizer is not installed ({missing}). "
                "Install the bistouri-symbolizer package, or `pip install bistouri[symbolizer]`.",
                file=sys.stderr,
            )
            return 2

        for name in ("symbolizer", "symbolize"):
            sub.add_parser(name, help=f"(unavailable: {missing})").set_defaults(func=unavailable)
        return
    symbolizer_cli.register(sub)


def _add_record(sub: argparse._SubParsersAction) -> None:
    from .record.command import add_record_arguments, cmd_record

    p = sub.add_parser(
        "record",
        formatter_class=_HelpFormatter,
        help="profile a process, cgroup or command now and write flamegraph.html, pprof, folded, speedscope",
        description="Profile now, on this host, without a symbolizer service: on-CPU and off-CPU stacks of "
        "a target, symbolized in-process with the binaries on this host.",
    )
    add_record_arguments(p)
    p.set_defaults(func=cmd_record)


# Every command and the function that adds its parser; `main` builds only the one run, so that
# `bistouri record` does not import the agent's and the symbolizer's modules before it samples.
_COMMANDS = {
    "check": _add_check,
    "check-config": _add_check,
    "agent": _add_agent,
    "symbolizer": _add_symbolizer,
    "symbolize": _add_symbolizer,
    "record": _add_record,
}


def _command_of(argv: Sequence[str]) -> str | None:
    """The command named in `argv` (the first word that is not an option or its value)."""
    it = iter(argv)
    for word in it:
        if word == "--log-level":
            next(it, None)
        elif not word.startswith("-"):
            return word
    return None


def _columns() -> int:
    """shutil.get_terminal_size().columns, without importing shutil."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):  # no stdout, or not a terminal
            columns = 0
    return columns if columns > 0 else 80


class _Sized(argparse.HelpFormatter):
    """argparse sizes a formatter at every add_argument, through shutil, which imports bz2 and lzma
    (their C libraries too): ~2 ms of `record`'s start-up, before its first sample."""

    def __init__(
        self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None
    ):
        super().__init__(
            prog, indent_increment, max_help_position, _columns() - 2 if width is None else width
        )


class _HelpFormatter(_Sized):
    pass


class _RawDescriptionHelpFormatter(_Sized, argparse.RawDescriptionHelpFormatter):
    pass


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of the command `only` when it is one of them."""
    parser = argparse.ArgumentParser(
        prog="bistouri",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=_RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"bistouri {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("BISTOURI_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="log verbosity [BISTOURI_LOG_LEVEL] (default: info)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    adders = [_COMMANDS[only]] if only in _COMMANDS else list(dict.fromkeys(_COMMANDS.values()))
    for add in adders:
        try:
            add(sub)
        except ImportError:  # only `record` is optional (its BPF parts)
            if add is not _add_record:
                raise
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    with kept():  # the command's modules are imported here, for the process's lifetime
        parser = build_parser(_command_of(argv))
        args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    _setup_logging(getattr(args, "log_level", None) or "info")
    try:
        return int(args.func(args) or 0)
    except BistouriError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
