"""deploy/prometheus/alerts.yml names only metrics the services export, with their labels, and
docs/operations.md lists every metric as the services register it (read from prometheus_client's
default registry after importing every service module).

`promtool check rules deploy/prometheus/alerts.yml` (Debian's prometheus package) checks the
PromQL itself, run here where promtool is installed; the rest checks what promtool cannot know:
that the names are warmboot's.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

from warmboot.runner import SERVICES

ROOT = Path(__file__).parent.parent
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
OPERATIONS = ROOT / "docs" / "operations.md"
TARGET_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
PROMETHEUS_OWN = {"up"}  # series Prometheus writes itself for every target
# What an operator must be alerted on (the list): each must appear in some rule.
MUST_WATCH = {
    "up",
    "warmboot_resume_fallbacks_total",
    "warmboot_scheduler_stranded_snapshots",
    "warmboot_scheduler_lost_local_snapshots",
    "warmboot_scheduler_commit_conflicts_total",
    "warmboot_placements_total",
    "warmboot_registry_writes_over_budget_total",
    "warmboot_requests_dropped_total",
}


def service_modules() -> dict[str, object]:
    """Every module that defines warmboot metrics, by the service it belongs to."""
    modules = {name: importlib.import_module(SERVICES[name].partition(":")[0]) for name in SERVICES}
    modules["every service"] = importlib.import_module("services.endpoints")  # the shell: DROPPED
    return modules


def exported() -> dict[str, dict]:
    """Exposed metric name -> {type, labels, from}: what `/metrics` shows once a series exists.

    prometheus_client keeps a labelled metric's label names on the collector
    (`_labelnames`); there is no public reader for a metric that has no series yet.
    """
    owners = {}
    for service, module in service_modules().items():
        for value in vars(module).values():
            if hasattr(value, "_labelnames") and getattr(value, "_name", "").startswith("warmboot_"):
                owners[id(value)] = service
    metrics = {}
    for collector in list(REGISTRY._collector_to_names):
        name = getattr(collector, "_name", "")
        if not name.startswith("warmboot_"):
            continue
        kind = collector._type
        shown = f"{name}_total" if kind == "counter" else name
        metrics[shown] = {"type": kind, "labels": tuple(collector._labelnames),
                          "from": owners.get(id(collector), "?")}
    assert metrics, "no warmboot metric registered: the service modules define none?"
    return metrics


def rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


_METRIC = re.compile(r"\b(warmboot_[a-z0-9_]+|up)\b(?!\s*\()")
_SELECTOR = re.compile(r"\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_LABEL_REF = re.compile(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)")


def metrics_in(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def labels_in(expr: str) -> set[str]:
    found = {m for selector in _SELECTOR.findall(expr) for m in _MATCHER.findall(selector)}
    for _, names in _GROUPING.findall(expr):
        found.update(n.strip() for n in names.split(",") if n.strip())
    return found


def test_every_metric_an_alert_names_is_exported():
    metrics = exported()
    missing = {}
    for rule in rules():
        for name in metrics_in(rule["expr"]) - PROMETHEUS_OWN - set(metrics):
            missing.setdefault(name, []).append(rule["alert"])
    assert not missing, "alerts name metrics no service exports (yet): " + "; ".join(
        f"{name} (in {', '.join(alerts)})" for name, alerts in sorted(missing.items()))


def test_every_label_an_alert_uses_is_a_label_of_its_metrics():
    metrics = exported()
    for rule in rules():
        expr = rule["expr"]
        names = metrics_in(expr)
        have = TARGET_LABELS | {label for n in names for label in metrics.get(n, {}).get("labels", ())}
        unknown = labels_in(expr) - have
        assert not unknown, f"{rule['alert']}: labels {sorted(unknown)} are not labels of {sorted(names)}"
        # what the annotations print must survive the expression's aggregation
        grouped = [set(n.strip() for n in g.split(",")) for kind, g in _GROUPING.findall(expr) if kind == "by"]
        kept = set.intersection(*grouped) if grouped else have
        text = " ".join(str(v) for v in rule.get("annotations", {}).values())
        lost = set(_LABEL_REF.findall(text)) - kept
        assert not lost, f"{rule['alert']}: annotations use {sorted(lost)}, which the expression does not keep"


def test_the_alerts_watch_what_an_operator_needs():
    watched = set().union(*(metrics_in(rule["expr"]) for rule in rules()))
    assert MUST_WATCH <= watched, f"no alert on {sorted(MUST_WATCH - watched)}"
    for rule in rules():
        assert rule.get("for"), f"{rule['alert']} fires on a single evaluation"
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
    assert len({r["alert"] for r in rules()}) == len(rules())


def documented() -> dict[str, dict]:
    """The metrics table of docs/operations.md: | `name` | type | labels | from | meaning |."""
    text = OPERATIONS.read_text()
    section = text[text.index("## Metrics"):]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`warmboot_"):
            labels = tuple(label.strip() for label in cells[2].split(",") if label.strip())
            rows[cells[0].strip("`")] = {"type": cells[1], "labels": labels, "from": cells[3]}
    return rows


def test_the_operations_doc_lists_every_metric_as_exported():
    metrics, doc = exported(), documented()
    assert set(doc) == set(metrics), (
        f"undocumented: {sorted(set(metrics) - set(doc))}; documented but not exported: "
        f"{sorted(set(doc) - set(metrics))}")
    for name, metric in metrics.items():
        assert doc[name] == metric, f"docs/operations.md says {name} is {doc[name]}, the registry {metric}"


@pytest.mark.parametrize("expr, metrics, labels", [
    ('max by (sandbox_class) (warmboot_scheduler_stranded_snapshots) > 0',
     {"warmboot_scheduler_stranded_snapshots"}, {"sandbox_class"}),
    ('up{job=~"warmboot.*"} == 0', {"up"}, {"job"}),
    ('sum(rate(warmboot_x_total[5m])) > 0.2 * on(instance) group_left sum(rate(warmboot_y_total[5m]))',
     {"warmboot_x_total", "warmboot_y_total"}, {"instance"}),
])
def test_the_expression_reader(expr, metrics, labels):
    assert metrics_in(expr) == metrics
    assert labels_in(expr) == labels


def test_the_registry_doc_lists_every_metric_of_the_registry():
    """docs/registry.md's own list ("## Metrics") names each of the registry's metrics."""
    text = (ROOT / "docs" / "registry.md").read_text()
    section = text[text.index("## Metrics"):]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    listed = set(re.findall(r"`(warmboot_[a-z0-9_]+)", section))
    theirs = {name for name, metric in exported().items() if metric["from"] == "registry"}
    assert theirs <= listed, f"docs/registry.md, Metrics, does not list {sorted(theirs - listed)}"
    assert listed <= set(exported()), f"docs/registry.md, Metrics, lists {sorted(listed - set(exported()))}"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_promtool_checks_the_rules():
    """What docs/operations.md says passes: `promtool check rules deploy/prometheus/alerts.yml`."""
    done = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
