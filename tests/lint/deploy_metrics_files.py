#!/usr/bin/python3
"""Checks deploy/'s monitoring files against each other and against the daemon's code.

  tests/lint/deploy_metrics_files.py REPO_ROOT

- every YAML file under deploy/ parses (PyYAML), the Grafana dashboard parses as JSON;
- deploy/prometheus/epd-alerts.yml has the alerts operators rely on (P99 latency, error
  rate, restarts, masked ranks, NOT_SERVING), each with an expr, severity and summary;
- deploy/prometheus/prometheus.yml loads that rule file and scrapes /metrics;
- every epd_* metric the alerts and the dashboard query is one the daemon defines (its name
  appears as a string in daemon/**.cc), so a renamed metric fails here, not in production;
- the DaemonSet is annotated for scraping on a port it declares, the one the config map's
  metrics_listen binds.
Exits 1 naming each problem.
"""
import json
import pathlib
import re
import sys

import yaml

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
deploy = root / "deploy"
problems = []


def problem(msg):
    problems.append(msg)


for path in sorted(list(deploy.rglob("*.yaml")) + list(deploy.rglob("*.yml"))):
    try:
        list(yaml.safe_load_all(path.read_text()))
    except yaml.YAMLError as e:
        problem(f"{path}: not valid YAML: {e}")

dashboard_path = deploy / "grafana" / "epd-dashboard.json"
exprs = []
try:
    dashboard = json.loads(dashboard_path.read_text())
    panels = dashboard.get("panels", [])
    if not panels:
        problem(f"{dashboard_path}: no panels")
    for p in panels:
        targets = p.get("targets", [])
        if not targets:
            problem(f"{dashboard_path}: panel {p.get('title')!r} has no targets")
        exprs += [(f"{dashboard_path} panel {p.get('title')!r}", t.get("expr", "")) for t in targets]
except (OSError, json.JSONDecodeError) as e:
    problem(f"{dashboard_path}: not valid JSON: {e}")

alerts_path = deploy / "prometheus" / "epd-alerts.yml"
alerts = yaml.safe_load(alerts_path.read_text())
rules = [r for g in alerts.get("groups", []) for r in g.get("rules", [])]
for r in rules:
    name = r.get("alert", "?")
    if not r.get("expr"):
        problem(f"{alerts_path}: alert {name} has no expr")
    if "severity" not in r.get("labels", {}):
        problem(f"{alerts_path}: alert {name} has no severity label")
    if "summary" not in r.get("annotations", {}):
        problem(f"{alerts_path}: alert {name} has no summary")
    exprs.append((f"{alerts_path} alert {name}", r.get("expr", "")))
all_rules = "\n".join(str(r.get("expr", "")) for r in rules)
for what, pattern in [
    ("P99 latency", r"histogram_quantile\(0\.99,[\s\S]*epd_op_latency_seconds_bucket"),
    ("error rate", r"epd_op_failures_total[\s\S]*/[\s\S]*epd_ops_total"),
    ("restarts", r"epd_restarts_total"),
    ("masked ranks", r"epd_masked_ranks"),
    ("NOT_SERVING", r"epd_serving\s*==\s*0"),
]:
    if not re.search(pattern, all_rules):
        problem(f"{alerts_path}: no {what} alert (an expr matching {pattern!r})")

scrape = yaml.safe_load((deploy / "prometheus" / "prometheus.yml").read_text())
if "epd-alerts.yml" not in scrape.get("rule_files", []):
    problem("deploy/prometheus/prometheus.yml: rule_files does not load epd-alerts.yml")
if not scrape.get("scrape_configs"):
    problem("deploy/prometheus/prometheus.yml: no scrape_configs")

# Metric names the daemon defines: string literals in daemon/**.cc.
sources = "\n".join(p.read_text() for p in (root / "daemon").rglob("*.cc"))
defined = set(re.findall(r'"((?:epd|process)_[a-z0-9_]+)"', sources))
for where, expr in exprs:
    for name in set(re.findall(r"\b(epd_[a-z0-9_]+)", expr)):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in defined and base not in defined:
            problem(f"{where}: queries {name}, which the daemon does not define")

ds = yaml.safe_load((deploy / "k8s" / "daemonset.yaml").read_text())
annotations = ds["spec"]["template"]["metadata"].get("annotations", {})
if annotations.get("prometheus.io/scrape") != "true":
    problem("deploy/k8s/daemonset.yaml: pod template lacks prometheus.io/scrape: \"true\"")
port = annotations.get("prometheus.io/port")
declared = {str(p["containerPort"]) for c in ds["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])}
if port not in declared:
    problem(f"deploy/k8s/daemonset.yaml: prometheus.io/port {port!r} is not a containerPort "
            f"({sorted(declared)})")
cm = yaml.safe_load((deploy / "k8s" / "configmap.yaml").read_text())
m = re.search(r'^\s*metrics_listen:\s*"[^"]*:(\d+)"', cm["data"]["epd.textproto"], re.M)
if not m or m.group(1) != port:
    problem(f"deploy/k8s/configmap.yaml: metrics_listen does not bind the annotated port {port}")

for p in problems:
    print(f"deploy_metrics_files: {p}", file=sys.stderr)
if problems:
    sys.exit(1)
print(f"deploy_metrics_files: ok ({len(rules)} alerts, {len(exprs)} queries checked)")
