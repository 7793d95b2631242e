#!/usr/bin/env python3
"""Writes the Grafana dashboards (k3serve.json, k3serve-expert-load.json) next to this file (or into
the folder given as the first argument).

The JSON files are what Grafana loads (the Helm chart ships them as ConfigMaps); this script is
their source: edit it and run it again. tests/deploy checks that the files match it, type-checks
them against @grafana/schema's Dashboard and runs every expression against a real Prometheus.
"""
import json
import os
import sys

SCHEMA_VERSION = 42  # @grafana/schema 13's defaultDashboard
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"


class Board:
    def __init__(self, uid, title, description):
        self.uid, self.title, self.description = uid, title, description
        self.panels = []
        self.next_id = 1
        self.y = 0
        self.x = 0
        self.row_h = 0

    def row(self, title):
        self.newline()
        self.panels.append({"type": "row", "id": self.take_id(), "title": title, "collapsed": False,
                            "panels": [], "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}})
        self.y += 1

    def newline(self):
        if self.x:
            self.y += self.row_h
            self.x, self.row_h = 0, 0

    def take_id(self):
        self.next_id += 1
        return self.next_id - 1

    def panel(self, title, description, targets, unit="short", kind="timeseries", w=8, h=8, options=None,
              custom=None):
        if self.x + w > 24:
            self.newline()
        p = {
            "type": kind,
            "id": self.take_id(),
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": {"x": self.x, "y": self.y, "w": w, "h": h},
            "fieldConfig": {"defaults": {"unit": unit, "custom": custom or {}}, "overrides": []},
            "options": options or {"legend": {"showLegend": True, "displayMode": "list", "placement": "bottom",
                                              "calcs": []},
                                   "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
                         "range": True}
                        for i, (expr, legend) in enumerate(targets)],
        }
        self.panels.append(p)
        self.x += w
        self.row_h = max(self.row_h, h)

    def json(self, variables):
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["k3serve"],
            "editable": True,
            "graphTooltip": 1,
            "schemaVersion": SCHEMA_VERSION,
            "refresh": "30s",
            "time": {"from": "now-1h", "to": "now"},
            "timezone": "browser",
            "annotations": {"list": []},
            "links": [],
            "templating": {"list": [{
                "name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
                "current": {"text": "default", "value": "default"}, "hide": 0, "refresh": 1, "options": [],
            }] + variables},
            "panels": self.panels,
        }


def quantile(q, metric, by=""):
    by = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket[{RI}])))"


def overview():
    b = Board("k3serve", "k3serve", "One row per pool: gateway and attention, experts, router, orchestrator.")

    b.row("Gateway and attention")
    b.panel("Gateway requests by code", "Streams the gateway finished, by gRPC status.",
            [(f"sum by (code) (rate(k3serve_gateway_requests_total[{RI}]))", "{{code}}")], unit="reqps")
    b.panel("Gateway streams and retries", "Streams open now, and streams re-sent to another attention node.",
            [("sum(k3serve_gateway_inflight_streams)", "in flight"),
             (f"sum(rate(k3serve_gateway_retries_total[{RI}]))", "retries/s")])
    b.panel("Attention requests by code", "Generate requests the attention nodes finished, by gRPC status.",
            [(f"sum by (code) (rate(k3serve_requests_total[{RI}]))", "{{code}}")], unit="reqps")
    b.panel("Time to first token", "From a request's arrival to its first token.",
            [(quantile(0.5, "k3serve_time_to_first_token_seconds"), "p50"),
             (quantile(0.99, "k3serve_time_to_first_token_seconds"), "p99")], unit="s")
    b.panel("Inter-token latency", "Between consecutive tokens of a request; the ITL alert fires on p99.",
            [(quantile(0.5, "k3serve_inter_token_latency_seconds"), "p50"),
             (quantile(0.99, "k3serve_inter_token_latency_seconds"), "p99")], unit="s")
    b.panel("Request duration", "From arrival to the end of the stream.",
            [(quantile(0.5, "k3serve_request_duration_seconds"), "p50"),
             (quantile(0.99, "k3serve_request_duration_seconds"), "p99")], unit="s")
    b.panel("Tokens", "Prompt tokens admitted and tokens generated, per second.",
            [(f"sum(rate(k3serve_prompt_tokens_total[{RI}]))", "prompt"),
             (f"sum(rate(k3serve_generation_tokens_total[{RI}]))", "generated")])
    b.panel("Queue", "Sequences running in the engines and waiting for them, per attention node.",
            [("sum by (instance) (k3serve_running_requests)", "running {{instance}}"),
             ("sum by (instance) (k3serve_waiting_requests)", "waiting {{instance}}")])
    b.panel("Sequence state memory", "Bytes of per-sequence state (KDA state, conv state, MLA latent cache).",
            [("sum by (instance) (k3serve_sequence_state_bytes)", "{{instance}}")], unit="bytes")
    b.panel("Dispatch round trip (p99) per expert node", "One MoE dispatch part's round trip, by expert node.",
            [(quantile(0.99, "k3serve_dispatch_seconds", "node"), "{{node}}")], unit="s")
    b.panel("Data-plane bytes", "Bytes sent to and received from the expert nodes.",
            [(f"sum by (direction) (rate(k3serve_dispatch_bytes_total[{RI}]))", "{{direction}}")], unit="Bps")
    b.panel("Dispatch stages (decode, mean)",
            "A decode dispatch part's round trip by stage: pack, out, window, compute, back, unpack (out and back "
            "on one host only).",
            [(f'sum by (stage) (rate(k3serve_dispatch_stage_seconds_sum{{phase="decode"}}[{RI}])) / sum by (stage) '
              f'(rate(k3serve_dispatch_stage_seconds_count{{phase="decode"}}[{RI}]))', "{{stage}}")], unit="s")

    b.row("Experts")
    b.panel("Rows per second per node", "Token rows each expert node processed.",
            [(f"sum by (instance) (rate(k3serve_expert_rows_total[{RI}]))", "{{instance}}")])
    b.panel("Batch size (p50) per node", "Rows per expert batch.",
            [(quantile(0.5, "k3serve_expert_batch_rows", "instance"), "{{instance}}")])
    b.panel("Busy ratio per node", "Fraction of time each expert node spends computing.",
            [(f"rate(k3serve_expert_busy_seconds_total[{RI}])", "{{instance}}")], unit="percentunit")
    b.panel("Batch compute time (p99)", "Compute time of one expert batch.",
            [(quantile(0.99, "k3serve_expert_batch_seconds", "instance"), "{{instance}}")], unit="s")
    b.panel("Requests per batch (p50)", "Dispatch parts (from all attention nodes) merged into one batch.",
            [(quantile(0.5, "k3serve_expert_batch_requests", "instance"), "{{instance}}")])
    b.panel("Slots per node", "(layer, expert) slots loaded on each expert node.",
            [("k3serve_expert_slots", "{{instance}}")])

    b.row("Router")
    b.panel("Expert-load imbalance per layer", "Per MoE layer: max over mean tokens per expert (1 = even).",
            [("k3serve_expert_load_imbalance", "layer {{layer}}")])
    b.panel("Placement version", "Published by the router, and in use on every node.",
            [("max by (job) (k3serve_placement_version)", "{{job}}")])
    b.panel("Registered nodes", "Expert nodes registered and attention nodes watching the placement.",
            [("k3serve_router_expert_nodes", "expert"), ("k3serve_router_attention_nodes", "attention")])
    b.panel("Rebalances", "Placement changes by outcome, and experts moved by them.",
            [(f"sum by (outcome) (increase(k3serve_rebalances_total[{RI}]))", "{{outcome}}"),
             (f"sum(increase(k3serve_experts_moved_total[{RI}]))", "experts moved"),
             ("max(k3serve_rebalance_in_progress)", "in progress"),
             (f"sum(increase(k3serve_placement_changes_total[{RI}]))", "placements published")])
    b.panel("Routing bias drift", "Largest |bias| of the adaptive routing per layer, and the bias version.",
            [("k3serve_routing_bias_max_abs", "layer {{layer}}"),
             ("max(k3serve_routing_bias_version)", "version")])
    b.panel("Routing mode", "1 for the mode in use (frozen or adaptive).",
            [("max by (mode) (k3serve_routing_mode)", "{{mode}}")])

    b.row("Orchestrator")
    b.panel("Replicas: desired and actual", "Per pool, what the orchestrator wants and what runs.",
            [("k3serve_pool_desired_replicas", "desired {{pool}}"),
             ("k3serve_pool_actual_replicas", "actual {{pool}}")])
    b.panel("Scaling events", "Scale-ups and scale-downs applied, per pool.",
            [(f"sum by (pool, direction) (increase(k3serve_scaling_events_total[{RI}]))", "{{pool}} {{direction}}")])
    b.panel("Scaling decisions by reason", "Why the control loop chose each pool's size.",
            [(f"sum by (pool, reason) (increase(k3serve_scaling_decisions_total[{RI}]))", "{{pool}} {{reason}}")])
    b.panel("Drain duration (p99)", "From a node's drain to its last stream finished, per pool.",
            [(quantile(0.99, "k3serve_drain_duration_seconds", "pool"), "{{pool}}")], unit="s")
    b.panel("Attention:expert ratio", "Node ratio that balances measured attention time against expert time.",
            [("k3serve_attention_expert_ratio", "ratio")])
    b.panel("Targets up", "Scraped targets per pool.", [('sum by (job) (up{job=~"k3serve-.*"})', "{{job}}")])
    return b.json([])


def expert_load():
    b = Board("k3serve-expert-load", "k3serve expert load",
              "Per-node and per-layer expert load; the per-expert heatmap needs the router's opt-in "
              "k3serve_expert_tokens_total (layer-filtered).")
    b.row("Expert nodes")
    b.panel("Tokens per second per node", "Tokens routed to the slots of each expert node.",
            [(f"sum by (node) (rate(k3serve_expert_node_load_tokens_total[{RI}]))", "{{node}}")], w=12)
    b.panel("Share of the load per node", "Each node's fraction of the routed tokens (1/N is even).",
            [(f"sum by (node) (rate(k3serve_expert_node_load_tokens_total[{RI}])) / ignoring(node) group_left "
              f"sum(rate(k3serve_expert_node_load_tokens_total[{RI}]))", "{{node}}")], unit="percentunit", w=12)
    b.panel("Busy ratio per node", "Fraction of time each expert node spends computing.",
            [(f"rate(k3serve_expert_busy_seconds_total[{RI}])", "{{instance}}")], unit="percentunit", w=12)
    b.panel("Imbalance of the selected layers", "Max over mean tokens per expert, per MoE layer.",
            [('k3serve_expert_load_imbalance{layer=~"$layer"}', "layer {{layer}}")], w=12)
    b.row("Experts")
    b.panel("Tokens per expert", "Opt-in per-(layer, expert) series of the router, for the selected layers.",
            [(f'sum by (expert) (rate(k3serve_expert_tokens_total{{layer=~"$layer"}}[{RI}]))', "{{expert}}")],
            kind="heatmap", w=24, h=12,
            options={"calculate": False, "yAxis": {"axisPlacement": "left"},
                     "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64, "fill": "dark-orange",
                               "exponent": 0.5, "reverse": False},
                     "cellGap": 1, "legend": {"show": True}, "tooltip": {"mode": "single", "yHistogram": False},
                     "exemplars": {"color": "rgba(255,0,255,0.7)"}, "showValue": "never"})
    layer = {
        "name": "layer", "label": "MoE layer", "type": "query", "datasource": DS,
        "query": {"query": "label_values(k3serve_expert_load_imbalance, layer)", "refId": "layers"},
        "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "hide": 0, "refresh": 2,
        "options": [], "sort": 3,
    }
    return b.json([layer])


def main():
    here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    for name, board in (("k3serve.json", overview()), ("k3serve-expert-load.json", expert_load())):
        with open(os.path.join(here, name), "w") as f:
            json.dump(board, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
