"""Examples for every command's --help (`attach`), one place for all of them.

Each is a whole command line, as a user would type it against `warmboot up` (its NATS on
the default URL, its prefix), perhaps with a shell comment after it;
`tests/test_cli_connect.py` checks that every leaf command has at least one and that each
parses (its options and arguments exist and take the values shown).
"""

from __future__ import annotations

import click

EXAMPLES: dict[str, list[str]] = {
    "serve": [
        "warmboot serve all --nats nats://127.0.0.1:4222",
        "warmboot serve all --nats nats://n1:4222,nats://n2:4222,nats://n3:4222 --replicas 3"
        "  # the log on 3 servers",
        "warmboot serve registry --worker-nodes worker-nodes.json",
    ],
    "up": [
        "warmboot up --demo",
        "warmboot up --port 0 --store second-store --metrics-port 0",
    ],
    "probe": [
        "warmboot probe --profile gvisor",
        "warmboot probe --profile microvm --attr firmware=2026.1",
    ],
    "schema": [
        "warmboot schema > warmboot.schema.json",
        "warmboot schema --check examples/golden-snapshot.json --as Snapshot --strict",
    ],
    "explain": [
        "warmboot explain a-0001",
        "warmboot explain a-0001 --selector zone=eu-1 -o wide --limit 0",
    ],
    "fragmentation": [
        "warmboot fragmentation",
        "warmboot fragmentation --class gvisor -o json",
    ],
    "whatif": [
        "warmboot whatif --class gvisor --drop-runtime gvisor-v1",
        "warmboot whatif --class gvisor --drain w-gv0-000 --drain w-gv0-002 --limit 0",
    ],
    "workers": [
        "warmboot workers",
        "warmboot workers --class microvm -o wide",
        "warmboot workers --class gvisor --class microvm -o json",
    ],
    "actor create": [
        "warmboot actor create a-1 --class gvisor --template tmpl-1 --cpu 500 --memory 1024",
        "warmboot actor create a-2 --class gvisor --template tmpl-1 --cpu 500 --memory 1024 --source-tag golden-1",
    ],
    "actor pause": [
        "warmboot actor pause a-1 --placement-seq 4739",
        "warmboot actor pause a-1 --placement a-1.json  # what `actor resume a-1 -o json > a-1.json` wrote",
    ],
    "actor suspend": [
        "warmboot actor suspend a-1 --uri s3://snapshots/a-1 --placement-seq 4739",
        "warmboot actor suspend a-1 --uri s3://snapshots/a-1 --fidelity VOLUMES",
    ],
    "actor resume": [
        "warmboot actor resume a-1",
        "warmboot actor resume a-1 --selector zone=eu-1 --request-id 7f3c9a -o json",
        "warmboot actor resume a-1 a-2 a-3",
    ],
    "actor tag": [
        "warmboot actor tag a-1 golden-1",
    ],
    "actor revert": [
        "warmboot actor revert a-1 --reason 'node-3 is gone'",
    ],
    "actor update-template": [
        "warmboot actor update-template a-1 tmpl-2",
    ],
    "actor stop": [
        "warmboot actor stop a-1",
    ],
    "actor show": [
        "warmboot actor show a-1",
        "warmboot actor show a-1 -o wide",
    ],
    "actor list": [
        "warmboot actor list",
        "warmboot actor list --state PAUSED --class gvisor",
        "warmboot actor list --state SUSPENDED --state PAUSED",
    ],
    "worker drain": [
        "warmboot worker drain w-1 --reason 'retiring the v1 generation'",
        "warmboot worker drain $(cat retiring.txt) --reason 'retiring the v1 generation'",
    ],
    "worker remove": [
        "warmboot worker remove w-1",
        "warmboot worker remove w-1 w-2 w-3",
    ],
    "worker show": [
        "warmboot worker show w-1",
    ],
    "agent": [
        "warmboot agent --config examples/agent.toml --worker-id w-1 --node node-1",
        "warmboot agent --config examples/agent.toml --worker-id w-1 --node node-1 --print-registration",
    ],
    "nats-config": [
        "warmboot nats-config --workers-file workers.txt --operator ops --client platform --secrets secrets.json "
        "--out accounts.conf",
    ],
    "audit replay": [
        "warmboot audit replay",
        "warmboot audit replay --until-time 2026-12-03T10:00:00Z -o json",
    ],
    "audit verify": [
        "warmboot audit verify",
    ],
    "audit actor": [
        "warmboot audit actor a-1",
    ],
}


def epilog(lines: list[str]) -> str:
    """The examples as click prints an epilog: `\\b` keeps each on its own line, unwrapped."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)


def attach(main: click.Group) -> None:
    """Give each command of `main` named in EXAMPLES its examples, after its options in --help."""
    for path, lines in EXAMPLES.items():
        command: click.Command = main
        for name in path.split():
            assert isinstance(command, click.Group), path
            command = command.commands[name]
        command.epilog = epilog(lines)
