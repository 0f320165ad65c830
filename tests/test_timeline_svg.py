"""scripts/timeline_svg.py: a --timeline trace drawn as an SVG (one lane per rank and row, spans
coloured by category, panels of several files on one time scale), and Timeline's 5-element spans
that name their own row."""
import json
import socket
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch.distributed as dist

from megalite.metrics import Timeline

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import timeline_svg  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"


def span(name, cat, pid, tid, ts_ms, dur_ms, iteration):
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts_ms * 1000.0,
            "dur": dur_ms * 1000.0, "args": {"iteration": iteration}}


def synthetic_trace(scale: float = 1.0) -> dict:
    """Two ranks; rank 0 also has an ep-comm row. Iteration 0 (cold) then iteration 1 at 100 ms."""
    events = []
    for it, t0 in ((0, 0.0), (1, 100.0)):
        events += [
            span("F mb0", "forward", 0, 0, t0 + 0 * scale, 10 * scale, it),
            span("B mb0 <&>", "backward", 0, 0, t0 + 12 * scale, 20 * scale, it),
            span("all-to-all", "ep-comm", 0, 2, t0 + 5 * scale, 4 * scale, it),
            span("send/recv", "p2p", 1, 0, t0 + 10 * scale, 2 * scale, it),
            span("W mb0", "weight-grad", 1, 0, t0 + 14 * scale, 6 * scale, it),
            span("reduce", "grad-reduce", 1, 0, t0 + 30 * scale, 8 * scale, it),
            span("mystery", "something-new", 1, 0, t0 + 40 * scale, 1 * scale, it),
        ]
    events.append({"name": "comm bytes", "ph": "C", "pid": 0, "tid": 0, "ts": 0.0, "args": {"tp": 5}})
    events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": 2,
                   "args": {"name": "expert-parallel all-to-alls (in flight)"}})
    for rank in (0, 1):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} (pp {rank})"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def draw(tmp_path, traces, *extra) -> ET.Element:
    paths = []
    for i, trace in enumerate(traces):
        path = tmp_path / f"trace{i}.json"
        path.write_text(json.dumps(trace))
        paths.append(str(path))
    out = tmp_path / "step.svg"
    assert timeline_svg.main([*paths, "-o", str(out), *extra]) == 0
    return ET.parse(out).getroot()  # parses: well-formed XML, special characters escaped


def span_rects(root):
    return [r for r in root.iter(f"{SVG}rect") if r.get("class") == "span"]


def texts(root, cls=None):
    return ["".join(t.itertext()) for t in root.iter(f"{SVG}text") if cls is None or t.get("class") == cls]


def test_one_coloured_rect_per_span_of_the_last_iteration_on_a_common_axis(tmp_path):
    root = draw(tmp_path, [synthetic_trace()], "--title", "a <step> & more")
    rects = span_rects(root)
    assert len(rects) == 7  # iteration 1 only: the default is the last, warm one
    by_name = {r.find(f"{SVG}title").text.split(" (")[0]: r for r in rects}
    assert by_name["F mb0"].get("fill") == timeline_svg.CATEGORY_COLOURS["forward"]
    assert by_name["B mb0 <&>"].get("fill") == timeline_svg.CATEGORY_COLOURS["backward"]
    assert by_name["send/recv"].get("fill") == timeline_svg.CATEGORY_COLOURS["p2p"]
    assert by_name["W mb0"].get("fill") == timeline_svg.CATEGORY_COLOURS["weight-grad"]
    assert by_name["all-to-all"].get("fill") == timeline_svg.COMM_COLOUR
    assert by_name["mystery"].get("fill") == timeline_svg.OTHER_COLOUR
    # The axis starts at the iteration's first span (F at 100 ms) and ends at its last end (41 ms).
    x = {n: float(r.get("x")) for n, r in by_name.items()}
    w = {n: float(r.get("width")) for n, r in by_name.items()}
    px_per_ms = w["B mb0 <&>"] / 20
    assert w["F mb0"] == pytest.approx(10 * px_per_ms, abs=0.01)
    assert px_per_ms == pytest.approx(1000 / 41, abs=0.01)  # default --width 1000 over 41 ms
    assert x["B mb0 <&>"] - x["F mb0"] == pytest.approx(12 * px_per_ms, abs=0.02)
    assert x["reduce"] - x["F mb0"] == pytest.approx(30 * px_per_ms, abs=0.02)
    # Lanes: rank 0's compute row, its ep-comm row named from thread_name, rank 1's compute row.
    assert texts(root, "lane-label") == ["rank 0 (pp 0)", "rank 0 (pp 0): expert-parallel all-to-alls (in flight)",
                                         "rank 1 (pp 1)"]
    lane_y = {float(r.get("y")) for r in root.iter(f"{SVG}rect") if r.get("class") == "lane"}
    assert float(by_name["all-to-all"].get("y")) - 1 in lane_y
    assert "a <step> & more" in texts(root)
    assert "0" in texts(root, "tick") and "40" in texts(root, "tick")
    assert "p2p / send-recv" in texts(root)  # the legend


def test_iteration_selects_the_spans(tmp_path):
    root = draw(tmp_path, [synthetic_trace()], "--iteration", "0")
    assert len(span_rects(root)) == 7
    assert texts(root, "panel") == ["trace0.json (iteration 0, 41.0 ms)"]
    with pytest.raises(SystemExit, match="no spans of iteration 5"):
        draw(tmp_path, [synthetic_trace()], "--iteration", "5")


def test_two_files_stack_with_their_labels_on_one_time_scale(tmp_path):
    root = draw(tmp_path, [synthetic_trace(), synthetic_trace(scale=0.5)], "--labels", "without overlap,with overlap")
    assert texts(root, "panel") == ["without overlap (iteration 1, 41.0 ms)", "with overlap (iteration 1, 20.5 ms)"]
    rects = span_rects(root)
    assert len(rects) == 14
    first, second = rects[:7], rects[7:]
    assert min(float(r.get("y")) for r in second) > max(float(r.get("y")) for r in first)  # stacked
    forward = [r for r in rects if r.get("data-cat") == "forward"]
    assert float(forward[1].get("width")) == pytest.approx(float(forward[0].get("width")) / 2, abs=0.01)
    assert forward[0].get("x") == forward[1].get("x")  # each panel starts at its own first span
    assert len(texts(root, "lane-label")) == 6


def test_same_input_gives_the_same_bytes(tmp_path):
    draw(tmp_path, [synthetic_trace()])
    first = (tmp_path / "step.svg").read_bytes()
    draw(tmp_path, [synthetic_trace()])
    assert (tmp_path / "step.svg").read_bytes() == first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_timeline_puts_a_five_element_span_on_its_row_and_names_it(tmp_path):
    path = tmp_path / "trace.json"
    timeline = Timeline(str(path), 1)
    timeline.add(0, 0, [("B mb0", "backward", 1.0, 0.5),
                        ("F mb1", "forward", 1.1, 0.2, 3),
                        ("all-to-all", "ep-comm", 1.2, 0.1),
                        ("gather", "zero-gather", 1.0, 0.1)])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        timeline.write({0: "rank 0"})
    finally:
        dist.destroy_process_group()
    events = json.loads(path.read_text())["traceEvents"]
    tid = {e["name"]: e["tid"] for e in events if e["ph"] == "X"}
    assert tid == {"B mb0": 0, "F mb1": 3, "all-to-all": 2, "gather": 1}
    rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert rows == {1: "ZeRO-3 parameter all-gathers (launch to completion)",
                    2: "collectives in flight (launch to completion)",
                    3: "second lane: the overlapped pair's forward"}
