//! keel's layers point one way: `cli → boot/run/supervisor/control/shutdown → workspace,
//! persist → config/state/meta/chunk → sys/logging/progress/time/random`. This test reads
//! every `crate::` path in `init/src` (outside comments; groups over several lines and
//! nested groups included) and every `super::` chain that climbs to the crate root, and fails on an edge that points up
//! a layer, on an import between `workspace` and `persist` (siblings: the start sequence
//! that joins them lives above both), and on a circle between top-level modules. Edges not
//! yet fixed are listed in `KNOWN` with the reason; the test also fails when one of them is
//! gone, so the list only shrinks.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level module → layer; higher layers may import lower ones, never the reverse.
const LAYERS: &[(&str, u8)] = &[
    ("cli", 5),
    ("main", 5),
    ("boot", 4),
    ("run", 4),
    ("supervisor", 4),
    ("exec", 4),
    ("files", 4),
    ("control", 4),
    ("shutdown", 4),
    ("workspace", 3),
    ("persist", 3),
    ("meta", 2),
    ("chunk", 2),
    ("config", 2),
    ("state", 2),
    ("sys", 1),
    ("logging", 1),
    ("progress", 1),
    ("time", 1),
    ("random", 1),
    ("budget", 1),
];

/// Same-layer modules that must not import each other at all.
const SIBLINGS: &[(&str, &str)] = &[("workspace", "persist"), ("persist", "workspace")];

/// Edges that break the rule today (from, to, where and why). Empty since issue 27 moved
/// the start sequence into `boot/` and `keel checkpoint`'s HTTP fallback into `control`;
/// an entry added here must say where and why, and the test fails once it is gone.
const KNOWN: &[(&str, &str, &str)] = &[];

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a source file belongs to (`workspace/fs/lazy.rs` → `workspace`).
fn module_of(root: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(root).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// The text without its `//` comments (string literals are not told apart: a `//` inside
/// one cuts the rest of its line, which can only hide an import, never invent one).
fn without_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        out.push_str(match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        });
        out.push('\n');
    }
    out
}

/// The leading identifier of `s` (after whitespace).
fn ident(s: &str) -> String {
    s.trim_start()
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The first names of a path or a `{…}` group at the start of `tail` (after `crate::` or a
/// climb to the crate root): `a::b` names `a`; `{a, b::{c, d}}` names `a` and `b`, however
/// rustfmt wrapped the group over lines.
fn first_names(tail: &str, out: &mut BTreeSet<String>) {
    let tail = tail.trim_start();
    let Some(group) = tail.strip_prefix('{') else {
        let n = ident(tail);
        if !n.is_empty() {
            out.insert(n);
        }
        return;
    };
    // Split at the commas of this group's own level, up to its closing brace.
    let (mut depth, mut item) = (0usize, String::new());
    for c in group.chars() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                first_names(&std::mem::take(&mut item), out);
                continue;
            }
            _ => {}
        }
        item.push(c);
    }
    first_names(&item, out);
}

/// Every top-level module `text` (the file `rel` below `src/`, e.g. `workspace/fs/lazy.rs`)
/// names outside `//` comments: through `crate::` paths, and through `super::` chains that
/// climb to the crate root (`super::super::persist` in `workspace/fs.rs`). A file's module
/// depth is its path's; a climb from inside an inline `mod` is counted from the file, so a
/// name is kept only when it is a top-level module (`tops`).
fn crate_refs_in(text: &str, rel: &Path, tops: &BTreeSet<String>) -> BTreeSet<String> {
    let code = without_comments(text);
    let mut out = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        first_names(&rest[i + "crate::".len()..], &mut out);
        rest = &rest[i + "crate::".len()..];
    }
    // The file's depth below the crate root: `a.rs` and `a/mod.rs` are 1, `a/b.rs` 2.
    let mut depth = rel.components().count();
    if rel.file_name().is_some_and(|f| f == "mod.rs") {
        depth -= 1;
    }
    let bytes = code.as_bytes();
    let mut at = 0;
    while let Some(i) = code[at..].find("super::") {
        let start = at + i;
        let preceded = start > 0
            && (bytes[start - 1].is_ascii_alphanumeric()
                || bytes[start - 1] == b'_'
                || bytes[start - 1] == b':');
        let mut end = start;
        let mut climbs = 0;
        while code[end..].starts_with("super::") {
            climbs += 1;
            end += "super::".len();
        }
        if !preceded && climbs >= depth {
            first_names(&code[end..], &mut out);
        }
        at = end;
    }
    out.retain(|n| tops.contains(n));
    out
}

/// Every `crate::NAME` in `text` (a file directly below `src/`, where `super::` is the crate
/// root too) that names a module of `tops`.
fn crate_refs(text: &str, tops: &BTreeSet<String>) -> BTreeSet<String> {
    crate_refs_in(text, Path::new("x.rs"), tops)
}

/// The crate's top-level modules (files and directories directly below `src/`).
fn top_modules() -> BTreeSet<String> {
    std::fs::read_dir(src_dir())
        .unwrap()
        .map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().to_string();
            name.trim_end_matches(".rs").to_string()
        })
        .filter(|n| n != "lib" && n != "main")
        .collect()
}

/// Module → modules it imports (self-edges dropped), with one file per edge for the message.
fn edges() -> BTreeMap<(String, String), String> {
    let root = src_dir();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    let tops = top_modules();
    let mut out = BTreeMap::new();
    for f in files {
        let from = module_of(&root, &f);
        if from == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        let rel = f.strip_prefix(&root).unwrap();
        for to in crate_refs_in(&text, rel, &tops) {
            if to != from {
                let rel = f.strip_prefix(&root).unwrap().display().to_string();
                out.entry((from.clone(), to)).or_insert(rel);
            }
        }
    }
    out
}

fn layer(m: &str) -> Option<u8> {
    LAYERS.iter().find(|(n, _)| *n == m).map(|(_, l)| *l)
}

#[test]
fn every_module_has_a_layer() {
    let root = src_dir();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let missing: BTreeSet<String> = files
        .iter()
        .map(|f| module_of(&root, f))
        .filter(|m| m != "lib" && layer(m).is_none())
        .collect();
    assert!(
        missing.is_empty(),
        "give these top-level modules a layer in tests/control/layers.rs: {missing:?}"
    );
}

#[test]
fn imports_point_down() {
    let edges = edges();
    let mut bad = Vec::new();
    for ((from, to), file) in &edges {
        let (Some(lf), Some(lt)) = (layer(from), layer(to)) else {
            continue;
        };
        let upward = lt > lf;
        let sibling = SIBLINGS.contains(&(from.as_str(), to.as_str()));
        let known = KNOWN.iter().any(|(a, b, _)| a == from && b == to);
        if (upward || sibling) && !known {
            bad.push(format!(
                "{from} (layer {lf}) imports {to} (layer {lt}) in {file}"
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "imports against the layers:\n{}",
        bad.join("\n")
    );
    let gone: Vec<_> = KNOWN
        .iter()
        .filter(|(a, b, _)| !edges.contains_key(&(a.to_string(), b.to_string())))
        .collect();
    assert!(
        gone.is_empty(),
        "fixed, remove from KNOWN in tests/control/layers.rs: {gone:?}"
    );
}

#[test]
fn no_circles_between_modules() {
    // The graph without the known debts must have no circle.
    let edges = edges();
    let mut graph: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        if !KNOWN.iter().any(|(a, b, _)| a == from && b == to) {
            graph.entry(from).or_default().push(to);
        }
    }
    // Depth-first search with three colours: a node met again while on the stack closes
    // a circle; a finished node needs no second visit.
    fn visit<'a>(
        n: &'a str,
        g: &BTreeMap<&'a str, Vec<&'a str>>,
        stack: &mut Vec<&'a str>,
        finished: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<&'a str>> {
        if let Some(i) = stack.iter().position(|s| *s == n) {
            let mut c = stack[i..].to_vec();
            c.push(n);
            return Some(c);
        }
        if finished.contains(n) {
            return None;
        }
        stack.push(n);
        for m in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, g, stack, finished) {
                return Some(c);
            }
        }
        stack.pop();
        finished.insert(n);
        None
    }
    let mut finished = BTreeSet::new();
    for n in graph.keys() {
        let c = visit(n, &graph, &mut Vec::new(), &mut finished);
        assert!(
            c.is_none(),
            "a circle between modules: {}",
            c.unwrap().join(" → ")
        );
    }
}

#[test]
fn the_scanner_sees_imports() {
    let tops: BTreeSet<String> = ["sys", "meta", "persist", "boot", "control", "state", "time"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let r = crate_refs(
        "use crate::{sys, meta::Store}; // crate::boot\nlet x = crate::persist::f();",
        &tops,
    );
    assert_eq!(
        r.into_iter().collect::<Vec<_>>(),
        vec!["meta".to_string(), "persist".into(), "sys".into()]
    );
    // A group rustfmt wrapped over lines, with a nested group inside.
    let r = crate_refs(
        "use crate::{\n    control::{api, status::Status},\n    state,\n    time::now_ns,\n};",
        &tops,
    );
    assert_eq!(
        r.into_iter().collect::<Vec<_>>(),
        vec!["control".to_string(), "state".into(), "time".into()]
    );
    // `super::` climbs: to the crate root from `workspace/fs.rs` takes two.
    let r = crate_refs_in(
        "use super::super::persist::x;\nuse super::{sys, y};\nuse super::super::{boot, z};",
        Path::new("workspace/fs.rs"),
        &tops,
    );
    assert_eq!(
        r.into_iter().collect::<Vec<_>>(),
        vec!["boot".to_string(), "persist".into()]
    );
    // From `workspace/mod.rs` one climb is the crate root.
    let r = crate_refs_in("use super::meta;", Path::new("workspace/mod.rs"), &tops);
    assert_eq!(r.into_iter().collect::<Vec<_>>(), vec!["meta".to_string()]);
}
