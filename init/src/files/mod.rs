//! The files API's operations (`GET/PUT/DELETE /files`, `POST /files/move`, `POST
//! /files/mkdir`): each runs in a short-lived helper process, `keel files-helper`
//! (`helper`), started on exec's launch path (`Processes::helper_spec`: the sandbox's mount
//! namespace, the asked-for user, the sandbox's capabilities and environment), so the
//! kernel checks every permission as for any process of that user and keel's state dir is
//! not even there. keel itself never opens a path of the request; it only passes bytes
//! between the client and the helper's pipes.
//!
//! Why a process and not a thread of keel that joins the namespace and sets its fsuid: a
//! thread keeps keel's capabilities (CAP_SYS_ADMIN, CAP_DAC_READ_SEARCH for root requests;
//! capabilities are per thread but dropping them is one-way), glibc's `setgroups` changes
//! every thread of the process, and `/proc/1/root` or `/proc/self/fd` seen from a thread of
//! keel are keel's own (its process, its root in the host namespace). A fresh process has
//! exactly the sandbox's rights and nothing of keel's; it costs one fork and exec (about a
//! millisecond) per call.
//!
//! Paths are taken relative to the workspace (an absolute path must lie in it); the helper
//! resolves them with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`, so `..`, a symlink
//! out or `/proc/1/root` are refused by the kernel, not by string checks.

pub mod helper;

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Component, Path};

use crate::exec::{ExecError, Processes};
use crate::sys::process;

/// Why a files operation could not be answered; the API's status code follows the variant
/// (the helper's own refusals come back as `Answer`s with their status).
#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    #[error("the files API needs a workspace (keel run with [init] workspace)")]
    NoWorkspace,
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error("path `{0}`: outside the workspace ({1})")]
    Outside(String, String),
    #[error("path `{0}`: {1}")]
    BadPath(String, &'static str),
    #[error("start the files helper: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("the files helper gave no answer ({0})")]
    NoAnswer(String),
    #[error("send the upload to the files helper: {0}")]
    Upload(#[source] std::io::Error),
}

impl FilesError {
    pub fn status(&self) -> u16 {
        match self {
            FilesError::NoWorkspace => 503,
            FilesError::Exec(ExecError::User(_)) => 400,
            FilesError::Exec(ExecError::NotReady | ExecError::Stopping) => 503,
            FilesError::Exec(_) => 500,
            FilesError::Outside(..) => 403,
            FilesError::BadPath(..) => 400,
            FilesError::Spawn(_) | FilesError::NoAnswer(_) | FilesError::Upload(_) => 500,
        }
    }
}

/// One operation, its paths already relative to the workspace (`relative`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Get {
        path: String,
        range: Option<String>,
    },
    /// A directory as a tar stream.
    Tar {
        path: String,
    },
    /// A tar stream (the upload) extracted into a directory.
    Untar {
        path: String,
    },
    /// `cond`: an `If-Match` value, or `none:*` for `If-None-Match: *`.
    Put {
        path: String,
        mode: Option<String>,
        cond: Option<String>,
    },
    List {
        path: String,
        depth: u32,
        max: u32,
    },
    Delete {
        path: String,
        recursive: bool,
    },
    Move {
        from: String,
        to: String,
        overwrite: bool,
    },
    Mkdir {
        path: String,
        mode: Option<String>,
        parents: bool,
    },
}

impl Op {
    fn argv(&self) -> Vec<String> {
        let o = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        let b = |v: bool| if v { "1".to_string() } else { "0".to_string() };
        match self {
            Op::Get { path, range } => vec!["get".into(), path.clone(), o(range)],
            Op::Tar { path } => vec!["tar".into(), path.clone()],
            Op::Untar { path } => vec!["untar".into(), path.clone()],
            Op::Put { path, mode, cond } => vec!["put".into(), path.clone(), o(mode), o(cond)],
            Op::List { path, depth, max } => {
                vec![
                    "list".into(),
                    path.clone(),
                    depth.to_string(),
                    max.to_string(),
                ]
            }
            Op::Delete { path, recursive } => vec!["delete".into(), path.clone(), b(*recursive)],
            Op::Move {
                from,
                to,
                overwrite,
            } => vec!["move".into(), from.clone(), to.clone(), b(*overwrite)],
            Op::Mkdir {
                path,
                mode,
                parents,
            } => vec!["mkdir".into(), path.clone(), o(mode), b(*parents)],
        }
    }
}

/// `path` as the helper takes it: relative to `workspace` ("." for the workspace itself).
/// An absolute path must lie in the workspace (compared by components; `..` is left to the
/// kernel's RESOLVE_BENEATH, which refuses one that climbs out).
pub fn relative(workspace: &Path, path: &str) -> Result<String, FilesError> {
    if path.is_empty() {
        return Err(FilesError::BadPath(
            path.into(),
            "empty (path= is required)",
        ));
    }
    if path.contains('\0') {
        return Err(FilesError::BadPath(path.into(), "contains a NUL byte"));
    }
    let p = Path::new(path);
    let rel = if p.is_absolute() {
        match p.strip_prefix(workspace) {
            Ok(r) => r.to_path_buf(),
            Err(_) => {
                return Err(FilesError::Outside(
                    path.into(),
                    format!("paths are relative to {} or inside it", workspace.display()),
                ))
            }
        }
    } else {
        p.to_path_buf()
    };
    let parts: Vec<String> = rel
        .components()
        .filter(|c| !matches!(c, Component::CurDir))
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    Ok(if parts.is_empty() {
        ".".into()
    } else {
        parts.join("/")
    })
}

/// A `Range` header against a file of `size` bytes (one range, `bytes=` only; others are
/// ignored and the whole file is sent, as RFC 9110 allows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Range {
    Ignore,
    /// First and last byte, inclusive.
    Slice(u64, u64),
    Unsatisfiable,
}

pub fn parse_range(h: &str, size: u64) -> Range {
    let Some(spec) = h.trim().strip_prefix("bytes=") else {
        return Range::Ignore;
    };
    if spec.contains(',') {
        return Range::Ignore;
    }
    let Some((a, b)) = spec.trim().split_once('-') else {
        return Range::Ignore;
    };
    let (a, b) = (a.trim(), b.trim());
    let r = match (a.is_empty(), b.is_empty()) {
        (true, true) => return Range::Ignore,
        (true, false) => match b.parse::<u64>() {
            Ok(0) => return Range::Unsatisfiable,
            Ok(n) => (size.saturating_sub(n), size.checked_sub(1)),
            Err(_) => return Range::Ignore,
        },
        (false, _) => {
            let Ok(start) = a.parse::<u64>() else {
                return Range::Ignore;
            };
            let end = if b.is_empty() {
                size.checked_sub(1)
            } else {
                match b.parse::<u64>() {
                    Ok(e) if e >= start => Some(e.min(size.saturating_sub(1))),
                    _ => return Range::Ignore,
                }
            };
            (start, end)
        }
    };
    match r {
        (start, Some(end)) if start < size && start <= end => Range::Slice(start, end),
        _ => Range::Unsatisfiable,
    }
}

/// A running helper: its stdin (a `put`'s frames) and its answer.
pub struct Helper {
    stdin: Option<File>,
    pub stdout: BufReader<File>,
}

/// Starts the helper for `op` as `user` (default the main command's).
pub fn start(procs: &Processes, user: Option<&str>, op: &Op) -> Result<Helper, FilesError> {
    let h = procs.helper_spec(user)?;
    let Some(ws) = h.workspace else {
        return Err(FilesError::NoWorkspace);
    };
    let mut spec = h.spec;
    // keel's own binary, found through the child's /proc/self/exe after it joined the
    // sandbox's namespace (the link names the running image, not a path to look up).
    let mut argv: Vec<OsString> = vec!["/proc/self/exe".into(), "files-helper".into()];
    let mut args = op.argv().into_iter().map(OsString::from);
    argv.extend(args.next());
    argv.push(ws.clone().into_os_string());
    argv.extend(args);
    spec.argv = argv;
    spec.cwd = ws;
    let put = matches!(op, Op::Put { .. } | Op::Untar { .. });
    spec.stdio = process::Stdio::Pipes { stdin: put };
    let s = process::spawn_io(&spec).map_err(FilesError::Spawn)?;
    drop(h.ns);
    // The helper writes nothing there; closing our end lets a stray write fail fast.
    drop(s.stderr);
    let stdout = s
        .stdout
        .map(File::from)
        .ok_or_else(|| FilesError::NoAnswer("no stdout".into()))?;
    Ok(Helper {
        stdin: s.stdin.map(File::from),
        stdout: BufReader::with_capacity(1 << 16, stdout),
    })
}

impl Helper {
    /// Sends one piece of a `put`'s content.
    pub fn send(&mut self, data: &[u8]) -> Result<(), FilesError> {
        let w = self
            .stdin
            .as_mut()
            .ok_or_else(|| FilesError::Upload(std::io::ErrorKind::BrokenPipe.into()))?;
        for piece in data.chunks(u32::MAX as usize) {
            w.write_all(&(piece.len() as u32).to_le_bytes())
                .and_then(|()| w.write_all(piece))
                .map_err(FilesError::Upload)?;
        }
        Ok(())
    }

    /// Ends a `put`'s content: `commit` renames it into place, else it is thrown away.
    pub fn finish(&mut self, commit: bool) {
        if let Some(mut w) = self.stdin.take() {
            if commit {
                let _ = w.write_all(&0u32.to_le_bytes());
            }
        }
    }

    /// The helper's answer line: `{"ok": true, "status": N, ...}` or `{"ok": false,
    /// "status": N, "error": "..."}`.
    pub fn answer(&mut self) -> Result<serde_json::Value, FilesError> {
        let mut line = String::new();
        match self.stdout.read_line(&mut line) {
            Ok(0) => Err(FilesError::NoAnswer("it ended without one".into())),
            Ok(_) => serde_json::from_str(&line)
                .map_err(|e| FilesError::NoAnswer(format!("not JSON: {e}"))),
            Err(e) => Err(FilesError::NoAnswer(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_relative_to_the_workspace() {
        let ws = Path::new("/workspace");
        assert_eq!(relative(ws, "a/b").unwrap(), "a/b");
        assert_eq!(relative(ws, "./a//b/").unwrap(), "a/b");
        assert_eq!(relative(ws, "/workspace/a").unwrap(), "a");
        assert_eq!(relative(ws, "/workspace").unwrap(), ".");
        assert_eq!(relative(ws, ".").unwrap(), ".");
        // `..` is the kernel's to refuse (RESOLVE_BENEATH), kept as given.
        assert_eq!(relative(ws, "a/../../etc").unwrap(), "a/../../etc");
        assert!(matches!(
            relative(ws, "/etc/passwd"),
            Err(FilesError::Outside(..))
        ));
        assert!(matches!(
            relative(ws, "/workspacefoo/x"),
            Err(FilesError::Outside(..))
        ));
        assert!(matches!(
            relative(ws, "/proc/1/root/etc"),
            Err(FilesError::Outside(..))
        ));
        assert!(matches!(relative(ws, ""), Err(FilesError::BadPath(..))));
        assert!(matches!(relative(ws, "a\0b"), Err(FilesError::BadPath(..))));
    }

    #[test]
    fn ranges() {
        use Range::*;
        assert_eq!(parse_range("bytes=0-9", 100), Slice(0, 9));
        assert_eq!(parse_range("bytes=90-", 100), Slice(90, 99));
        assert_eq!(parse_range("bytes=-10", 100), Slice(90, 99));
        assert_eq!(parse_range("bytes=-1000", 100), Slice(0, 99));
        assert_eq!(parse_range("bytes=50-1000", 100), Slice(50, 99));
        assert_eq!(parse_range("bytes=100-", 100), Unsatisfiable);
        assert_eq!(parse_range("bytes=0-", 0), Unsatisfiable);
        assert_eq!(parse_range("bytes=-0", 100), Unsatisfiable);
        assert_eq!(parse_range("bytes=5-1", 100), Ignore);
        assert_eq!(parse_range("bytes=0-1,5-6", 100), Ignore);
        assert_eq!(parse_range("items=0-1", 100), Ignore);
        assert_eq!(parse_range("bytes=x-", 100), Ignore);
    }
}
