#!/usr/bin/env python
"""A static picture of one training step from megalite's `--timeline` Chrome-trace files:

    python scripts/timeline_svg.py runs/trace.json -o docs/step.svg
    python scripts/timeline_svg.py plain.json overlap.json -o docs/overlap.svg --iteration 2 \\
        --title "EP 2, one step" --labels "without overlap,with overlap"

Each file becomes a panel with one lane per (rank, row): the row names come from the trace's
process_name / thread_name metadata. Each span ("X" event) of the chosen iteration is a rectangle
coloured by its category. Every panel's time starts at its own first span of that iteration, and
all panels share one scale, so that bar lengths compare across files. Perfetto shows the same file
interactively; this is for Markdown, where only a picture shows. Standard library only, and the
same input always gives the same bytes.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import os
import sys

# Fixed legend, in drawing order: (label, fill). Categories ending in "-comm" (ep-comm, tp-comm, ...)
# share one strong colour: in-flight communication is what an overlap picture is about.
CATEGORY_COLOURS = {
    "forward": "#4e79a7",
    "backward": "#f28e2b",
    "weight-grad": "#edc948",
    "p2p": "#59a14f",
    "grad-reduce": "#b07aa1",
    "zero-gather": "#76b7b2",
    "zero-wait": "#9c755f",
    "zero-reduce-wait": "#7f5539",
    "optimizer": "#ff9d9a",
}
LEGEND_LABELS = {"p2p": "p2p / send-recv"}
COMM_COLOUR, COMM_LABEL = "#d4145a", "*-comm (ep, tp, cp)"
OTHER_COLOUR, OTHER_LABEL = "#bab0ac", "other"

LANE_H, LANE_GAP, PANEL_GAP = 18, 4, 14  # px
FONT = "font-family=\"DejaVu Sans, Arial, sans-serif\""
CHAR_W = 6.2  # px per character at 11 px, to size the label margin without measuring text


def colour(category: str) -> str:
    if category in CATEGORY_COLOURS:
        return CATEGORY_COLOURS[category]
    if category.endswith("-wait"):  # what compute waited for (ep-wait, sp-wait, ...): as ZeRO's waits
        return CATEGORY_COLOURS["zero-wait"]
    return COMM_COLOUR if category.endswith("-comm") else OTHER_COLOUR


def text_colour(fill: str) -> str:
    """Black on light fills, white on dark ones (relative luminance of the sRGB hex)."""
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "#ffffff"


def esc(text) -> str:
    return html.escape(str(text), quote=True)


def num(x: float) -> str:
    """Coordinates with two decimals: short, and stable across runs."""
    return f"{x:.2f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


def load_events(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


class Panel:
    """One trace file's spans of one iteration, laid out as lanes."""

    def __init__(self, events: list[dict], label: str, iteration: int | None):
        spans = [e for e in events if e.get("ph") == "X"]
        present = sorted({e["args"]["iteration"] for e in spans if "iteration" in e.get("args", {})})
        if iteration is None and present:
            iteration = present[-1]  # the last one: warm, unlike the first
        if iteration is not None and iteration not in present:
            raise SystemExit(f"{label}: no spans of iteration {iteration} (present: {present or 'none'})")
        self.label, self.iteration = label, iteration
        # Lanes of every span of the file, so that a rank idle in this iteration still shows.
        self.lanes = sorted({(e.get("pid", 0), e.get("tid", 0)) for e in spans})
        self.spans = sorted((e for e in spans if iteration is None or e.get("args", {}).get("iteration") == iteration),
                            key=lambda e: (e["ts"], e.get("pid", 0), e.get("tid", 0), e.get("name", "")))
        self.origin = min((e["ts"] for e in self.spans), default=0.0)
        self.length_ms = max(((e["ts"] + e["dur"] - self.origin) / 1000 for e in self.spans), default=0.0)
        ranks = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
        rows = {(e["pid"], e.get("tid", 0)): e["args"]["name"] for e in events
                if e.get("ph") == "M" and e.get("name") == "thread_name"}
        self.lane_labels = {}
        for pid, tid in self.lanes:
            rank = ranks.get(pid, f"rank {pid}")
            self.lane_labels[(pid, tid)] = rank if tid == 0 else f"{rank}: {rows.get((pid, tid), f'row {tid}')}"

    def height(self) -> int:
        return 20 + len(self.lanes) * (LANE_H + LANE_GAP)


def tick_step(span_ms: float, target: int = 8) -> float:
    """A 1, 2 or 5 times a power of ten that cuts `span_ms` into about `target` intervals."""
    raw = max(span_ms, 1e-9) / target
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def tick_label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:.{decimals}f}"


def legend_entries() -> list[tuple[str, str]]:
    entries = [(LEGEND_LABELS.get(c, c), fill) for c, fill in CATEGORY_COLOURS.items()]
    return entries + [(COMM_LABEL, COMM_COLOUR), (OTHER_LABEL, OTHER_COLOUR)]


def render(panels: list[Panel], title: str | None, plot_width: int = 1000) -> str:
    label_w = 12 + CHAR_W * max((len(t) for p in panels for t in p.lane_labels.values()), default=10)
    left, right = math.ceil(label_w), 20
    width = left + plot_width + right
    length_ms = max((p.length_ms for p in panels), default=0.0) or 1.0
    px_per_ms = plot_width / length_ms
    out: list[str] = []
    y = 10
    if title:
        out.append(f'<text x="{num(width / 2)}" y="24" text-anchor="middle" font-size="15" '
                   f'font-weight="bold">{esc(title)}</text>')
        y = 36
    # Legend: swatches in one or more rows across the full width.
    x = left
    for label, fill in legend_entries():
        w = 18 + CHAR_W * len(label) + 16
        if x + w > width - right:
            x, y = left, y + 18
        out.append(f'<rect class="key" x="{num(x)}" y="{y + 2}" width="12" height="12" fill="{fill}"/>')
        out.append(f'<text x="{num(x + 16)}" y="{y + 12}" font-size="11">{esc(label)}</text>')
        x += w
    y += 28
    plot_top = y
    for panel in panels:
        facts = [f"iteration {panel.iteration}"] if panel.iteration is not None else []
        facts.append(f"{panel.length_ms:.1f} ms")
        header = f"{panel.label} ({', '.join(facts)})"
        out.append(f'<text class="panel" x="{left}" y="{y + 13}" font-size="13" font-weight="bold">'
                   f'{esc(header)}</text>')
        lane_y = {}
        for i, lane in enumerate(panel.lanes):
            top = y + 20 + i * (LANE_H + LANE_GAP)
            lane_y[lane] = top
            out.append(f'<rect class="lane" x="{left}" y="{top}" width="{plot_width}" height="{LANE_H}" '
                       f'fill="{"#f4f4f4" if i % 2 == 0 else "#fafafa"}"/>')
            out.append(f'<text class="lane-label" x="{left - 6}" y="{top + 13}" font-size="11" '
                       f'text-anchor="end">{esc(panel.lane_labels[lane])}</text>')
        for e in panel.spans:
            top = lane_y[(e.get("pid", 0), e.get("tid", 0))]
            x0 = left + (e["ts"] - panel.origin) / 1000 * px_per_ms
            w = max(e["dur"] / 1000 * px_per_ms, 0.5)  # a sub-pixel span stays visible
            category, name = e.get("cat", ""), e.get("name", "")
            out.append(f'<rect class="span" data-cat="{esc(category)}" x="{num(x0)}" y="{top + 1}" '
                       f'width="{num(w)}" height="{LANE_H - 2}" fill="{colour(category)}">'
                       f'<title>{esc(name)} ({esc(category)}): {e["dur"] / 1000:.3f} ms</title></rect>')
            if w > CHAR_W * 0.85 * len(name) + 4:  # the name fits inside the bar
                out.append(f'<text x="{num(x0 + w / 2)}" y="{top + 13}" font-size="9" text-anchor="middle" '
                           f'fill="{text_colour(colour(category))}">{esc(name)}</text>')
        y += panel.height() + PANEL_GAP
    # Time axis under the last panel, with grid lines up through every panel.
    step = tick_step(length_ms)
    axis_y = y
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_width}" y2="{axis_y}" stroke="#333333"/>')
    for k in range(int(length_ms / step + 1e-9) + 1):
        tx = left + k * step * px_per_ms
        out.append(f'<line x1="{num(tx)}" y1="{plot_top}" x2="{num(tx)}" y2="{axis_y}" stroke="#000000" '
                   f'stroke-opacity="0.12"/>')
        out.append(f'<line x1="{num(tx)}" y1="{axis_y}" x2="{num(tx)}" y2="{axis_y + 5}" stroke="#333333"/>')
        out.append(f'<text class="tick" x="{num(tx)}" y="{axis_y + 17}" font-size="10" '
                   f'text-anchor="middle">{tick_label(k * step, step)}</text>')
    out.append(f'<text x="{num(left + plot_width / 2)}" y="{axis_y + 32}" font-size="11" '
               f'text-anchor="middle">time since the first span of the iteration (ms)</text>')
    height = axis_y + 42
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{num(width)}" height="{height}" '
            f'viewBox="0 0 {num(width)} {height}" {FONT}>\n'
            f'<rect class="background" x="0" y="0" width="{num(width)}" height="{height}" fill="#ffffff"/>\n')
    return head + "\n".join(out) + "\n</svg>\n"


def parse(argv):
    p = argparse.ArgumentParser(description="Draw megalite --timeline traces as one SVG picture.")
    p.add_argument("traces", nargs="+", help="Chrome-trace files written by --timeline")
    p.add_argument("-o", "--output", required=True, help="the SVG file to write")
    p.add_argument("--iteration", type=int, default=None,
                   help="draw only this iteration's spans (default: the last one recorded, which is warm)")
    p.add_argument("--title", default=None)
    p.add_argument("--labels", default=None,
                   help="comma-separated panel labels, one per trace (default: the file names)")
    p.add_argument("--width", type=int, default=1000, help="width of the time axis in px")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    labels = args.labels.split(",") if args.labels else [os.path.basename(t) for t in args.traces]
    if len(labels) != len(args.traces):
        raise SystemExit(f"--labels has {len(labels)} labels for {len(args.traces)} traces")
    panels = [Panel(load_events(path), label.strip(), args.iteration) for path, label in zip(args.traces, labels)]
    svg = render(panels, args.title, args.width)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tmp = f"{args.output}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(svg)
    os.replace(tmp, args.output)
    print(f"wrote {args.output}: {len(panels)} panel(s), "
          f"{sum(len(p.spans) for p in panels)} spans, {max(p.length_ms for p in panels):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
