"""The stage graph and the last day's chart, laid out and drawn as SVG. Pure.

`edges_of(config)` names the graph's edges: a stage's NEXT (solid), a built-in's
routes (an if stage's THEN and ELSE, labelled) and BOUNCE_STAGE (dashed); the
nodes are the configured stages and every AMQP queue they (or the caller) name.
`layout` puts each node in a layer, its longest path from the entry stages
(`Config.entry_stages()`; a cycle's edge back to a node on the current path is
left out of the layering, and a part of the graph no entry reaches starts from
its first stage), orders each layer by its predecessors' rows and gives every
node a box and every edge a path. `render_graph` and `render_chart` draw SVG,
every text escaped; the caller marks the result safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from html import escape
from urllib.parse import quote

from pepsi.config import Config
from pepsi.config.values import is_amqp_stage

NEXT, ROUTE, BOUNCE = "next", "route", "bounce"
STAGE, AMQP = "stage", "amqp"

NODE_W, NODE_H = 180, 52
GAP_X, GAP_Y = 70, 22  # between layers, between the nodes of a layer
MARGIN = 16
LOOP_DROP = 34  # how far below its nodes an edge going back bends
LOOP_STEP = 10  # between the lines of two edges going back
NAME_CHARS = 24  # a longer name is shortened in its box (its title has it whole)


@dataclass(frozen=True)
class EdgeSpec:
    source: str
    target: str
    kind: str  # NEXT, ROUTE or BOUNCE
    label: str = ""  # a route's key, lower case: then, else


@dataclass(frozen=True)
class Node:
    name: str
    kind: str  # STAGE or AMQP
    layer: int
    row: int
    x: float
    y: float
    width: float = NODE_W
    height: float = NODE_H


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    kind: str
    label: str
    path: str  # SVG path data
    label_x: float
    label_y: float
    back: bool  # against the layers' direction (a cycle)


@dataclass(frozen=True)
class Layout:
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    width: float
    height: float

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)


@dataclass(frozen=True)
class Backlog:
    pending: int = 0
    running: int = 0
    failed: int = 0  # failed and timed out


def edges_of(config: Config) -> list[EdgeSpec]:
    """Every edge of the configured stages, in their order: NEXT, routes, BOUNCE_STAGE."""
    edges = []
    for name, stage in config.stages.items():
        if stage.next:
            edges.append(EdgeSpec(name, stage.next, NEXT))
        for key, target in stage.routes:
            edges.append(EdgeSpec(name, target, ROUTE, key.lower()))
        if stage.bounce_stage:
            edges.append(EdgeSpec(name, stage.bounce_stage, BOUNCE))
    return edges


def node_names(config: Config, edges: Sequence[EdgeSpec], queues: Iterable[str] = ()) -> list[str]:
    """The configured stages, then the other targets (AMQP queues), then `queues`."""
    names = list(config.stages)
    seen = set(names)
    for name in [e.target for e in edges] + [q for q in queues if is_amqp_stage(q)]:
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def layers(
    names: Sequence[str], edges: Sequence[EdgeSpec], entries: Sequence[str]
) -> dict[str, int]:
    """Each node's layer: its longest path from a root, the edges that close a cycle
    left out. Roots: `entries`, then (for what they do not reach) the first node left."""
    succ: dict[str, list[str]] = {n: [] for n in names}
    for e in edges:
        if e.source in succ and e.target in succ and e.target not in succ[e.source]:
            succ[e.source].append(e.target)
    back: set[tuple[str, str]] = set()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    order: list[str] = []  # finishing order (reversed: a topological order without `back`)
    roots: list[str] = [n for n in entries if n in succ]

    def visit(root: str) -> None:
        stack: list[tuple[str, int]] = [(root, 0)]
        state[root] = 1
        while stack:
            node, i = stack[-1]
            if i < len(succ[node]):
                stack[-1] = (node, i + 1)
                target = succ[node][i]
                seen = state.get(target)
                if seen == 1:
                    back.add((node, target))
                elif seen is None:
                    state[target] = 1
                    stack.append((target, 0))
            else:
                stack.pop()
                state[node] = 2
                order.append(node)

    for root in roots:
        if root not in state:
            visit(root)
    for name in names:
        if name not in state:
            roots.append(name)
            visit(name)
    layer = dict.fromkeys(names, 0)
    for node in reversed(order):
        for target in succ[node]:
            if (node, target) not in back:
                layer[target] = max(layer[target], layer[node] + 1)
    return layer


def layout(config: Config, queues: Iterable[str] = ()) -> Layout:
    """The graph of `config`'s stages (and of `queues`, AMQP queues not otherwise named)."""
    specs = edges_of(config)
    names = node_names(config, specs, queues)
    entries = config.entry_stages()
    layer = layers(names, specs, entries)
    by_layer: dict[int, list[str]] = {}
    for name in names:
        by_layer.setdefault(layer[name], []).append(name)
    row: dict[str, int] = {}
    preds: dict[str, list[str]] = {n: [] for n in names}
    for e in specs:
        if e.target in preds and e.source in layer and layer[e.source] < layer[e.target]:
            preds[e.target].append(e.source)
    for depth in sorted(by_layer):
        members = by_layer[depth]
        position = {n: i for i, n in enumerate(members)}

        def key(name: str, position: dict[str, int] = position) -> tuple[float, int]:
            placed = [row[p] for p in preds[name] if p in row]
            return (sum(placed) / len(placed) if placed else float("inf"), position[name])

        for i, name in enumerate(sorted(members, key=key)):
            row[name] = i
    nodes = {
        name: Node(
            name=name,
            kind=AMQP if is_amqp_stage(name) else STAGE,
            layer=layer[name],
            row=row[name],
            x=MARGIN + layer[name] * (NODE_W + GAP_X),
            y=MARGIN + row[name] * (NODE_H + GAP_Y),
        )
        for name in names
    }
    depth_rows = max((len(m) for m in by_layer.values()), default=0)
    bottom = MARGIN + depth_rows * (NODE_H + GAP_Y) - GAP_Y
    edges = []
    seen_pairs: dict[tuple[str, str], int] = {}
    loops = 0  # edges back so far: each runs along its own line below the nodes
    for e in specs:
        a, b = nodes[e.source], nodes[e.target]
        nth = seen_pairs.get((e.source, e.target), 0)
        seen_pairs[(e.source, e.target)] = nth + 1
        edge = _edge(e, a, b, nth, bottom + LOOP_DROP / 2 + loops * LOOP_STEP)
        loops += edge.back
        edges.append(edge)
    layers_n = max(layer.values(), default=-1) + 1
    width = MARGIN + layers_n * (NODE_W + GAP_X) - GAP_X + MARGIN + (GAP_X / 2 if loops else 0)
    height = bottom + MARGIN + (LOOP_DROP / 2 + loops * LOOP_STEP if loops else 0)
    return Layout(tuple(nodes[n] for n in names), tuple(edges), max(width, 0), max(height, 0))


def _edge(spec: EdgeSpec, a: Node, b: Node, nth: int, low: float) -> Edge:
    """A forward edge: right side to left side, a curve. An edge back (or to itself): out of
    the source's right side, down the gap after its layer to `low` (below every node),
    along to the gap before the target's layer and up into the target's left side."""
    offset = nth * 8.0  # a second edge between the same two nodes, apart from the first
    x1, y1 = a.x + a.width, a.y + a.height / 2 + offset
    x2, y2 = b.x, b.y + b.height / 2 + offset
    if b.layer > a.layer:
        bend = max(30.0, (x2 - x1) / 2)
        path = f"M{x1:g},{y1:g} C{x1 + bend:g},{y1:g} {x2 - bend:g},{y2:g} {x2:g},{y2:g}"
        return Edge(spec.source, spec.target, spec.kind, spec.label, path,
                    (x1 + x2) / 2, (y1 + y2) / 2 - 4, back=False)  # fmt: skip
    r = 10.0  # the corners' radius
    out, into = x1 + GAP_X / 2 - 8, x2 - GAP_X / 2 + 8
    path = (
        f"M{x1:g},{y1:g} L{out - r:g},{y1:g} Q{out:g},{y1:g} {out:g},{y1 + r:g} "
        f"L{out:g},{low - r:g} Q{out:g},{low:g} {out - r:g},{low:g} "
        f"L{into + r:g},{low:g} Q{into:g},{low:g} {into:g},{low - r:g} "
        f"L{into:g},{y2 + r:g} Q{into:g},{y2:g} {into + r:g},{y2:g} L{x2:g},{y2:g}"
    )
    return Edge(spec.source, spec.target, spec.kind, spec.label, path,
                (out + into) / 2, low - 4, back=True)  # fmt: skip


def stage_href(name: str) -> str:
    """The stage page's address: the whole name one path segment (amqp:/:q too)."""
    return "/stage/" + quote(name, safe="")


def _short(name: str) -> str:
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"


def _attr(value: object) -> str:
    return escape(str(value), quote=True)


EDGE_STYLE = {
    NEXT: 'stroke="#4a5a6a" stroke-width="1.6"',
    ROUTE: 'stroke="#2f6f9f" stroke-width="1.6"',
    BOUNCE: 'stroke="#b04a3a" stroke-width="1.4" stroke-dasharray="6 4"',
}


def render_graph(graph: Layout, backlog: Mapping[str, Backlog]) -> str:
    """The graph as an SVG element: each node a link to its stage page, with its backlog."""
    if not graph.nodes:
        return '<p class="empty" id="graph-empty">No stages configured.</p>'
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="stage-graph" id="stage-graph" '
        f'width="{graph.width:g}" height="{graph.height:g}" '
        f'viewBox="0 0 {graph.width:g} {graph.height:g}" role="img" '
        f'aria-label="stage graph">',
        "<defs>",
        *(
            f'<marker id="arrow-{kind}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
            f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
            f'fill="{colour}"/></marker>'
            for kind, colour in ((NEXT, "#4a5a6a"), (ROUTE, "#2f6f9f"), (BOUNCE, "#b04a3a"))
        ),
        "</defs>",
    ]
    for edge in graph.edges:
        title = f"{edge.source} → {edge.target} ({edge.label or edge.kind})"
        out.append(
            f'<g class="edge edge-{edge.kind}" data-source="{_attr(edge.source)}" '
            f'data-target="{_attr(edge.target)}"><title>{escape(title)}</title>'
            f'<path d="{edge.path}" fill="none" {EDGE_STYLE[edge.kind]} '
            f'marker-end="url(#arrow-{edge.kind})"/>'
        )
        if edge.label:
            out.append(
                f'<text class="edge-label" x="{edge.label_x:g}" y="{edge.label_y:g}" '
                f'text-anchor="middle" font-size="11" fill="#2f6f9f">{escape(edge.label)}</text>'
            )
        out.append("</g>")
    for node in graph.nodes:
        counts = backlog.get(node.name, Backlog())
        fill, stroke = ("#eef6ee", "#4f8a4f") if node.kind == AMQP else ("#ffffff", "#12355b")
        if counts.failed:
            stroke = "#b00020"
        line = f"{counts.pending} pending · {counts.running} running · {counts.failed} failed"
        title = f"{node.name}: {line}"
        cx = node.x + node.width / 2
        out.append(
            f'<a class="node node-{node.kind}" href="{_attr(stage_href(node.name))}" '
            f'data-stage="{_attr(node.name)}"><title>{escape(title)}</title>'
            f'<rect x="{node.x:g}" y="{node.y:g}" width="{node.width:g}" '
            f'height="{node.height:g}" rx="{12 if node.kind == AMQP else 4}" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="1.5"/>'
            f'<text class="node-name" x="{cx:g}" y="{node.y + 21:g}" text-anchor="middle" '
            f'font-size="13" font-weight="600" fill="#1d1d1f">{escape(_short(node.name))}</text>'
            f'<text class="node-backlog" x="{cx:g}" y="{node.y + 39:g}" text-anchor="middle" '
            f'font-size="11" fill="#555">{escape(_short_counts(counts))}</text></a>'
        )
    out.append("</svg>")
    return "".join(out)


def _short_counts(counts: Backlog) -> str:
    return f"{counts.pending} pend · {counts.running} run · {counts.failed} fail"


# ---- the chart ------------------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    label: str  # HH:MM, when it starts
    processed: int
    failed: int
    by_stage: Mapping[str, tuple[int, int]]  # stage -> (processed, failed)


CHART_W, CHART_H = 600, 120
CHART_PAD_L, CHART_PAD_B, CHART_PAD_T = 40, 18, 8


def render_chart(bars: Sequence[Bar], label_every: int = 16) -> str:
    """Processed (bars, up) and failed (bars, red, in front) per bar of time as an SVG
    element; each bar's title gives the numbers, all stages and each stage. A time label
    every `label_every` bars (4 hours of quarters)."""
    n = max(1, len(bars))
    top = max((max(m.processed, m.failed) for m in bars), default=0)
    scale_max = max(1, top)
    plot_w = CHART_W - CHART_PAD_L - 4
    plot_h = CHART_H - CHART_PAD_T - CHART_PAD_B
    step = plot_w / n
    width = max(1.0, step - 1)
    base = CHART_PAD_T + plot_h
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="rate-chart" id="rate-chart" '
        f'width="{CHART_W}" height="{CHART_H}" viewBox="0 0 {CHART_W} {CHART_H}" role="img" '
        f'aria-label="messages per 15 minutes, last 24 hours">',
        f'<line x1="{CHART_PAD_L}" y1="{base:g}" x2="{CHART_W - 4}" y2="{base:g}" '
        f'stroke="#999" stroke-width="1"/>',
        f'<text x="{CHART_PAD_L - 4}" y="{CHART_PAD_T + 9}" text-anchor="end" font-size="10" '
        f'fill="#555">{scale_max}</text>',
        f'<text x="{CHART_PAD_L - 4}" y="{base:g}" text-anchor="end" font-size="10" '
        f'fill="#555">0</text>',
    ]
    for i, bar in enumerate(bars):
        x = CHART_PAD_L + i * step
        parts = [f"{bar.label}: {bar.processed} processed, {bar.failed} failed"]
        parts += [
            f"{stage}: {p} processed, {f} failed"
            for stage, (p, f) in sorted(bar.by_stage.items())
            if p or f
        ]
        out.append(f'<g class="bar"><title>{escape(chr(10).join(parts))}</title>')
        out.append(
            f'<rect class="hit" x="{x:g}" y="{CHART_PAD_T}" width="{step:g}" '
            f'height="{plot_h:g}" fill="transparent"/>'
        )
        for value, cls, colour in (
            (bar.processed, "bar-processed", "#4f7fb0"),
            (bar.failed, "bar-failed", "#c0392b"),
        ):
            if value:
                h = max(1.0, plot_h * value / scale_max)
                out.append(
                    f'<rect class="{cls}" x="{x:g}" y="{base - h:g}" width="{width:g}" '
                    f'height="{h:g}" fill="{colour}"/>'
                )
        out.append("</g>")
        last = i == len(bars) - 1
        if (i % label_every == 0 and len(bars) - i > label_every // 2) or last:
            anchor, at = ("end", x + step) if last else ("start", x)
            out.append(
                f'<text x="{at:g}" y="{CHART_H - 4}" font-size="10" fill="#555" '
                f'text-anchor="{anchor}">{escape(bar.label)}</text>'
            )
    out.append("</svg>")
    return "".join(out)
