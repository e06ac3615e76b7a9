//! keel's layers point one way: `cli → boot/run/supervisor/control/shutdown → workspace,
//! persist → config/state/meta/chunk → sys/logging/progress/time/random`. This test reads
//! every `crate::` path in `init/src` (outside comments) and fails on an edge that points up
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

/// Every `crate::NAME` in `text` outside `//` comments.
fn crate_refs(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            let tail = &rest[i + "crate::".len()..];
            let name: String = tail
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // `use crate::{a, b}` names several modules at once.
            if name.is_empty() && tail.starts_with('{') {
                let group = &tail[1..tail.find('}').unwrap_or(tail.len())];
                for n in group.split(',') {
                    let n: String = n
                        .trim()
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !n.is_empty() {
                        out.insert(n);
                    }
                }
            } else if !name.is_empty() {
                out.insert(name);
            }
            rest = tail;
        }
    }
    out
}

/// Module → modules it imports (self-edges dropped), with one file per edge for the message.
fn edges() -> BTreeMap<(String, String), String> {
    let root = src_dir();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    let mut out = BTreeMap::new();
    for f in files {
        let from = module_of(&root, &f);
        if from == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        for to in crate_refs(&text) {
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
    let r =
        crate_refs("use crate::{sys, meta::Store}; // crate::boot\nlet x = crate::persist::f();");
    assert_eq!(
        r.into_iter().collect::<Vec<_>>(),
        vec!["meta".to_string(), "persist".into(), "sys".into()]
    );
}
