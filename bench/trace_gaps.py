"""Where the compute stream waits, from a Chrome trace that `bench/throughput.py --profile-steps A-B --profile-trace
DIR` wrote (no GPU needed to read one).

Every gap of at least `--min-us` between two kernels on the busiest stream, inside a profiled step, is put in one of
two kinds, by when the host launched the kernel that ends it:

- **host late**: launched after the gap began. The GPU had nothing queued; the report names the host operators that
  ran between the gap's start and the launch (what the host was busy with).
- **waited**: launched before the gap began, so it was queued and held back by a dependency, in this training a wait
  on another stream's event (a copy). The report names what ran on the other streams during the gap.

    python3 bench/trace_gaps.py TRACE.json.gz [--min-us 20] [--top 15]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # microseconds
    end: float
    stream: int = -1
    correlation: int = -1


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def spans(events: list[dict], categories: tuple[str, ...]) -> list[Span]:
    found = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in categories:
            args = e.get("args", {})
            found.append(
                Span(
                    e["name"],
                    float(e["ts"]),
                    float(e["ts"]) + float(e.get("dur", 0)),
                    int(args.get("stream", -1)),
                    int(args.get("correlation", -1)),
                )
            )
    return sorted(found, key=lambda s: s.start)


def short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def analyse(path: Path, min_us: float, top: int) -> None:
    events = load(path)
    device = spans(events, DEVICE_CATEGORIES)
    launches = {s.correlation: s for s in spans(events, ("cuda_runtime", "cuda_driver")) if s.correlation >= 0}
    host_ops = [s for s in spans(events, ("cpu_op", "user_annotation")) if not s.name.startswith("hb_step_")]
    steps = [s for s in spans(events, ("user_annotation",)) if s.name.startswith("hb_step_")]
    busy_by_stream: Counter[int] = Counter()
    for s in device:
        busy_by_stream[s.stream] += s.end - s.start
    compute = busy_by_stream.most_common(1)[0][0]
    others = [s for s in device if s.stream != compute]
    print(f"streams (busy ms): {', '.join(f'{k}: {v / 1e3:.1f}' for k, v in busy_by_stream.most_common())}")
    print(f"compute stream: {compute}")

    kernels = [s for s in device if s.stream == compute]
    host_starts = [s.start for s in host_ops]
    for step in steps:
        inside = [k for k in kernels if step.start <= k.start < step.end]
        gaps = [(b.start - a.end, a, b) for a, b in zip(inside, inside[1:], strict=False) if b.start - a.end >= min_us]
        late: Counter[str] = Counter()
        waited: Counter[str] = Counter()
        late_us = waited_us = 0.0
        listed = []
        for gap, before, after in gaps:
            launch = launches.get(after.correlation)
            if launch is not None and launch.start > before.end:
                late_us += gap
                # What the host ran between the gap's start and this launch: the top-level operators begun then.
                first = bisect.bisect_left(host_starts, before.end)
                last = bisect.bisect_left(host_starts, launch.start)
                names = {op.name for op in host_ops[first : min(last, first + 200)]}
                for name in names or {"(no operator: Python or the allocator)"}:
                    late[name] += gap / max(1, len(names))
                listed.append((gap, "host late", before, after, ", ".join(sorted(names)[:4])))
            else:
                waited_us += gap
                during = [o for o in others if o.start < after.start and o.end > before.end]
                key = ", ".join(sorted({short(o.name, 40) for o in during})) or "(nothing on other streams)"
                waited[key] += gap
                listed.append((gap, "waited", before, after, key))
        wall = step.end - step.start
        busy = sum(k.end - k.start for k in inside)
        print(
            f"\n## {step.name}: wall {wall / 1e3:.1f} ms, compute stream busy {busy / 1e3:.1f} ms, "
            f"{len(gaps)} gaps >= {min_us:.0f} us: host late {late_us / 1e3:.1f} ms, waited {waited_us / 1e3:.1f} ms, "
            f"smaller gaps {(wall - busy - late_us - waited_us) / 1e3:.1f} ms (step start/end included)"
        )
        print("host late, by host operator begun in the gap (ms):")
        for name, us in late.most_common(top):
            print(f"  {us / 1e3:7.2f}  {short(name)}")
        print("waited, by what ran on other streams (ms):")
        for name, us in waited.most_common(top):
            print(f"  {us / 1e3:7.2f}  {short(name, 90)}")
        print(f"largest {top} gaps:")
        for gap, kind, before, after, context in sorted(listed, key=lambda item: -item[0])[:top]:
            at = (before.end - step.start) / 1e3
            print(f"  {gap / 1e3:6.2f} ms at {at:6.1f} ms, {kind}: {short(before.name, 40)} -> {short(after.name, 40)}")
            print(f"      {short(context, 110)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--min-us", type=float, default=20.0)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    analyse(args.trace, args.min_us, args.top)


if __name__ == "__main__":
    main()
