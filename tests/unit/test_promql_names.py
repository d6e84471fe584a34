"""The metric names a PromQL expression reads (tests/harness/prometheus.py),
with which the dashboard's queries are checked against what the services
export."""

from __future__ import annotations

import pytest
from harness.prometheus import metric_names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ("sum by (reason, direction) (rate(flagella_drop_count_total[$__rate_interval]))",
         {"flagella_drop_count_total"}),
        ('histogram_quantile(0.99, sum by (job, le) (rate(grpc_server_handling_seconds_bucket'
         '{grpc_type="unary", job=~"$job"}[5m])))', {"grpc_server_handling_seconds_bucket"}),
        ('rate(a_total{code!="rate(x)"}[1m]) / on (job) group_left (node) b > bool 0 or c '
         "offset 5m unless d", {"a_total", "b", "c", "d"}),
        ("sum without (instance) (process_resident_memory_bytes) * 1e3 + Inf",
         {"process_resident_memory_bytes"}),
        ("{__name__=\"x\"}", set()),
    ],
)  # fmt: skip
def test_metric_names_are_the_identifiers_that_are_no_function_keyword_or_label(
    expr: str, names: set[str]
) -> None:
    assert metric_names(expr) == names
