"""The docs list the magics' flags as their parsers have them: docs/magics.md's flag tables
are what ``scripts/magic_flags.py`` writes from the parsers (a flag added, removed or
re-described without running it fails here), every magic has a table, and no line of the
docs or the README gives a magic a flag its parser lacks."""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from IPython.core.magic_arguments import argument, magic_arguments

ROOT = Path(__file__).resolve().parents[2]
MAGICS_MD = ROOT / "docs" / "magics.md"
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def _load_script():
    spec = importlib.util.spec_from_file_location("magic_flags", ROOT / "scripts" / "magic_flags.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


magic_flags = _load_script()
PARSERS = magic_flags.parsers()
FLAGS = {name: set() if parser is None else {o for a in parser._actions for o in a.option_strings}
         for name, parser in PARSERS.items()}

# "%rpc_init --port P [--host H]", "%%remote w1 --fetch", up to a closing backtick, a table
# cell's end or the end of a sentence
MAGIC_LINE = re.compile(r"(?<![\w%])%%?(?P<name>rpc_\w+|remote)\b(?P<rest>[^`\n]*)")
FLAG = re.compile(r"-{1,2}[A-Za-z][\w-]*")


def flags_named(rest: str) -> list[str]:
    """The flags written after a magic's name, up to the end of its line of arguments."""
    rest = re.sub(r"\"[^\"]*\"|'[^']*'", "", rest.split(" | ")[0])  # quoted values
    found = []
    for token in rest.split():
        word = token.strip("[](){}.,;:").split("=")[0]
        if FLAG.fullmatch(word):
            found.append(word)
        if token.endswith((".", ",", ";", ":")) and not token.endswith("..."):
            break  # the sentence goes on without the magic
    return found


def test_the_committed_flag_tables_are_the_parsers():
    text = MAGICS_MD.read_text(encoding="utf-8")
    generated = magic_flags.render(text)
    diff = "".join(difflib.unified_diff(text.splitlines(True), generated.splitlines(True),
                                        "docs/magics.md", "from the parsers"))
    assert generated == text, (
        "docs/magics.md's flag tables differ from the magics' parsers: run "
        f"`python scripts/magic_flags.py` and commit docs/magics.md\n{diff}")


def test_every_magic_has_a_flag_table():
    assert magic_flags.missing(MAGICS_MD.read_text(encoding="utf-8")) == []
    assert set(PARSERS) >= {"rpc_init", "remote", "rpc_shutdown", "rpc_probe", "rpc_doctor",
                            "rpc_channels", "rpc_devmap", "rpc_jobs", "rpc_restart", "rpc_workers"}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_table_has_every_argument_with_its_help_and_nothing_else(name):
    text = MAGICS_MD.read_text(encoding="utf-8")
    block = next(m["body"] for m in magic_flags.BLOCK.finditer(text) if m["name"] == name)
    rows = [line.split(" | ") for line in block.splitlines() if line.startswith("| `")]
    parser = PARSERS[name]
    actions = [] if parser is None else parser._actions
    assert [row[0].strip("| `") for row in rows] == [
        ", ".join(a.option_strings) or a.dest for a in actions]
    for row, action in zip(rows, actions, strict=True):
        assert row[3].rstrip(" |") == magic_flags._escape(action.help or ""), row


def test_a_flag_added_to_a_parser_changes_the_table():
    @magic_arguments()
    @argument("--workers", type=int, default=0, help="start this many worker processes")
    @argument("--brand-new", metavar="X", default="y", help="a flag | without docs")
    def rpc_init(line: str) -> None:
        """A stand-in."""

    text = MAGICS_MD.read_text(encoding="utf-8")
    changed = magic_flags.render(text, {**PARSERS, "rpc_init": rpc_init.parser})
    assert changed != text
    assert "| `--brand-new` | `X` | `y` | a flag \\| without docs |" in changed
    with pytest.raises(KeyError, match="no magic %rpc_gone"):
        magic_flags.render("<!-- flags:rpc_gone -->\n<!-- /flags:rpc_gone -->\n")
    assert magic_flags.missing(text, {**PARSERS, "rpc_new": None}) == ["rpc_new"]


def test_the_docs_give_no_magic_a_flag_its_parser_lacks():
    wrong = []
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in MAGIC_LINE.finditer(line):
                where = f"{page.relative_to(ROOT)}:{number}"
                if m["name"] not in PARSERS:
                    wrong.append(f"{where}: %{m['name']} is no magic of rpcnb")
                    continue
                wrong += [f"{where}: %{m['name']} has no flag {flag}"
                          for flag in flags_named(m["rest"]) if flag not in FLAGS[m["name"]]]
    assert not wrong, "\n".join(wrong)


def test_the_checker_reads_magic_lines_as_meant():
    assert flags_named(" --workers N [--name NAME] [--port P [--host H]]") == [
        "--workers", "--name", "--port", "--host"]
    assert flags_named(" ... --cluster-args \"a=['--oversubscribe']\" --engines 2") == [
        "--cluster-args", "--engines"]
    assert flags_named(" first, or declare the members with --topology w=2") == []
    assert flags_named(" --bg -o train | and the next cell --nope |") == ["--bg", "-o"]


def test_the_magics_page_names_only_real_flags():
    every = set().union(*FLAGS.values())
    spans = re.findall(r"`(-[^`\s]*)", MAGICS_MD.read_text(encoding="utf-8"))
    unknown = sorted({s.split("=")[0] for s in spans} - every)
    assert not unknown, f"docs/magics.md names flags no magic has: {unknown}"


def test_the_settings_page_gives_the_parsers_defaults():
    """docs/settings.md's "Flags, with their defaults": where the parser has a number as the
    default, the page says that number."""
    rows = re.findall(r"^\| `%%?(\w+) (--[\w-]+)[^`]*` \| ([^|]*) \|", (
        ROOT / "docs" / "settings.md").read_text(encoding="utf-8"), re.M)
    assert rows
    for name, flag, said in rows:
        action = next(a for a in PARSERS[name]._actions if flag in a.option_strings)
        if isinstance(action.default, (int, float)) and not isinstance(action.default, bool):
            number = re.match(r"\s*([\d.]+)", said)
            assert number and float(number.group(1)) == action.default, (name, flag, said)
