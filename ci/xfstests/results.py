#!/usr/bin/env python3
"""Reads the results of ci/xfstests/run.sh runs.

  results.py tsv OUT EXCLUDE        one line per test: name, pass|fail|notrun|excluded, reason
  results.py failures OUT [N]       each failed test's diff (.out.bad against .out) and the
                                    last N lines (default 40) of its .full
  results.py summary OUT            "P passed, F failed, N not run" of OUT/results.tsv

Sources: xfstests' xunit report (OUT/results/result.xml: status and not-run message of each
test) and ./check's output (OUT/check.log: tests it expunged, and tests it started when the
run was cut short, which have no xunit entry: those count as failed).
"""

import os
import re
import sys
import xml.etree.ElementTree as ET

TEST = re.compile(r"^([a-z0-9]+/[0-9]+)\b(.*)$")


def exclusions(path):
    """test name -> why it is excluded (the comment on its line in the exclude file)."""
    out = {}
    if not path or not os.path.exists(path):
        return out
    for line in open(path, encoding="utf-8"):
        m = re.match(r"^\s*([a-z0-9]+/[0-9]+)\s*(?:#\s*(.*))?$", line)
        if m:
            out[m.group(1)] = (m.group(2) or "excluded").strip()
    return out


def first_added(diff):
    """The first line the test printed that the expected output lacks (a diff's first `+`)."""
    for line in (diff or "").splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            line = re.sub(r"\S*/tests/([a-z0-9]+/\d+)", r"\1", one_line(line[1:]))
            if line:
                return line[:120]
    return ""


def one_line(s):
    return " ".join((s or "").split())


def read(out, exclude=None):
    """[(test, status, reason)] in the order ./check ran them."""
    why_excluded = exclusions(exclude)
    results = {}
    xml = os.path.join(out, "results", "result.xml")
    if os.path.exists(xml):
        for tc in ET.parse(xml).getroot().iter("testcase"):
            name = tc.get("name")
            skipped, failure = tc.find("skipped"), tc.find("failure")
            if failure is not None:
                msg = one_line(failure.get("message")).replace(out + "/", "")
                msg = re.sub(r"\s*\(see [^)]*\)", "", msg).lstrip("- ")
                err = tc.find("system-err")
                first = first_added(err.text if err is not None else "")
                results[name] = ("fail", msg + (": " + first if first else ""))
            elif skipped is not None:
                results[name] = ("notrun", one_line(skipped.get("message")))
            else:
                results[name] = ("pass", "")
    order = []
    log = os.path.join(out, "check.log")
    if os.path.exists(log):
        for line in open(log, encoding="utf-8", errors="replace"):
            m = TEST.match(line.strip())
            if not m:
                continue
            name, rest = m.groups()
            if name not in order:
                order.append(name)
            if "[expunged]" in rest:
                results[name] = ("excluded", why_excluded.get(name, "excluded"))
    guard = os.path.join(out, "hang-guard.log")
    if os.path.exists(guard):
        for line in open(guard, encoding="utf-8", errors="replace"):
            m = re.search(r"\./(\d+)\b", line)
            for name in order:
                if m and name.endswith("/" + m.group(1)) and results.get(name, ("",))[0] == "fail":
                    results[name] = ("fail", "killed by the hang guard (ran over its time); "
                                     + results[name][1])
    for name in results:
        if name not in order:
            order.append(name)
    return [(n,) + results.get(n, ("fail", "the run ended before this test finished"))
            for n in order]


def counts(rows):
    c = {"pass": 0, "fail": 0, "notrun": 0, "excluded": 0}
    for _, status, _ in rows:
        c[status] += 1
    return c


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, out = argv[1], argv[2]
    if cmd == "tsv":
        for row in read(out, argv[3] if len(argv) > 3 else None):
            print("\t".join(row))
    elif cmd == "summary":
        rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(out, "results.tsv"))]
        c = counts(rows)
        print("%d passed, %d failed, %d not run" % (c["pass"], c["fail"],
                                                     c["notrun"] + c["excluded"]))
    elif cmd == "failures":
        tail = int(argv[3]) if len(argv) > 3 else 40
        rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(out, "results.tsv"))]
        res = os.path.join(out, "results")
        xml = os.path.join(res, "result.xml")
        diffs = {}
        if os.path.exists(xml):
            for tc in ET.parse(xml).getroot().iter("testcase"):
                err = tc.find("system-err")
                if err is not None and err.text:
                    diffs[tc.get("name")] = err.text.strip("\n")
        for name, status, reason in rows:
            if status != "fail":
                continue
            print("---- %s: %s" % (name, reason))
            if name in diffs:
                print(diffs[name])
            full = os.path.join(res, name + ".full")
            if os.path.exists(full):
                lines = open(full, encoding="utf-8", errors="replace").read().splitlines()
                print("-- last %d lines of %s.full:" % (min(tail, len(lines)), name))
                print("\n".join(lines[-tail:]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
