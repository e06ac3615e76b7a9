#!/usr/bin/env python3
"""The generated part of docs/CONFORMANCE.md from script/xfstests.sh's runs.

  report.py --group generic/auto --doc docs/CONFORMANCE.md --tsv docs/conformance/X.tsv
            --exclude ci/xfstests/exclude --commit REV  NAME=RUNDIR...

NAME=RUNDIR: a configuration's name (keel, keel:cache=none, tmpfs, ext4) and its
ci/xfstests/run.sh directory (with results.tsv). The first keel* configurations are keel's.

Writes the per-test matrix to --tsv (test, one status per configuration, keel's reason) and
replaces, in --doc, the text between `<!-- generated GROUP -->` and `<!-- end GROUP -->`
(appended when missing): the counts per configuration, every test some keel configuration
fails (with every configuration's result), and the tests keel does not run, by reason, with
how those tests did on the others. Hand-written notes elsewhere in the doc, as bullets that
start with `- **generic/NNN**`, are linked from the tables; nothing outside the markers is
touched.
"""

import argparse
import collections
import datetime
import os
import re
import sys

STATUS = {"pass": "pass", "fail": "**FAIL**", "notrun": "not run", "excluded": "excluded",
          None: "—"}


def load(rundir):
    rows = collections.OrderedDict()
    with open(os.path.join(rundir, "results.tsv"), encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            while len(parts) < 3:
                parts.append("")
            rows[parts[0]] = (parts[1], parts[2])
    elapsed = None
    p = os.path.join(rundir, "elapsed")
    if os.path.exists(p):
        elapsed = int(open(p).read().strip() or 0)
    return rows, elapsed


def fmt_time(s):
    if s is None:
        return "—"
    return "%dh%02dm" % (s // 3600, s % 3600 // 60) if s >= 3600 else "%dm%02ds" % (s // 60, s % 60)


def anchor(test):
    return test.replace("/", "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", required=True)
    ap.add_argument("--doc", required=True)
    ap.add_argument("--tsv", required=True)
    ap.add_argument("--exclude", required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--subset", help="the runs hold only the group's tests of this kind "
                    "(no-scratch: those that need no scratch device; scratch: the others)")
    ap.add_argument("--only", help="keep only the tests of this group (of --group-list)")
    ap.add_argument("--group-list", help="xfstests' tests/generic/group.list")
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args()
    keep = None
    if a.only:
        keep = set()
        for line in open(a.group_list, encoding="utf-8"):
            f = line.split()
            if f and not f[0].startswith("#") and a.only in f[1:]:
                keep.add("generic/" + f[0])

    names, data, times = [], {}, {}
    for r in a.runs:
        name, _, d = r.partition("=")
        names.append(name)
        data[name], times[name] = load(d)
        if keep is not None:
            data[name] = collections.OrderedDict((t, v) for t, v in data[name].items() if t in keep)
            times[name] = None
    keels = [n for n in names if n.startswith("keel")]
    others = [n for n in names if not n.startswith("keel")]
    names = keels + others
    tests = sorted({t for n in names for t in data[n]})

    doc = open(a.doc, encoding="utf-8").read() if os.path.exists(a.doc) else ""
    label = a.group + (" " + a.only if a.only else "") + (" " + a.subset if a.subset else "")
    begin, end = "<!-- generated %s -->" % label, "<!-- end %s -->" % label
    # Notes are hand-written outside the generated part.
    outside = re.sub(re.escape(begin) + ".*?" + re.escape(end), "", doc, flags=re.S)
    noted = set(re.findall(r"^- \*\*(generic/\d+)\*\*", outside, flags=re.M))

    def st(n, t):
        return data[n].get(t, (None, ""))[0]

    def note(t):
        return "[note](#%s)" % anchor(t) if t in noted else ""

    os.makedirs(os.path.dirname(a.tsv) or ".", exist_ok=True)
    with open(a.tsv, "w", encoding="utf-8") as f:
        f.write("\t".join(["test"] + names + ["reason (keel)"]) + "\n")
        for t in tests:
            reason = next((data[n][t][1] for n in keels if t in data[n] and data[n][t][1]), "")
            f.write("\t".join([t] + [st(n, t) or "" for n in names] + [reason]) + "\n")

    out = [begin, ""]
    when = datetime.date.today().isoformat()
    run = "`script/xfstests.sh --group %s`" % a.group.split("/")[1]
    if a.subset == "no-scratch":
        run = ("the tests of the group that need no scratch device (`script/xfstests.sh "
               "--group %s --no-scratch`)" % a.group.split("/")[1])
    elif a.subset == "scratch":
        run = ("the tests of the group that need a scratch device (`script/xfstests.sh "
               "--group %s --scratch`)" % a.group.split("/")[1])
    elif a.subset and a.subset.startswith("not-"):
        run = ("the tests of the group that are not in the `%s` group (`script/xfstests.sh "
               "--group %s --not-in %s`)" % (a.subset[4:], a.group.split("/")[1], a.subset[4:]))
    elif a.subset:
        run += " (%s)" % a.subset
    if a.only:
        run = "the tests of the `%s` group in %s" % (a.only, run)
    out.append("Generated from %s on %s (keel %s); every test, per configuration: `%s`." % (
        run, when, a.commit, os.path.relpath(a.tsv, os.path.dirname(a.doc))))
    out.append("")
    out.append("| configuration | passed | failed | not run | excluded | time |")
    out.append("|---|---:|---:|---:|---:|---:|")
    for n in names:
        c = collections.Counter(s for s, _ in data[n].values())
        out.append("| %s | %d | %d | %d | %d | %s |" % (
            n, c["pass"], c["fail"], c["notrun"], c["excluded"], fmt_time(times[n])))
    out.append("")

    failed = [t for t in tests if any(st(n, t) == "fail" for n in keels)]
    out.append("**Failed on keel** (%d tests):" % len(failed))
    out.append("")
    if failed:
        out.append("| test | " + " | ".join(names) + " | note |")
        out.append("|---|" + "---|" * len(names) + "---|")
        for t in failed:
            out.append("| %s | %s | %s |" % (t, " | ".join(STATUS[st(n, t)] for n in names), note(t)))
        out.append("")

    # Not run on keel (every keel configuration), by keel's reason.
    by_reason = collections.OrderedDict()
    for t in tests:
        if keels and all(st(n, t) in ("notrun", "excluded") for n in keels):
            reason = data[keels[0]].get(t, ("", ""))[1] or "(no reason given)"
            by_reason.setdefault(reason, []).append(t)
    total = sum(len(v) for v in by_reason.values())
    out.append("**Not run on keel** (%d tests), by xfstests' reason, with how the same tests "
               "did on %s:" % (total, " and ".join(others) or "the others"))
    out.append("")
    out.append("| reason | tests | " + " | ".join(others) + " |")
    out.append("|---|---|" + "---|" * len(others))
    for reason, ts in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        cells = []
        for n in others:
            c = collections.Counter(st(n, t) for t in ts)
            cells.append(", ".join("%d %s" % (c[k], STATUS[k].strip("*").lower())
                                   for k in ("pass", "fail", "notrun", "excluded", None) if c[k]))
        names_cell = " ".join(t.split("/")[1] + (" " + note(t) if note(t) else "") for t in ts)
        out.append("| %s | %d: %s | %s |" % (reason.replace("|", "\\|"), len(ts), names_cell,
                                            " | ".join(cells)))
    out.append("")

    # Tests a keel configuration passes that another keel configuration does not run or
    # fails are in the tables above; tests every configuration but keel fails are listed for
    # completeness.
    other_fail = [t for t in tests if t not in failed and any(st(n, t) == "fail" for n in others)]
    if other_fail:
        out.append("**Failed on %s but not on keel**: %s" % (
            " or ".join(others), " ".join(
                "%s (%s)" % (t, ", ".join(n for n in others if st(n, t) == "fail"))
                for t in other_fail)))
        out.append("")
    out.append(end)
    gen = "\n".join(out)

    if begin in doc and end in doc:
        doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda m: gen, doc, flags=re.S)
    else:
        doc = doc.rstrip("\n") + "\n\n" + gen + "\n"
    with open(a.doc, "w", encoding="utf-8") as f:
        f.write(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
