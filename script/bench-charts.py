#!/usr/bin/env python3
"""bench-charts: one SVG chart per benchmark from the raw samples in bench-results/.

    script/bench-charts.py [--res DIR] [--out DIR] [NAME...]

Reads DIR/NAME.tsv (the samples fs-bench, fio-bench, npm-bench and scale-bench write with
--out; DIR defaults to bench-results) and writes OUT/NAME.svg (default DIR/charts): one row
per scenario, a bar for keel/ext4 and one for keel/tmpfs (where that target ran), on a log
scale around 1.0, each with its value printed. Medians are taken the way each script takes
them, so a chart shows the numbers of the table beside it; row names come from the
table in DIR/NAME.md (fs-bench numbers its scenarios in the TSV). A benchmark whose TSV is
missing or unreadable is skipped with one line on stderr; the exit status is 0 unless an
argument is wrong. Python standard library only.
"""
import html
import math
import os
import statistics
import subprocess
import sys

# name: (kind, title); the order is script/bench-all's.
CHARTS = {
    "fs": ("fs", "fs-bench: keel (default, passthrough)"),
    "fs-wb": ("fs", "fs-bench: keel --passthrough off (writeback cache)"),
    "fs-old": ("fs", "fs-bench: this keel beside the pre-fuser keel"),
    "floor": ("fs", "fs-bench --floor: metadata and git rows"),
    "fio": ("fio", "fio: the disk study's four jobs"),
    "fio-wb": ("fio", "fio: passthrough vs --passthrough off"),
    "npm": ("npm", "npm install of 8 packages"),
    "scale": ("scale", "scale-bench: {files} files of {size} B"),
}
BASES = ("ext4", "tmpfs")
COLOURS = {"ext4": "#3a6ea5", "tmpfs": "#d9822b"}


class Skip(Exception):
    """A chart that cannot be drawn from what is in bench-results (reason in the message)."""


def read_tsv(path):
    """The header comments and the sample rows (lists of fields) of one TSV."""
    if not os.path.exists(path):
        raise Skip(f"no {os.path.basename(path)}")
    head, rows = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("#"):
                head.append(line[1:].strip())
            elif line:
                rows.append(line.split("\t"))
    if not rows:
        raise Skip(f"{os.path.basename(path)} has no samples")
    return head, rows


def table_names(md_path, column0):
    """The first column of the first markdown table in md_path whose header starts column0."""
    if not os.path.exists(md_path):
        return []
    names, inside = [], False
    with open(md_path, encoding="utf-8") as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not line.startswith("|"):
                if inside:
                    break
                continue
            if not inside:
                inside = cells[0] == column0
                continue
            if not set(cells[0]) <= set("-: "):
                names.append(cells[0])
    return names


def num(x):
    try:
        return float(x)
    except ValueError:
        return None


def fs_rows(res, name):
    """fs-bench samples `index<TAB>target<TAB>ms`: median ms per scenario and target."""
    _, rows = read_tsv(os.path.join(res, name + ".tsv"))
    data = {}
    for r in rows:
        if len(r) != 3 or r[0] == "cpu" or num(r[2]) is None:
            continue
        data.setdefault(r[0], {}).setdefault(r[1], []).append(float(r[2]))
    names = table_names(os.path.join(res, name + ".md"), "scenario")
    out = []
    for k, i in enumerate(sorted(data, key=int)):
        label = names[k] if k < len(names) else f"scenario {i}"
        med = {t: statistics.median(v) for t, v in data[i].items()}
        out.append((label, med.get("keel"), {b: med.get(b) for b in BASES}))
    return out, "time (below 1 = keel faster)"


FIO_JOBS = {"seqwrite": ("seq write 1M, iodepth 8", 2), "seqread": ("seq read 1M, iodepth 8", 2),
            "randwrite": ("rand write 4k, iodepth 32", 3),
            "randread": ("rand read 4k, iodepth 32", 3)}


def fio_rows(res, name):
    """fio-bench samples `job<TAB>target<TAB>MB/s<TAB>IOPS<TAB>clat`: MB/s for the sequential
    jobs, IOPS for the random ones (as its table), for keel and keel-wb."""
    _, rows = read_tsv(os.path.join(res, name + ".tsv"))
    data = {}
    for r in rows:
        if len(r) < 4 or r[0] not in FIO_JOBS:
            continue
        v = num(r[FIO_JOBS[r[0]][1]])
        if v is not None:
            data.setdefault(r[0], {}).setdefault(r[1], []).append(v)
    out = []
    for job in FIO_JOBS:
        if job not in data:
            continue
        med = {t: statistics.median(v) for t, v in data[job].items()}
        for k in ("keel", "keel-wb"):
            if k in med:
                out.append((f"{FIO_JOBS[job][0]} ({k})", med[k], {b: med.get(b) for b in BASES}))
    return out, "throughput (above 1 = keel faster)"


def npm_rows(res, name):
    """npm-bench samples `target<TAB>seconds<TAB>peak KiB`: median install time."""
    _, rows = read_tsv(os.path.join(res, name + ".tsv"))
    data = {}
    for r in rows:
        if len(r) >= 2 and num(r[1]) is not None:
            data.setdefault(r[0], []).append(float(r[1]))
    med = {t: statistics.median(v) for t, v in data.items()}
    out = [(f"npm install ({k})", med[k], {b: med.get(b) for b in BASES})
           for k in ("keel", "keel-wb") if k in med]
    return out, "time (below 1 = keel faster)"


def scale_rows(res, name):
    """scale-bench rows (a header line, then files, size, step, keel_s, ext4_s, tmpfs_s, rss):
    the steps that ext4 and tmpfs have too."""
    _, rows = read_tsv(os.path.join(res, name + ".tsv"))
    head, out = rows[0], []
    col = {h: i for i, h in enumerate(head)}
    if not {"step", "keel_s", "ext4_s", "tmpfs_s"} <= set(col):
        raise Skip(f"{name}.tsv has no step/keel_s/ext4_s/tmpfs_s header")
    for r in rows[1:]:
        get = lambda c: num(r[col[c]]) if col[c] < len(r) and r[col[c]] else None
        keel, base = get("keel_s"), {"ext4": get("ext4_s"), "tmpfs": get("tmpfs_s")}
        if keel is not None and any(base.values()):
            out.append((r[col["step"]], keel, base))
    return out, "time (below 1 = keel faster)"


def title_of(res, name, title):
    """The chart's title; scale-bench's names the file count and size of its run."""
    if "{files}" not in title:
        return title
    _, rows = read_tsv(os.path.join(res, name + ".tsv"))
    col = {h: i for i, h in enumerate(rows[0])}
    first = rows[1] if len(rows) > 1 else []
    get = lambda c: first[col[c]] if c in col and col[c] < len(first) else "?"
    files = get("files")
    return title.format(files=f"{int(files):,}" if files.isdigit() else files, size=get("size"))


KINDS = {"fs": fs_rows, "fio": fio_rows, "npm": npm_rows, "scale": scale_rows}


def provenance(res, name, head):
    """`data DATE, commit HASH`: DATE from NAME.date (or the TSV header), HASH the commit that
    recorded the TSV, or HEAD when the TSV is new or changed since (a run not yet committed)."""
    date = ""
    p = os.path.join(res, name + ".date")
    if os.path.exists(p):
        date = open(p, encoding="utf-8").read().strip()
    elif head and len(head[0].split()) > 1 and head[0].split()[1][:4].isdigit():
        date = head[0].split()[1][:10]
    # Absolute: git runs in `res`, and a relative path would be taken from there.
    tsv = os.path.abspath(os.path.join(res, name + ".tsv"))

    def git(*a):
        r = subprocess.run(["git", "-C", res, *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""
    changed = subprocess.run(["git", "-C", res, "diff", "--quiet", "HEAD", "--", tsv],
                             capture_output=True).returncode != 0
    commit = "" if changed else git("log", "-1", "--format=%h", "--", tsv)
    commit = commit or (git("rev-parse", "--short", "HEAD") + " (not yet committed)"
                        if git("rev-parse", "--short", "HEAD") else "")
    return ", ".join(x for x in (f"data {date}" if date else "",
                                 f"commit {commit}" if commit else "") if x)


def svg(title, sub, rows):
    """A horizontal bar chart of keel/base per row on a log scale centred on 1.0 (keel's
    measure over the base's: a time or a throughput, as `sub` says)."""
    ratios = [k / b for _, k, bases in rows for b in bases.values() if k and b]
    if not ratios:
        raise Skip("no row has keel and ext4 or tmpfs")
    # Whole decades, with room beyond the extreme bars for their labels.
    lo = math.floor(math.log10(min(min(ratios), 0.5) * 0.6))
    hi = math.ceil(math.log10(max(max(ratios), 2.0) * 1.7))
    label_w, plot_w, right = 300, 460, 70
    bar_h, gap = 14, 10
    present = [b for b in BASES if any(r[2].get(b) for r in rows)]
    row_h = bar_h * len(present) + gap
    top = 74
    height = top + row_h * len(rows) + 40
    width = label_w + plot_w + right
    x = lambda v: label_w + (math.log10(v) - lo) / (hi - lo) * plot_w
    esc = html.escape
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
         f'<rect width="{width}" height="{height}" fill="white"/>',
         f'<text x="10" y="20" font-size="15" font-weight="bold">{esc(title)}</text>',
         f'<text x="10" y="38" fill="#444">{esc(sub)}</text>']
    lx = 10
    for b in present:
        o.append(f'<rect x="{lx}" y="48" width="12" height="12" fill="{COLOURS[b]}"/>')
        o.append(f'<text x="{lx + 16}" y="58">keel/{b}</text>')
        lx += 100
    for p in range(lo, hi + 1):
        v = 10 ** p
        xv = x(v)
        o.append(f'<line x1="{xv:.1f}" y1="{top - 4}" x2="{xv:.1f}" y2="{height - 32}" '
                 f'stroke="{"#000" if p == 0 else "#ccc"}" stroke-width="{1.5 if p == 0 else 1}"/>')
        o.append(f'<text x="{xv:.1f}" y="{height - 16}" text-anchor="middle">'
                 f'{v:g}x</text>')
    for n, (label, keel, bases) in enumerate(rows):
        y0 = top + n * row_h
        o.append(f'<text x="{label_w - 8}" y="{y0 + row_h / 2:.1f}" text-anchor="end" '
                 f'dominant-baseline="middle">{esc(label)}</text>')
        for m, b in enumerate(present):
            y = y0 + m * bar_h
            base = bases.get(b)
            if not keel or not base:
                o.append(f'<text x="{x(1) + 4:.1f}" y="{y + bar_h - 3}" fill="#888">'
                         f'no {esc(b)}</text>')
                continue
            r = keel / base
            x1, x2 = sorted((x(1), x(r)))
            o.append(f'<rect x="{x1:.1f}" y="{y + 1}" width="{max(x2 - x1, 1):.1f}" '
                     f'height="{bar_h - 2}" fill="{COLOURS[b]}"><title>keel/{esc(b)} '
                     f'{r:.2f}x</title></rect>')
            # The value outside the bar's far end: left of a bar below 1, right of one above.
            o.append(f'<text x="{x1 - 4:.1f}" y="{y + bar_h - 3}" text-anchor="end">{r:.2f}x</text>'
                     if r < 1 else f'<text x="{x2 + 4:.1f}" y="{y + bar_h - 3}">{r:.2f}x</text>')
    o.append('</svg>')
    return "\n".join(o) + "\n"


def main(argv):
    res = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench-results")
    out, names = None, []
    args = list(argv)
    while args:
        a = args.pop(0)
        if a in ("--res", "--out") and args:
            v = args.pop(0)
            res, out = (v, out) if a == "--res" else (res, v)
        elif a in ("-h", "--help"):
            print(__doc__.strip())
            return 0
        elif a in CHARTS:
            names.append(a)
        else:
            print(f"bench-charts: unknown argument {a!r} (benchmarks: {' '.join(CHARTS)})",
                  file=sys.stderr)
            return 2
    res = os.path.normpath(res)
    out = out or os.path.join(res, "charts")
    os.makedirs(out, exist_ok=True)
    for name in names or CHARTS:
        kind, title = CHARTS[name]
        try:
            head, _ = read_tsv(os.path.join(res, name + ".tsv"))
            rows, unit = KINDS[kind](res, name)
            sub = f"keel/ext4 and keel/tmpfs, {unit}, log scale; {provenance(res, name, head)}"
            text = svg(title_of(res, name, title), sub, rows)
        except (Skip, OSError, IndexError, ValueError) as e:
            print(f"bench-charts: {name}: skipped: {e}", file=sys.stderr)
            continue
        with open(os.path.join(out, name + ".svg"), "w", encoding="utf-8") as f:
            f.write(text)
        print(f"bench-charts: {name}: {os.path.join(out, name + '.svg')} ({len(rows)} rows)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
