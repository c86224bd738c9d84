"""Summarises the logs of ``scripts/collective_trace/sitecustomize.py`` (its docstring says how
to make them): per process log, the dispatches of programs with collectives, the overlaps and
``process_allgather`` calls, then each overlap and call by program and caller, most frequent
first.

    python scripts/collective_trace/summary.py /tmp/trace [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re

_DISPATCH = re.compile(r"^\d+\.\d+ #\d+ (\S+) devices=.* caller=(.*)$")
_OVERLAP = re.compile(r"^OVERLAP #\d+ (\S+) while in flight: (.*)$")


def summarize(trace_dir: pathlib.Path) -> dict:
    files, overlaps, allgathers = {}, collections.Counter(), collections.Counter()
    for path in sorted(trace_dir.glob("trace.*.log")):
        counts = collections.Counter()
        caller = ""
        for line in path.read_text(errors="replace").splitlines():
            if m := _DISPATCH.match(line):
                counts["dispatches"] += 1
                caller = m.group(2)
            elif m := _OVERLAP.match(line):
                counts["overlaps"] += 1
                in_flight = sorted({name for name in re.findall(r"'([^']+)'", m.group(2))})
                overlaps[f"{m.group(1)} beside {', '.join(in_flight)} | {caller}"] += 1
            elif line.startswith("PROCESS_ALLGATHER caller="):
                counts["process_allgather"] += 1
                allgathers[line.split("caller=", 1)[1]] += 1
        files[path.name] = dict(counts)
    return {
        "files": files,
        "dispatches": sum(f.get("dispatches", 0) for f in files.values()),
        "overlaps": sum(overlaps.values()),
        "process_allgather": sum(allgathers.values()),
        "overlaps_by_site": overlaps.most_common(),
        "process_allgather_by_site": allgathers.most_common(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", type=pathlib.Path)
    parser.add_argument("--json", type=pathlib.Path, help="also write the summary here")
    args = parser.parse_args(argv)
    out = summarize(args.trace_dir)
    print(
        f"{len(out['files'])} logs: {out['dispatches']} dispatches of programs with "
        f"collectives, {out['overlaps']} overlapping, {out['process_allgather']} "
        "process_allgather calls"
    )
    for site, n in out["overlaps_by_site"]:
        print(f"  {n:5d} overlap  {site}")
    for site, n in out["process_allgather_by_site"]:
        print(f"  {n:5d} process_allgather  {site}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
