"""The docs name what the code has, and the code has what the docs name; read without a server.

- every command of the CLI is in README's "CLI at a glance" table, every option of every command
  (one of its spellings) and the environment variable it reads are in README.md or docs/, and every
  command line the docs show (`warmboot CMD ... --opt`, in backticks or a code block) names a
  command and options it has;
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


def test_every_option_is_documented():
    text = "\n".join(doc.read_text() for doc in DOCS)
    missing = []
    for path, command in commands().items():
        for param in command.params:
            if not isinstance(param, click.Option) or "--help" in param.opts:
                continue
            if not any(re.search(re.escape(o) + r"(?![\w-])", text) for o in spellings(param)):
                missing.append(f"{' '.join(path)} {'/'.join(spellings(param))}")
    assert not missing, f"options that README.md and docs/ never name: {missing}"


def test_every_environment_variable_an_option_reads_is_documented():
    text = "\n".join(doc.read_text() for doc in DOCS)
    missing = set()
    for path, command in commands().items():
        for param in command.params:
            named = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
            missing.update(f"{' '.join(path)} {name}" for name in named if not re.search(rf"\b{name}\b", text))
    assert not missing, f"environment variables README.md and docs/ never name: {sorted(missing)}"


def command_lines() -> list[tuple[str, str]]:
    """(file, text) of every span or code line the docs show that starts with a command."""
    names = "|".join(sorted(map(re.escape, main.commands), key=len, reverse=True))
    found = []
    for doc in DOCS:
        text = doc.read_text()
        # in backticks, a command named alone too (`actor create --cpu`); in a code block, `warmboot ...` lines
        spans = [(span, True) for span in re.findall(r"`([^`\n]+)`", text)]
        spans += [(line, False) for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S) for line in block.splitlines()]
        for span, alone in spans:
            line = re.sub(r"^(?:[A-Z_]+=\S* )*(warmboot |python -m warmboot |\.venv/bin/warmboot )?", "", span.strip())
            named = line != span.strip() and "warmboot " in span
            if (alone or named) and re.match(rf"(?:{names})(?:\s|$)", line):
                found.append((doc.name, line))
    return found


def test_every_command_line_in_the_docs_names_options_its_command_has():
    lines = command_lines()
    assert len(lines) > 100, "the docs' command lines were not found: has their markup changed?"
    wrong = []
    for doc, line in lines:
        words = line.split("#")[0].split()
        command, used = resolve(words)
        if isinstance(command, click.Group):
            # `worker drain|remove`, `actor pause|suspend ...`: each alternative must be a command
            if used < len(words):
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
