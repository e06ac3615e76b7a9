//! Named snapshots: a snapshot taken on demand (`keel snapshot create`, `POST /snapshots`)
//! gets a record `<ws>/names/<name>` on the remote (`{"seq", "name", "message",
//! "created_ns"}`), and gc keeps every snapshot a record names (with the chain it needs)
//! whatever `[persist] keep` says, until `keel snapshot delete` removes the record. A
//! snapshot created without `--name` is recorded under its id in decimal; a name a user
//! gives may not be all digits, so `ID|NAME` arguments are never ambiguous.
//!
//! Also here: the listing (`keel snapshot list`, `GET /snapshots`), resolving `ID|NAME|head`
//! to a sequence number, and the disk use of a local `file://` remote.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::remote::{PutMode, RemoteError};
use super::repo::{Repo, RepoError};

#[derive(Debug, thiserror::Error)]
pub enum SnapshotsError {
    #[error("snapshot name `{0}`: use 1 to 100 of A-Z a-z 0-9 . _ - (not only digits, not starting with . or -)")]
    BadName(String),
    #[error("no snapshot `{0}` (neither a name nor an id on the remote)")]
    Unknown(String),
    #[error("the remote has no snapshot yet")]
    NoHead,
    #[error("read {key}: {reason}")]
    Parse { key: String, reason: String },
    #[error("write name {name}: {source}")]
    WriteName { name: String, source: RemoteError },
    #[error("delete name {name}: {source}")]
    DeleteName { name: String, source: RemoteError },
    #[error("list names: {0}")]
    ListNames(RemoteError),
    #[error(transparent)]
    Repo(#[from] RepoError),
}

/// A name record on the remote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NameRec {
    pub seq: u64,
    pub name: String,
    #[serde(default)]
    pub message: String,
    pub created_ns: i64,
}

/// One row of `keel snapshot list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SnapshotInfo {
    pub id: u64,
    /// Names recorded for it (kept until deleted).
    pub names: Vec<String>,
    pub message: String,
    pub created_ns: i64,
    pub created: String,
    /// `full` or `delta`.
    pub kind: &'static str,
    pub parent: Option<u64>,
    /// Inodes (files, directories, links...) in the tree.
    pub files: u64,
    pub file_bytes: u64,
    /// Bytes of the snapshot object itself (what the snapshot added besides its chunks).
    pub size_added: u64,
    pub head: bool,
}

/// The listing with the remote's disk use when it is a local directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Listing {
    pub remote: String,
    /// Bytes the `file://` remote takes on disk (`None` for other remotes).
    pub remote_disk_bytes: Option<u64>,
    pub snapshots: Vec<SnapshotInfo>,
}

/// Whether `name` may be given as a snapshot name.
pub fn check_name(name: &str) -> Result<(), SnapshotsError> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && !name.bytes().all(|b| b.is_ascii_digit())
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(SnapshotsError::BadName(name.to_string()))
    }
}

fn name_key(repo: &Repo, name: &str) -> String {
    repo.key(&format!("names/{name}"))
}

/// Every name record, by name.
pub fn names(repo: &Repo) -> Result<BTreeMap<String, NameRec>, SnapshotsError> {
    let prefix = repo.key("names/");
    let mut out = BTreeMap::new();
    for i in repo
        .remote
        .list(&prefix)
        .map_err(SnapshotsError::ListNames)?
    {
        let b = match repo.remote.get(&i.key) {
            Ok(b) => b,
            Err(e) if e.is_not_found() => continue,
            Err(e) => return Err(SnapshotsError::ListNames(e)),
        };
        let rec: NameRec = serde_json::from_slice(&b).map_err(|e| SnapshotsError::Parse {
            key: i.key.clone(),
            reason: e.to_string(),
        })?;
        out.insert(rec.name.clone(), rec);
    }
    Ok(out)
}

/// The snapshots gc must keep because a name records them.
pub fn pinned(repo: &Repo) -> Result<BTreeSet<u64>, SnapshotsError> {
    Ok(names(repo)?.values().map(|r| r.seq).collect())
}

/// Records `name` (default: the id in decimal) for snapshot `seq`, replacing a record of
/// the same name.
pub fn record(
    repo: &Repo,
    seq: u64,
    name: Option<&str>,
    message: &str,
    now_ns: i64,
) -> Result<NameRec, SnapshotsError> {
    if let Some(n) = name {
        check_name(n)?;
    }
    let name = name.map(str::to_string).unwrap_or_else(|| seq.to_string());
    let rec = NameRec {
        seq,
        name: name.clone(),
        message: message.to_string(),
        created_ns: now_ns,
    };
    let data = serde_json::to_vec(&rec).expect("name record serialises");
    repo.remote
        .put(
            &name_key(repo, &name),
            Bytes::from(data),
            PutMode::Overwrite,
        )
        .map_err(|source| SnapshotsError::WriteName {
            name: name.clone(),
            source,
        })?;
    Ok(rec)
}

/// Resolves `ID|NAME|head|latest` to a snapshot id.
pub fn resolve(repo: &Repo, what: &str) -> Result<u64, SnapshotsError> {
    if what == "head" || what == "latest" {
        return match repo.read_head()? {
            Some((h, _)) => Ok(h.seq),
            None => Err(SnapshotsError::NoHead),
        };
    }
    if let Ok(seq) = what.parse::<u64>() {
        return match repo.remote.head(&repo.snapshot_key(seq)) {
            Ok(Some(_)) => Ok(seq),
            Ok(None) => Err(SnapshotsError::Unknown(what.to_string())),
            Err(e) => Err(RepoError::from(e).into()),
        };
    }
    check_name(what).map_err(|_| SnapshotsError::Unknown(what.to_string()))?;
    match repo.remote.get(&name_key(repo, what)) {
        Ok(b) => {
            let rec: NameRec = serde_json::from_slice(&b).map_err(|e| SnapshotsError::Parse {
                key: name_key(repo, what),
                reason: e.to_string(),
            })?;
            Ok(rec.seq)
        }
        Err(e) if e.is_not_found() => Err(SnapshotsError::Unknown(what.to_string())),
        Err(e) => Err(RepoError::from(e).into()),
    }
}

/// Deletes the name records matching `what` (a name, or an id: every name of that
/// snapshot). The snapshot itself then falls under retention. Returns the names removed.
pub fn delete(repo: &Repo, what: &str) -> Result<Vec<String>, SnapshotsError> {
    let all = names(repo)?;
    let gone: Vec<String> = match (all.get(what), what.parse::<u64>()) {
        (Some(r), _) => vec![r.name.clone()],
        (None, Ok(seq)) => all
            .values()
            .filter(|r| r.seq == seq)
            .map(|r| r.name.clone())
            .collect(),
        _ => Vec::new(),
    };
    if gone.is_empty() {
        return Err(SnapshotsError::Unknown(what.to_string()));
    }
    for n in &gone {
        repo.remote
            .delete(&name_key(repo, n))
            .map_err(|source| SnapshotsError::DeleteName {
                name: n.clone(),
                source,
            })?;
    }
    Ok(gone)
}

/// Every snapshot on the remote with its names, oldest first.
pub fn list(repo: &Repo) -> Result<Listing, SnapshotsError> {
    let head = repo.read_head()?.map(|h| h.0.seq);
    let mut by_seq: BTreeMap<u64, Vec<&NameRec>> = BTreeMap::new();
    let all = names(repo)?;
    for r in all.values() {
        by_seq.entry(r.seq).or_default().push(r);
    }
    let mut out = Vec::new();
    for (seq, info) in repo.list_snapshots()? {
        let h = repo.read_header(seq)?;
        let recs = by_seq.get(&seq).map(Vec::as_slice).unwrap_or(&[]);
        out.push(SnapshotInfo {
            id: seq,
            names: recs.iter().map(|r| r.name.clone()).collect(),
            message: recs
                .iter()
                .map(|r| r.message.as_str())
                .find(|m| !m.is_empty())
                .unwrap_or("")
                .to_string(),
            created_ns: h.created_ns,
            created: crate::time::fmt_ns(h.created_ns),
            kind: if h.is_full() { "full" } else { "delta" },
            parent: h.parent,
            files: h.inodes,
            file_bytes: h.file_bytes,
            size_added: info.size,
            head: Some(seq) == head,
        });
    }
    Ok(Listing {
        remote: repo.describe(),
        remote_disk_bytes: repo.remote.local_root().map(disk_use),
        snapshots: out,
    })
}

/// Bytes the files under `root` take on disk (allocated blocks), 0 when unreadable.
pub fn disk_use(root: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0u64;
    let mut todo = vec![root.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            total += m.blocks() * 512;
            if m.is_dir() {
                todo.push(e.path());
            }
        }
    }
    total
}

/// The listing as a table.
pub fn render(l: &Listing) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>8}  {:<5}  {:>9}  {:>13}  {:>10}  {:<20}  name / message",
        "id", "kind", "files", "file bytes", "size added", "created"
    );
    for i in &l.snapshots {
        let mut label = i.names.join(",");
        if !i.message.is_empty() {
            let _ = write!(
                label,
                "{}\"{}\"",
                if label.is_empty() { "" } else { " " },
                i.message
            );
        }
        if i.head {
            label.push_str(if label.is_empty() {
                "(head)"
            } else {
                " (head)"
            });
        }
        let _ = writeln!(
            s,
            "{:>8}  {:<5}  {:>9}  {:>13}  {:>10}  {:<20}  {}",
            i.id, i.kind, i.files, i.file_bytes, i.size_added, i.created, label
        );
    }
    let _ = write!(s, "{} snapshots on {}", l.snapshots.len(), l.remote);
    if let Some(b) = l.remote_disk_bytes {
        let _ = write!(s, ", {b} bytes on disk");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persist::MemRemote;
    use std::sync::Arc;

    #[test]
    fn names_are_checked_recorded_resolved_and_deleted() {
        let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
        for bad in ["", "123", "a/b", ".x", "-x", "a b", &"x".repeat(101)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        check_name("before-step_2.v1").unwrap();
        repo.put_snapshot(7, b"x".to_vec()).unwrap();
        record(&repo, 7, Some("good"), "all tests pass", 1).unwrap();
        record(&repo, 7, None, "", 2).unwrap();
        assert_eq!(resolve(&repo, "good").unwrap(), 7);
        assert_eq!(resolve(&repo, "7").unwrap(), 7);
        assert!(matches!(
            resolve(&repo, "8"),
            Err(SnapshotsError::Unknown(_))
        ));
        assert!(matches!(
            resolve(&repo, "nope"),
            Err(SnapshotsError::Unknown(_))
        ));
        assert_eq!(pinned(&repo).unwrap(), BTreeSet::from([7]));
        assert_eq!(delete(&repo, "good").unwrap(), ["good"]);
        assert_eq!(delete(&repo, "7").unwrap(), ["7"]);
        assert!(pinned(&repo).unwrap().is_empty());
        assert!(delete(&repo, "7").is_err());
    }
}
