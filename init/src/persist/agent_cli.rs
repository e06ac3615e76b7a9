//! `keel snapshot create|list|delete`, `keel diff`, `keel rollback`: a thin hand parser over
//! typed options and the library functions below, which find the running keel the way
//! `keel checkpoint` does (`--state DIR` or the config; its `persist.sock`) and otherwise
//! work on the stopped state dir and its remote.

use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

use super::agent::{Op, Rollback, SnapshotCreate};
use super::checkpoint::{now_ns, CheckpointOptions, Persister};
use super::cli::{ask, each_flag, load, lock_offline, repo_of, run, Args};
use super::{control, diff, params, snapshots};
use crate::config::Config;
use crate::sys;

pub const USAGE: &str = "usage:
  keel snapshot create [--name NAME] [--message TEXT] [--json] [--state DIR] [--config FILE]
  keel snapshot list [--json] [--state DIR | --remote URL] [--config FILE]
  keel snapshot delete ID|NAME [--state DIR] [--config FILE]
  keel diff A [B] [--json] [--state DIR] [--config FILE] [-- PATH]
                                   B defaults to the live workspace (checkpointed first)
  keel rollback ID|NAME [--state DIR] [--config FILE]";

/// `keel diff`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiffOptions {
    pub from: String,
    /// `None`: the live workspace.
    pub to: Option<String>,
    pub json: bool,
    /// A unified diff of this one file instead of the list of changes.
    pub path: Option<String>,
}

/// Flags these commands take besides `--state` and `--config`.
#[derive(Debug, Default)]
struct Parsed {
    args: Args,
    name: Option<String>,
    message: String,
    json: bool,
    positional: Vec<String>,
    path: Option<String>,
}

fn parse(mut argv: Vec<OsString>) -> Result<Parsed, String> {
    let mut out = Parsed::default();
    if let Some(i) = argv.iter().position(|a| a == "--") {
        let rest = argv.split_off(i);
        match rest.len() {
            2 => out.path = Some(rest[1].to_string_lossy().into_owned()),
            _ => return Err(format!("`--` takes exactly one PATH\n{USAGE}")),
        }
    }
    each_flag(argv, |f| {
        if out.args.common_flag(f)? {
            return Ok(());
        }
        match f.name {
            "--name" => out.name = Some(f.value()?),
            "--message" | "-m" => out.message = f.value()?,
            "--json" => out.json = true,
            "--remote" => out.args.remote = Some(f.value()?),
            "-h" | "--help" => return Err(USAGE.into()),
            n if n.starts_with('-') => return Err(format!("unknown option `{n}`\n{USAGE}")),
            _ => out.positional.push(f.arg.to_string()),
        }
        Ok(())
    })?;
    Ok(out)
}

/// Sends `op` to the keel running on the state dir; `Ok(None)`: none runs there.
fn ask_agent(cfg: &Config, op: &Op) -> Result<Option<serde_json::Value>, String> {
    let line = format!(
        "agent {}",
        serde_json::to_string(op).expect("op serialises")
    );
    match ask(&cfg.workspace.state_dir, &line)? {
        Some(r) => serde_json::from_str(&r)
            .map(Some)
            .map_err(|e| format!("unexpected answer from keel: {e}")),
        None => Ok(None),
    }
}

/// Pushes what the kernel caches for the running keel's mount into keel (from this
/// process, like `keel checkpoint`).
fn sync_mount(cfg: &Config) -> Result<(), String> {
    if let Some(mp) = ask(&cfg.workspace.state_dir, "mount-point")? {
        if let Err(e) = sys::file::syncfs(Path::new(&mp)) {
            eprintln!("keel: syncfs {mp}: {e} (going on with what keel has)");
        }
    }
    Ok(())
}

/// Checkpoints a stopped state dir as its one writer; returns the snapshot it is now at.
fn checkpoint_offline(cfg: &Config) -> Result<u64, String> {
    let state = &cfg.workspace.state_dir;
    let _lock = lock_offline(state)?;
    let mut p = Persister::open(state, repo_of(cfg)?, params(&cfg.workspace, &cfg.persist))
        .map_err(|e| e.to_string())?;
    let mut lease = super::acquire_lease(state, &cfg.persist, true).map_err(|e| e.to_string())?;
    if let Some(l) = lease.as_mut() {
        l.start_renewal()
            .map_err(|e| format!("start lease renewal: {e}"))?;
        p.set_lease(Some(l.handle()));
    }
    let _lease = super::lease::ReleaseOnDrop::new(lease);
    let r = p
        .checkpoint(&CheckpointOptions::default())
        .map_err(|e| e.to_string())?;
    match r.seq {
        Some(s) => Ok(s),
        None => p
            .store()
            .read()
            .persist_get("last_seq")
            .map_err(|e| e.to_string())?
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| "the workspace has no snapshot and nothing to checkpoint".into()),
    }
}

/// A snapshot of the live workspace now, recorded under a name (see `snapshots`).
pub fn snapshot_create(cfg: &Config, c: &SnapshotCreate) -> Result<serde_json::Value, String> {
    if let Some(n) = &c.name {
        snapshots::check_name(n).map_err(|e| e.to_string())?;
    }
    sync_mount(cfg)?;
    if let Some(v) = ask_agent(cfg, &Op::SnapshotCreate(c.clone()))? {
        return Ok(v);
    }
    let seq = checkpoint_offline(cfg)?;
    let rec = snapshots::record(&repo_of(cfg)?, seq, c.name.as_deref(), &c.message, now_ns())
        .map_err(|e| e.to_string())?;
    Ok(serde_json::json!({ "id": seq, "name": rec.name, "message": rec.message }))
}

pub fn snapshot_list(cfg: &Config) -> Result<snapshots::Listing, String> {
    snapshots::list(&repo_of(cfg)?).map_err(|e| e.to_string())
}

/// Removes a name: the snapshot falls under retention again.
pub fn snapshot_delete(cfg: &Config, what: &str) -> Result<Vec<String>, String> {
    snapshots::delete(&repo_of(cfg)?, what).map_err(|e| e.to_string())
}

/// `keel diff`: the changes as text or JSON, or a unified diff of one file.
pub fn diff(cfg: &Config, o: &DiffOptions) -> Result<String, String> {
    let to = match &o.to {
        Some(t) => t.clone(),
        None => {
            // The live workspace: checkpointed first, then it is the head.
            sync_mount(cfg)?;
            let running = control::request(
                &cfg.workspace.state_dir,
                "checkpoint",
                Duration::from_secs(3600),
            )?;
            if running.is_none() {
                checkpoint_offline(cfg)?;
            }
            "head".to_string()
        }
    };
    let repo = repo_of(cfg)?;
    let from = snapshots::resolve(&repo, &o.from).map_err(|e| e.to_string())?;
    let to = snapshots::resolve(&repo, &to).map_err(|e| e.to_string())?;
    if let Some(p) = &o.path {
        return diff::file_diff(&repo, from, to, p).map_err(|e| e.to_string());
    }
    let d = diff::diff(&repo, from, to).map_err(|e| e.to_string())?;
    Ok(if o.json {
        serde_json::to_string_pretty(&d).expect("diff serialises")
    } else {
        diff::render(&d)
    })
}

/// `keel rollback`: only against a running keel (a stopped workspace is restored with
/// `keel snapshot restore`).
pub fn rollback(cfg: &Config, r: &Rollback) -> Result<serde_json::Value, String> {
    sync_mount(cfg)?;
    ask_agent(cfg, &Op::Rollback(r.clone()))?.ok_or_else(|| {
        format!(
            "no keel runs on {}: rollback works on a mounted workspace (a stopped one is restored with keel snapshot restore)",
            cfg.workspace.state_dir.display()
        )
    })
}

fn print_json(v: &impl serde::Serialize) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).expect("value serialises")
    );
}

/// `keel snapshot create|list|delete`; `None`: another snapshot subcommand.
pub fn snapshot_main(sub: &str, argv: Vec<OsString>) -> Option<i32> {
    if !matches!(sub, "create" | "list" | "delete") {
        return None;
    }
    Some(run("snapshot", || {
        let p = parse(argv)?;
        let cfg = load(&p.args)?;
        match sub {
            "create" => {
                let v = snapshot_create(
                    &cfg,
                    &SnapshotCreate {
                        name: p.name.clone(),
                        message: p.message.clone(),
                    },
                )?;
                if p.json {
                    print_json(&v);
                } else {
                    println!("{}", v["id"]);
                }
            }
            "list" => {
                let l = snapshot_list(&cfg)?;
                if p.json {
                    print_json(&l);
                } else {
                    println!("{}", snapshots::render(&l));
                }
            }
            _ => {
                let what = p
                    .positional
                    .first()
                    .ok_or_else(|| format!("missing snapshot ID or NAME\n{USAGE}"))?;
                for n in snapshot_delete(&cfg, what)? {
                    println!("deleted name {n}");
                }
            }
        }
        Ok(0)
    }))
}

pub fn diff_main(argv: Vec<OsString>) -> i32 {
    run("diff", || {
        let p = parse(argv)?;
        let cfg = load(&p.args)?;
        let mut pos = p.positional.into_iter();
        let o = DiffOptions {
            from: pos
                .next()
                .ok_or_else(|| format!("missing snapshot A\n{USAGE}"))?,
            to: pos.next(),
            json: p.json,
            path: p.path,
        };
        if let Some(extra) = pos.next() {
            return Err(format!("unexpected argument `{extra}`\n{USAGE}"));
        }
        let out = diff(&cfg, &o)?;
        print!("{out}");
        if !out.is_empty() && !out.ends_with('\n') {
            println!();
        }
        Ok(0)
    })
}

pub fn rollback_main(argv: Vec<OsString>) -> i32 {
    run("rollback", || {
        let p = parse(argv)?;
        let cfg = load(&p.args)?;
        let to = p
            .positional
            .first()
            .ok_or_else(|| format!("missing snapshot ID or NAME\n{USAGE}"))?
            .clone();
        let v = rollback(&cfg, &Rollback { to })?;
        if p.json {
            print_json(&v);
        } else {
            println!(
                "rolled back from snapshot {} to {}: now snapshot {} (undo: keel rollback {}), {} inodes, {} entries, {} open files keep their old bytes until closed, {} ms",
                v["from"], v["to"], v["snapshot"], v["undo"].as_str().unwrap_or(""),
                v["applied"]["inodes"], v["applied"]["entries"],
                v["applied"]["open_files_kept"], v["duration_ms"]
            );
        }
        Ok(0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn parses_names_messages_and_a_path_after_the_separator() {
        let p = parse(args(&[
            "--name",
            "good",
            "-m",
            "tests pass",
            "--json",
            "3",
            "--",
            "src/a.rs",
        ]))
        .unwrap();
        assert_eq!(p.name.as_deref(), Some("good"));
        assert_eq!(p.message, "tests pass");
        assert!(p.json);
        assert_eq!(p.positional, ["3"]);
        assert_eq!(p.path.as_deref(), Some("src/a.rs"));
        assert!(parse(args(&["--", "a", "b"])).is_err());
        assert!(parse(args(&["--bogus"]))
            .unwrap_err()
            .starts_with("unknown option"));
    }
}
