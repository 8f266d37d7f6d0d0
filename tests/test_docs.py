"""The docs name what the code has, and the code has what the docs name; read without a server.

- every command of the CLI is in README's "CLI at a glance" table; every option of every command (one
  of its spellings) is named for that command, in a command line of it or in its row of the table (the
  few every command shares, SHARED, once for all), and the environment variable it reads is in README.md
  or docs/; every command line the docs show (`warmboot CMD ... --opt`, in backticks, wrapped over two
  lines too, or a code block's line, continued with a backslash too) names a command and options it has;
- every endpoint the services register (`EndpointSpec` in services/*/service.py) is in
  docs/CONTRACT.md or docs/contract.md with its subject's form, and where a row names the request
  or reply type, it is the endpoint's; every subject the docs name is an endpoint;
- every event type is in docs/events.md;
- every file and Python name the docs point a reader to exists.

The metrics have their own check (tests/test_alerts.py).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import click
import msgspec
import pytest

import events.schema as schema
from services.endpoints import EndpointSpec
from warmboot.cli import main

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
CONTRACTS = [ROOT / "docs" / "CONTRACT.md", ROOT / "docs" / "contract.md"]
SERVICES = ("registry", "snapshotter", "scheduler")


def commands(group: click.Group = main, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    """Every command that runs (not a group), by its path under `warmboot`."""
    found = {}
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found.update(commands(command, path + (name,)))
        else:
            found[path + (name,)] = command
    return found


def spellings(option: click.Option) -> list[str]:
    return option.opts + option.secondary_opts


def resolve(words: list[str]) -> tuple[click.Command, int]:
    """The command `words` start with, and how many of them name it."""
    command, used = main, 0
    for word in words:
        if isinstance(command, click.Group) and word in command.commands:
            command, used = command.commands[word], used + 1
        else:
            break
    return command, used


def glance_table() -> str:
    text = README.read_text()
    start = text.index("## CLI at a glance")
    return text[start: text.index("\n## ", start + 1)]


def glance_commands() -> set[tuple[str, ...]]:
    """The command paths the table's first column names: `warmboot actor pause\\|suspend ACTOR` is two."""
    named = set()
    for line in glance_table().splitlines():
        if not line.startswith("| `warmboot"):
            continue
        first = line.split(" | ")[0]
        for shown in re.findall(r"`warmboot ([^`]*)`", first):
            words = []
            for token in shown.split():
                if not re.fullmatch(r"[a-z][a-z-]*(\\\|[a-z][a-z-]*)*", token):
                    break
                words.append(token.split("\\|"))
            paths = [()]
            for alternatives in words:
                paths = [p + (a,) for p in paths for a in alternatives]
            named.update(paths)
    return named


def test_every_command_is_in_the_readme_table():
    missing = [" ".join(path) for path in commands() if path not in glance_commands()]
    assert not missing, f"README's CLI at a glance names no row for: {missing}"


# The options every command that has them takes alike, documented once for all (README.md, the paragraph
# after "CLI at a glance": the NATS URL, the nkey seed, the prefix), not again for each command.
SHARED = ("--nats", "--nkey-seed", "--connect-timeout", "--prefix")
# Spellings of one option: `--json` is `-o json` (`cli_common.json_option`, `cmd_views.output_option`), so a
# command documented with either is documented with both.
ALIASES = ({"-o", "--output", "--json"},)
_OPTION = re.compile(r"(?<![\w./=-])(--?[a-zA-Z][\w-]*)")


def command_paths(words: list[str]) -> tuple[list[tuple[str, ...]], int]:
    """The commands a line's first words name (`actor pause|suspend`: both, `\\|` in a table too), and how
    many words name them."""
    paths: list[tuple[tuple[str, ...], click.Command]] = [((), main)]
    used = 0
    for word in words:
        named = [(path + (name,), command.commands[name]) for path, command in paths
                 if isinstance(command, click.Group) for name in re.split(r"\\?\|", word) if name in command.commands]
        if not named:
            break
        paths, used = named, used + 1
    return [path for path, command in paths if not isinstance(command, click.Group)], used


def documented_options() -> dict[tuple[str, ...], set[str]]:
    """Per command, the options the docs name for it: those of a command line of it (`command_lines`: a
    span or a code line that starts with the command), and those its row of README's CLI at a glance names."""
    named: dict[tuple[str, ...], set[str]] = {}
    for _, line, _ in command_lines():
        words = line.split("#")[0].split()
        paths, used = command_paths(words)
        for path in paths:
            named.setdefault(path, set()).update(_OPTION.findall(" ".join(words[used:])))
    for row in glance_table().splitlines():
        if row.startswith("| `warmboot"):
            for shown in re.findall(r"`warmboot ([^`]*)`", row.split(" | ")[0]):
                for path in command_paths(shown.split())[0]:
                    named.setdefault(path, set()).update(_OPTION.findall(row))
    return named


def undocumented(every: dict[tuple[str, ...], click.Command], named: dict[tuple[str, ...], set[str]]) -> list[str]:
    """The options of `every` command that `named` (`documented_options`) does not name for that command,
    by none of their spellings nor their aliases' (SHARED apart)."""
    missing = []
    for path, command in every.items():
        for param in command.params:
            if not isinstance(param, click.Option) or "--help" in param.opts:
                continue
            spelt = set(spellings(param))
            spelt |= {alias for group in ALIASES if spelt & group for alias in group}
            if not spelt & (named.get(path, set()) | set(SHARED)):
                missing.append(f"{' '.join(path)} {'/'.join(spellings(param))}")
    return missing


def test_every_option_is_documented_for_its_command():
    """An option is documented for its command: in a command line of it (`workers --limit N`) or in its row
    of README's table, not only somewhere (an option spelt as another command's passed, undocumented)."""
    missing = undocumented(commands(), documented_options())
    assert not missing, f"options that README.md and docs/ never name for their command: {missing}"
    # the shared ones, once, where README says what every command takes
    said = glance_table()
    assert all(re.search(re.escape(o) + r"(?![\w-])", said) for o in SHARED), SHARED
    assert all(any(o in spellings(p) for c in commands().values() for p in c.params) for o in SHARED)


def test_an_option_documented_for_another_command_alone_is_undocumented():
    """`--drain` is whatif's, documented for it: the same option on `workers` is not documented by that."""
    named = documented_options()
    assert "--drain" in named[("whatif",)] and "--drain" not in named[("workers",)]
    workers = click.Command("workers", params=[click.Option(["--drain"]), click.Option(["--prefix"]),
                                               click.Option(["--json"], is_flag=True)])
    assert undocumented({("workers",): workers}, named) == ["workers --drain"]


def test_every_environment_variable_an_option_reads_is_documented():
    text = "\n".join(doc.read_text() for doc in DOCS)
    missing = set()
    for path, command in commands().items():
        for param in command.params:
            named = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
            missing.update(f"{' '.join(path)} {name}" for name in named if not re.search(rf"\b{name}\b", text))
    assert not missing, f"environment variables README.md and docs/ never name: {sorted(missing)}"


def command_lines() -> list[tuple[str, str, bool]]:
    """(file, text, whether a span wrapped over two lines) of every span or code line the docs show that
    starts with a command."""
    names = "|".join(sorted(map(re.escape, main.commands), key=len, reverse=True))
    found = []
    for doc in DOCS:
        text = doc.read_text()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
        # in backticks, a command named alone too (`actor create --cpu`), a span wrapped over two lines joined;
        # in a code block, `warmboot ...` lines
        prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
        spans = [(span, True) for span in re.findall(r"`([^`\n]+(?:\n[^`\n]+)?)`", prose)]
        # a code block's line continued with a backslash is one command line
        spans += [(line, False) for block in blocks for line in re.sub(r"\\\n", " ", block).splitlines()]
        for span, alone in spans:
            line = re.sub(r"^(?:[A-Z_]+=\S* )*(warmboot |python -m warmboot |\.venv/bin/warmboot )?", "",
                          " ".join(span.strip().split()))
            named = line != " ".join(span.strip().split()) and "warmboot " in span
            if (alone or named) and re.match(rf"(?:{names})(?:\s|$)", line):
                found.append((doc.name, line, "\n" in span))
    return found


def test_every_command_line_in_the_docs_names_options_its_command_has():
    lines = command_lines()
    assert len(lines) > 100, "the docs' command lines were not found: has their markup changed?"
    wrong = []
    for doc, line, wrapped in lines:
        words = line.split("#")[0].split()
        command, used = resolve(words)
        if isinstance(command, click.Group):
            # `worker drain|remove`, `actor pause|suspend ...`: each alternative must be a command (a span
            # wrapped over two lines that starts with a group's name may be prose: `actor is PAUSED on ...`)
            if used < len(words) and not wrapped:
                for name in re.split(r"\\?\|", words[used]):
                    if re.fullmatch(r"[a-z][a-z-]*", name) and name not in command.commands:
                        wrong.append(f"{doc}: `{line}`: no command {name!r}")
            continue
        have = {o for p in command.params for o in p.opts + p.secondary_opts} | {"-h", "--help"}
        rest = " ".join(words[used:])
        for option in re.findall(r"(?<![\w./=-])(--?[a-zA-Z][\w-]*)", rest):
            if option not in have:
                wrong.append(f"{doc}: `{line}`: {' '.join(words[:used])} has no {option}")
    assert not wrong, "\n".join(wrong)


# --- endpoints --------------------------------------------------------------------


def endpoints() -> dict[str, dict]:
    """`<service>.<verb>` -> {per_entity, request, reply}, read from each service's EndpointSpec list."""
    found = {}
    for service in SERVICES:
        source = ROOT / "services" / service / "service.py"
        module = importlib.import_module(f"services.{service}.service")
        tree = ast.parse(source.read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for call in (n for n in ast.walk(cls) if isinstance(n, ast.Call)):
                if getattr(call.func, "id", None) != "EndpointSpec":
                    continue
                verb, request = call.args[0].value, getattr(schema, call.args[1].id)
                handler = call.args[2]
                while isinstance(handler, ast.Call):  # a wrapper: `self._one_of_few(self.register)`
                    handler = handler.args[0]
                per_entity = all(not (k.arg == "per_entity" and k.value.value is False) for k in call.keywords)
                spec = EndpointSpec(verb, request, getattr(getattr(module, cls.name), handler.attr), per_entity)
                found[f"{service}.{verb}"] = {"per_entity": per_entity, **spec.metadata()}
    assert len(found) >= 20, f"the services' EndpointSpec lists were not found: {sorted(found)}"
    return found


_SUBJECT = re.compile(r"(?:warmboot|<prefix>|PREFIX|p)\.(registry|snapshotter|scheduler)\.([a-z][a-z-]*)(\.<[a-z_]+>)?")


def contract_rows() -> list[str]:
    return [line for doc in CONTRACTS for line in doc.read_text().splitlines()
            if line.startswith("| `") and _SUBJECT.match(line[3:])]


def test_every_endpoint_is_in_the_contract_docs_with_its_subject_form():
    rows = contract_rows()
    for name, endpoint in endpoints().items():
        mine = [row for row in rows if (m := _SUBJECT.match(row[3:])) and f"{m[1]}.{m[2]}" == name]
        assert mine, f"{name}: no row of docs/CONTRACT.md or docs/contract.md gives its subject"
        for row in mine:
            shown = _SUBJECT.match(row[3:])
            assert bool(shown[3]) == endpoint["per_entity"], (
                f"{name}: the docs write its subject {shown[0]}, the service "
                + ("ends it with an id" if endpoint["per_entity"] else "ends it at the verb"))


def test_the_types_a_contract_row_names_are_the_endpoints():
    """A row's request and reply, where it names a type: `| subject | Request | Reply |` (CONTRACT) or
    `| subject: Request {...} -> Reply {...} |` (contract.md, Additions); a `{...}` shape names fields of it."""
    found = endpoints()
    wrong = []
    for row in contract_rows():
        m = _SUBJECT.match(row[3:])
        endpoint = found.get(f"{m[1]}.{m[2]}")
        if endpoint is None:
            continue
        arrow = re.search(r"`(\w+) \{[^`]*`\s*->\s*`(\w+)[ `]", row)
        if arrow:
            pairs = [("request", arrow[1]), ("reply", arrow[2])]
        else:
            cells = [c.strip() for c in row.strip("|").split(" | ")]
            pairs = [(role, re.match(r"`(\w+)`", cell)) for role, cell in (("request", cells[1]), ("reply", cells[2]))]
            pairs = [(role, named[1]) for role, named in pairs if named]
            for role, cell in (("request", cells[1]), ("reply", cells[2])):
                shape = re.match(r"`\{(.*)\}`", cell)
                if shape:
                    top = re.sub(r"\{[^{}]*\}|\[[^\[\]]*\]", "", shape[1])
                    fields = {f.strip().split(":")[0].strip() for f in top.split(",") if f.strip()}
                    have = {f.name for f in msgspec.structs.fields(getattr(schema, endpoint[role]))}
                    if fields - have:
                        wrong.append(f"{m[0]}: {role} {endpoint[role]} has no field {sorted(fields - have)}")
        for role, named in pairs:
            if named != endpoint.get(role):
                wrong.append(f"{m[0]}: the docs say the {role} is {named}, the service {endpoint.get(role)}")
    assert not wrong, "\n".join(wrong)


def test_every_subject_the_docs_name_is_an_endpoint():
    found = endpoints()
    wrong = []
    for doc in DOCS:
        for m in re.finditer(r"(?<![\w.$])(?:warmboot|<prefix>)\.(registry|snapshotter|scheduler)\.([a-z][a-z-]*)",
                             doc.read_text()):
            if f"{m[1]}.{m[2]}" not in found:
                wrong.append(f"{doc.name}: {m[0]}")
    assert not wrong, f"subjects no service registers: {sorted(set(wrong))}"


# --- events -----------------------------------------------------------------------


@pytest.mark.parametrize("event", sorted(schema.EVENT_TYPES))
def test_every_event_type_is_in_the_event_stream_doc(event):
    assert f"`{event}`" in (ROOT / "docs" / "events.md").read_text(), f"docs/events.md never names {event}"


# --- what the docs point a reader to ------------------------------------------------------


# a file (with its extension) or a directory (with its slash): `events/s` is a rate
_PATH = re.compile(r"(?<![\w/.-])((?:tests|bench|events|services|warmboot|deploy|examples|docs)/[\w./-]*?(?:\.[a-z]+\b|/))")
_DOTTED = re.compile(r"`((?:events|services|warmboot|cmd_[a-z]+)(?:\.[A-Za-z_]\w*)+)`")  # `cmd_views.x`: warmboot's
HISTORY = {"services/common.py", "events/natspy.py"}  # files a change named in docs/scaling.md split since


def dotted_exists(dotted: str) -> bool:
    """A module, or a name in one: `warmboot.cmd_views.with_runtime_ids`, `events.runtime_id.Runtimes.resolve`."""
    parts = (f"warmboot.{dotted}" if dotted.startswith("cmd_") else dotted).split(".")
    for i in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def test_every_file_and_python_name_the_docs_point_to_exists():
    wrong = []
    for doc in DOCS:
        text = doc.read_text()
        for path in set(_PATH.findall(text)) - HISTORY:
            if not (ROOT / path).exists() and not (ROOT / "docs" / path).exists():
                wrong.append(f"{doc.name}: {path}")
        for dotted in set(_DOTTED.findall(text)):
            if not _SUBJECT.match(dotted) and not dotted_exists(dotted):
                wrong.append(f"{doc.name}: {dotted}")
    assert not wrong, f"the docs name files or Python names that are not there: {sorted(wrong)}"
