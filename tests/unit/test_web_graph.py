"""The console's stage graph (layers, edges, SVG) and the last day's chart (pure)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from pepsi.config import Config
from pepsi.config.ini import parse_ini
from pepsi.config.parse import parse_config
from pepsi.web import graph
from pepsi.web.overview_chart import chart_bars


def config(text: str) -> Config:
    return parse_config(parse_ini(text, "test"))


def stage(name: str, extra: str = "") -> str:
    return f"[stage-{name}]\nHANDLER = tests.stages:noop\n{extra}"


def layer_of(layout: graph.Layout) -> dict[str, int]:
    return {node.name: node.layer for node in layout.nodes}


def test_layers_are_the_longest_path_from_the_entry_stages() -> None:
    # a -> b -> c, and a -> c directly: c is on layer 2 (the longest path), not 1
    cfg = config(stage("a", "NEXT = b\nBOUNCE_STAGE = c\n") + stage("b", "NEXT = c\n") + stage("c"))
    layout = graph.layout(cfg)
    assert layer_of(layout) == {"a": 0, "b": 1, "c": 2}
    kinds = {(e.source, e.target): e.kind for e in layout.edges}
    assert kinds == {("a", "b"): "next", ("a", "c"): "bounce", ("b", "c"): "next"}
    a, b, c = (layout.node(n) for n in "abc")
    assert a.x < b.x < c.x  # left to right, by layer
    assert not any(e.back for e in layout.edges)
    assert layout.width >= c.x + c.width
    assert layout.height >= c.y + c.height


def test_a_cycle_is_tolerated_and_drawn_back() -> None:
    # a -> b -> c -> b: the edge c -> b closes the cycle and goes back
    cfg = config(stage("a", "NEXT = b\n") + stage("b", "NEXT = c\n") + stage("c", "NEXT = b\n"))
    layout = graph.layout(cfg)
    assert layer_of(layout) == {"a": 0, "b": 1, "c": 2}
    back = [e for e in layout.edges if e.back]
    assert [(e.source, e.target) for e in back] == [("c", "b")]
    # it runs below every node, and the drawing has room for it
    lowest = max(float(y) for y in re.findall(r",(-?[\d.]+)", back[0].path))
    assert lowest > max(n.y + n.height for n in layout.nodes)
    assert layout.height > lowest


def test_a_graph_no_entry_reaches_starts_from_its_first_stage() -> None:
    # every stage is someone's target: no entry stage at all
    cfg = config(stage("x", "NEXT = y\n") + stage("y", "NEXT = x\n") + stage("z", "NEXT = z\n"))
    assert cfg.entry_stages() == []
    layout = graph.layout(cfg)
    assert layer_of(layout) == {"x": 0, "y": 1, "z": 0}
    assert {(e.source, e.target) for e in layout.edges if e.back} == {("y", "x"), ("z", "z")}


def test_a_branch_puts_both_routes_on_the_next_layer_with_their_labels() -> None:
    cfg = config(
        '[stage-check]\nPROGRAM = pepsi-stage-if\nIF = sender ~ "@spam"\n'
        "THEN = drop\nELSE = keep\n" + stage("keep", "NEXT = drop\n") + stage("drop")
    )
    layout = graph.layout(cfg)
    assert layer_of(layout) == {"check": 0, "keep": 1, "drop": 2}
    routes = {e.label: e.target for e in layout.edges if e.kind == "route"}
    assert routes == {"then": "drop", "else": "keep"}
    svg = graph.render_graph(layout, {})
    assert ">then</text>" in svg
    assert ">else</text>" in svg


def test_an_amqp_target_is_a_node_of_its_own() -> None:
    cfg = config(stage("a", "NEXT = b\n") + stage("b", "NEXT = amqp:done\n"))
    layout = graph.layout(cfg, ["amqp:/:done", "amqp:v1:other", "not-a-queue"])
    names = [n.name for n in layout.nodes]
    assert names == ["a", "b", "amqp:/:done", "amqp:v1:other"]
    done = layout.node("amqp:/:done")
    assert (done.kind, done.layer) == ("amqp", 2)
    assert layout.node("amqp:v1:other").layer == 0  # declared, nothing sends to it
    assert graph.stage_href("amqp:/:done") == "/stage/amqp%3A%2F%3Adone"


def test_the_svg_escapes_names_and_links_each_node() -> None:
    cfg = config(stage("a", "NEXT = amqp:<q>&\n"))
    layout = graph.layout(cfg)
    svg = graph.render_graph(layout, {"a": graph.Backlog(pending=7, running=2, failed=1)})
    assert "<q>" not in svg
    assert "amqp:/:&lt;q&gt;&amp;" in svg
    assert 'href="/stage/a"' in svg
    assert 'href="/stage/amqp%3A%2F%3A%3Cq%3E%26"' in svg
    assert "7 pending · 2 running · 1 failed" in svg
    assert len(re.findall(r'<g class="edge edge-next"', svg)) == 1
    assert graph.render_graph(graph.layout(config("")), {}).startswith("<p")


def test_the_chart_has_the_last_days_quarters_up_to_nows() -> None:
    now = datetime(2026, 1, 1, 12, 7, 30, tzinfo=UTC)
    quarter = datetime(2026, 1, 1, 11, 45, tzinfo=UTC)
    rows = [
        (quarter, "a", 10, 2),
        (quarter, "b", 5, 0),
        (now.replace(minute=0, second=0), "a", 1, 0),  # this quarter: the last bar
        (now - timedelta(days=2), "a", 99, 99),  # before the day: not drawn
    ]
    bars = chart_bars(rows, now)
    assert len(bars) == 96
    assert (bars[0].label, bars[-2].label, bars[-1].label) == ("12:15", "11:45", "12:00")
    assert (bars[-2].processed, bars[-2].failed) == (15, 2)
    assert bars[-2].by_stage == {"a": (10, 2), "b": (5, 0)}
    assert bars[-1].processed == 1
    assert sum(b.processed for b in bars) == 16
    chart = graph.render_chart(bars)
    assert chart.count('class="bar-processed"') == 2
    assert chart.count('class="bar-failed"') == 1
    assert "11:45: 15 processed, 2 failed" in chart
    assert "a: 10 processed, 2 failed" in chart
