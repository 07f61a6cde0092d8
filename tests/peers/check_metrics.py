"""Parses zonewatch's /metrics with the reference Prometheus client parser and checks the
families the issue asks for. Usage: check_metrics.py URL TOKEN"""
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

url, token = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
text = urllib.request.urlopen(req, timeout=30).read().decode("utf-8")
families = {f.name: f for f in text_string_to_metric_families(text)}
want = {
    "zonewatch_runs": "counter",
    "zonewatch_source_features": "gauge",
    "zonewatch_changes": "counter",
    "zonewatch_outcomes": "counter",
    "zonewatch_outbox_depth": "gauge",
    "zonewatch_dead_letters": "gauge",
    "zonewatch_quarantine": "gauge",
    "zonewatch_holds": "gauge",
    "zonewatch_holds_open": "gauge",
    "zonewatch_delivery_latency_seconds": "histogram",
}
missing = [n for n in want if n not in families]
wrong = [f"{n}: {families[n].type} != {t}" for n, t in want.items() if n in families and families[n].type != t]
if missing or wrong:
    print("missing:", missing, "wrong type:", wrong)
    sys.exit(1)
hist = families["zonewatch_delivery_latency_seconds"]
buckets = [s for s in hist.samples if s.name.endswith("_bucket")]
counts = [s.value for s in buckets]
assert counts == sorted(counts), "histogram buckets must be cumulative"
print(f"ok: {len(families)} metric families parsed, {sum(len(f.samples) for f in families.values())} samples")
