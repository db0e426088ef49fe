"""The documentation site: reference pages generated from the code, built and served by MkDocs.

    mkdocs.yml ──hooks──> this file's on_page_markdown: a page's marker becomes its table
        <!-- areal:config -->   every config key: type, default, docstring (areal/config.py)
        <!-- areal:cli -->      every command's --help, from the parser its main() builds
    docs/reference/api.md   `::: areal...` blocks: mkdocstrings reads the docstrings

Nothing generated is kept in git: a key added to areal/config.py or a flag added to a
command is in the next build. `python -m areal.docs` builds the site in strict mode (a
broken link, a page missing from the nav or a warning fails) and serves it on
http://127.0.0.1:8000; `python -m areal.docs build` only builds (into site/).
Needs the docs extra: `pip install -e ".[docs]"`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import types
import typing
from collections.abc import Iterator
from typing import Any

CONFIG_MARKER = "<!-- areal:config -->"
CLI_MARKER = "<!-- areal:cli -->"

COMMANDS: tuple[tuple[str, str], ...] = (
    ("areal.train", "Start a run: every role of a config, on this machine, SLURM or Ray."),
    ("areal.eval", "pass@k of a model on a dataset, through the same engine and graders."),
    ("areal.report", "A run's figures (PNG) and summary; several runs side by side."),
    ("areal.planner", "Predict throughput and staleness of servers x max_staleness before a run."),
    ("areal.export", "Merge a LoRA run's adapter into its base: one HF directory."),
    ("areal.worker", "One role of a prepared experiment directory (the launcher runs these)."),
    ("areal.rollout.server", "The embedded inference server (SGLang's HTTP API) by itself."),
    ("areal.workflow.agent_process", "Internal: an agent process the controller starts."),
    ("areal.docs", "Build this documentation site (strict) and serve it locally."),
)
"""Every argparse command: `python -m MODULE`, and what it is for."""


# ---- configuration keys ----------------------------------------------------------------------


def type_name(tp: Any) -> str:
    """A config field's type as a user writes it in YAML: int, float, str, bool, list[str],
    mapping, and `| null` where null is allowed."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " | ".join(type_name(a) for a in inner) + " | null"
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def config_keys() -> list[dict[str, str]]:
    """Every leaf key of the config tree, in declaration order, with its section (the first
    part of the key; "" for top-level keys), type, default (as YAML) and docstring."""
    from areal import config, config_loader

    types_of = {key: f.type for key, f, _ in config_loader.walk(config.ExperimentConfig)}
    return [
        {
            "key": key,
            "section": key.split(".")[0] if "." in key else "",
            "type": type_name(types_of[key]),
            "default": default,
            "doc": doc,
        }
        for key, default, doc in config.describe_keys()
    ]


def _cell(text: str) -> str:
    """Text that stays in one markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _sections() -> Iterator[tuple[str, str]]:
    """(top-level section name, its class docstring) in declaration order."""
    from areal import config

    for f in dataclasses.fields(config.ExperimentConfig):
        if dataclasses.is_dataclass(f.type):
            yield f.name, " ".join((f.type.__doc__ or "").split())


def config_reference() -> str:
    """Markdown: one table per section, a row per key (anchor `#KEY`, type, default, doc)."""
    keys = config_keys()
    parts = []
    for section, doc in [("", "Keys at the top of the file.")] + list(_sections()):
        rows = [k for k in keys if k["section"] == section]
        if not rows:
            continue
        parts.append(f"## `{section}`\n" if section else "## Top level\n")
        parts.append(f"{_cell(doc)}\n" if doc else "")
        parts.append("| key | type | default | description |\n|---|---|---|---|")
        for k in rows:
            parts.append(
                f'| <a id="{k["key"]}"></a>`{k["key"]}` | `{_cell(k["type"])}` '
                f"| `{_cell(k['default'])}` | {_cell(k['doc'])} |"
            )
        parts.append("")
    return "\n".join(parts)


# ---- commands ----------------------------------------------------------------------------


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def command_parser(module: str) -> argparse.ArgumentParser:
    """The parser `python -m MODULE` builds: its main() is called, and stopped where it
    parses its arguments, so the parser is the command's own, never a copy."""
    mod = importlib.import_module(module)
    if not hasattr(mod, "main"):  # a package run as python -m: areal.planner, areal.report
        mod = importlib.import_module(f"{module}.__main__")

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        mod.main([])
    except _Captured as c:
        parser = c.parser
    else:
        raise AssertionError(f"{module}.main() returned without parsing its arguments")
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    parser.prog = f"python -m {module}"
    return parser


def command_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string (`--config`, `-h`) and positional name (`RUN_DIR`) of a parser."""
    names = []
    for action in parser._actions:
        if action.option_strings:
            names += action.option_strings
        else:
            names.append(action.metavar or action.dest)
    return names


def command_help(parser: argparse.ArgumentParser) -> str:
    """`--help` as a terminal of 80 columns prints it (the width of the page's code blocks)."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        return parser.format_help()
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def cli_reference() -> str:
    """Markdown: a section per command with what it is for and its --help."""
    parts = []
    for module, what in COMMANDS:
        parts.append(f"## `python -m {module}`\n\n{what}\n")
        parts.append(f"```text\n{command_help(command_parser(module)).rstrip()}\n```\n")
    return "\n".join(parts)


# ---- the MkDocs hook (mkdocs.yml: hooks) ---------------------------------------------------


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace each page's markers by the tables generated from the code."""
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return markdown


# ---- python -m areal.docs ------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.docs",
        description="Build the documentation site (strict) and serve it locally.",
    )
    parser.add_argument(
        "action",
        nargs="?",
        choices=("serve", "build"),
        default="serve",
        help="serve (default): build, then serve with live reload; build: write site/ only",
    )
    parser.add_argument("--addr", default="127.0.0.1:8000", help="where serve listens")
    parser.add_argument("--site-dir", default="site", help="where build writes the site")
    args = parser.parse_args(argv)
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")  # Material's banner about MkDocs 2
    try:
        from mkdocs.commands import build, serve
        from mkdocs.config import load_config
    except ImportError:
        print('error: MkDocs is not installed: pip install -e ".[docs]"', file=sys.stderr)
        return 2
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config_file = os.path.join(root, "mkdocs.yml")
    if args.action == "build":
        cfg = load_config(config_file, strict=True, site_dir=os.path.abspath(args.site_dir))
        build.build(cfg)
        print(f"areal.docs: site built in {cfg.site_dir}")
        return 0
    serve.serve(config_file, strict=True, dev_addr=args.addr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
