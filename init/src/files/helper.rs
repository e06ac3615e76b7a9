//! The child side of the files API: `keel files-helper OP WORKSPACE ARGS...`, started by
//! `files::start` on the exec launch path (the sandbox's mount namespace, the asked-for
//! user, the sandbox's capabilities, scrubbed environment). It does one operation with
//! nothing but that user's rights, every path resolved beneath the workspace
//! (`sys::beneath`), and answers on stdout: one JSON line (`{"ok": true, ...}` or `{"ok":
//! false, "status": N, "error": "..."}`), then, for `get`, exactly the bytes it announced.
//! A `put` reads its content from stdin in frames (`u32` little-endian length, bytes; a
//! zero length commits), so a client that goes away mid-upload leaves the old file and no
//! temporary one.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::chunk::ContentHasher;
use crate::sys::beneath::{self, Stat};

/// One failed step: the HTTP status the API answers with and the line that says why.
struct Fail(u16, String);

type R<T> = Result<T, Fail>;

/// The status of an errno, and its one line.
fn fail(what: &str, e: &io::Error) -> Fail {
    let code = match e.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => 403,
        Some(libc::EXDEV) | Some(libc::ELOOP) => {
            return Fail(
                403,
                format!(
                    "{what}: leaves the workspace (through `..`, an absolute path or a symlink)"
                ),
            )
        }
        Some(libc::ENOENT) => 404,
        Some(libc::EEXIST) | Some(libc::ENOTEMPTY) | Some(libc::EBUSY) => 409,
        Some(libc::ENOTDIR)
        | Some(libc::EISDIR)
        | Some(libc::ENAMETOOLONG)
        | Some(libc::EINVAL) => 400,
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => 507,
        _ => 500,
    };
    Fail(code, format!("{what}: {e}"))
}

fn at<T>(what: &str, r: io::Result<T>) -> R<T> {
    r.map_err(|e| fail(what, &e))
}

const O_PATH_DIR: i32 = libc::O_PATH | libc::O_DIRECTORY;

struct Ws {
    root: OwnedFd,
}

impl Ws {
    fn new(workspace: &OsStr) -> R<Ws> {
        let root = at(
            "the workspace",
            File::open(Path::new(workspace)).map(OwnedFd::from),
        )?;
        Ok(Ws { root })
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.root.as_fd()
    }

    fn open(&self, rel: &str, flags: i32) -> R<OwnedFd> {
        at(
            rel,
            beneath::open_beneath(self.fd(), Path::new(rel), flags, 0),
        )
    }

    /// The directory that holds `rel` (opened beneath the workspace) and its last name.
    fn parent(&self, rel: &str) -> R<(OwnedFd, PathBuf)> {
        let p = Path::new(rel);
        let name = match p.file_name() {
            Some(n)
                if p.components()
                    .next_back()
                    .is_some_and(|c| matches!(c, std::path::Component::Normal(_))) =>
            {
                n
            }
            _ => {
                return Err(Fail(
                    400,
                    format!("{rel}: names no entry (the workspace itself, `.` or `..`)"),
                ))
            }
        };
        let dir = p
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let fd = at(rel, beneath::open_beneath(self.fd(), dir, O_PATH_DIR, 0))?;
        Ok((fd, PathBuf::from(name)))
    }
}

/// Runs one operation; the exit code is 0 when it answered (even with an error line).
pub fn main(args: &[OsString]) -> i32 {
    let out = io::stdout();
    let mut out = BufWriter::with_capacity(1 << 16, out.lock());
    let r = run(args, &mut out);
    if let Err(Fail(status, error)) = r {
        let _ = writeln!(
            out,
            "{}",
            json!({ "ok": false, "status": status, "error": error })
        );
    }
    if out.flush().is_err() {
        return 1;
    }
    0
}

fn arg(args: &[OsString], i: usize) -> R<&OsStr> {
    args.get(i)
        .map(|a| a.as_os_str())
        .ok_or_else(|| Fail(500, "files-helper: missing argument".into()))
}

fn s(args: &[OsString], i: usize) -> R<String> {
    Ok(arg(args, i)?.to_string_lossy().into_owned())
}

fn opt(args: &[OsString], i: usize) -> R<Option<String>> {
    let v = s(args, i)?;
    Ok((v != "-").then_some(v))
}

fn num(args: &[OsString], i: usize) -> R<u64> {
    s(args, i)?
        .parse()
        .map_err(|_| Fail(500, "files-helper: bad number".into()))
}

fn run(args: &[OsString], out: &mut dyn Write) -> R<()> {
    let op = s(args, 0)?;
    let ws = Ws::new(arg(args, 1)?)?;
    match op.as_str() {
        "get" => get(&ws, &s(args, 2)?, opt(args, 3)?, out),
        "put" => put(&ws, &s(args, 2)?, opt(args, 3)?, opt(args, 4)?, out),
        "list" => list(
            &ws,
            &s(args, 2)?,
            num(args, 3)? as u32,
            num(args, 4)? as usize,
            out,
        ),
        "delete" => delete(&ws, &s(args, 2)?, num(args, 3)? == 1, out),
        "move" => mv(&ws, &s(args, 2)?, &s(args, 3)?, num(args, 4)? == 1, out),
        "mkdir" => mkdir(&ws, &s(args, 2)?, opt(args, 3)?, num(args, 4)? == 1, out),
        "tar" => tar(&ws, &s(args, 2)?, out),
        "untar" => untar(&ws, &s(args, 2)?, out),
        o => Err(Fail(500, format!("files-helper: no operation {o}"))),
    }
}

fn line(out: &mut dyn Write, v: &Value) -> R<()> {
    writeln!(out, "{v}").map_err(|e| Fail(500, format!("answer: {e}")))
}

/// The quoted blake3 of a file's bytes from its start (the file offset is left at its end).
fn etag_of(f: &mut File, what: &str) -> R<String> {
    let mut h = ContentHasher::default();
    let mut buf = vec![0u8; 1 << 16];
    at(what, f.seek(SeekFrom::Start(0)))?;
    loop {
        let n = at(what, f.read(&mut buf))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("\"{}\"", h.finish().to_hex()))
}

/// Opens a regular file for reading without blocking on a FIFO or a device.
fn open_regular(fd: OwnedFd, what: &str) -> R<(File, Stat)> {
    let st = at(what, beneath::stat_fd(fd.as_fd()))?;
    if st.is_dir() {
        return Err(Fail(
            400,
            format!("{what}: is a directory (list=1 lists it, tar=1 sends it as a tar stream)"),
        ));
    }
    if !st.is_file() {
        return Err(Fail(400, format!("{what}: not a regular file")));
    }
    Ok((File::from(fd), st))
}

fn get(ws: &Ws, rel: &str, range: Option<String>, out: &mut dyn Write) -> R<()> {
    let fd = ws.open(rel, libc::O_RDONLY | libc::O_NONBLOCK)?;
    let (mut f, st) = open_regular(fd, rel)?;
    let etag = etag_of(&mut f, rel)?;
    let size = st.size;
    let (status, start, len) = match range.as_deref().map(|r| super::parse_range(r, size)) {
        None | Some(super::Range::Ignore) => (200, 0, size),
        Some(super::Range::Slice(a, b)) => (206, a, b - a + 1),
        Some(super::Range::Unsatisfiable) => {
            return Err(Fail(
                416,
                format!("{rel}: the range is outside its {size} bytes"),
            ))
        }
    };
    line(
        out,
        &json!({ "ok": true, "status": status, "size": size, "start": start, "len": len,
                 "etag": etag, "mode": st.mode & 0o7777, "mtime_ns": st.mtime_ns.to_string() }),
    )?;
    at(rel, f.seek(SeekFrom::Start(start)))?;
    // At most the announced length: a file that shrank meanwhile ends the stream short
    // (the client sees fewer bytes than Content-Length), never padded.
    at(rel, io::copy(&mut (&f).take(len), out))?;
    Ok(())
}

fn read_frame(input: &mut dyn Read, buf: &mut Vec<u8>) -> io::Result<Option<usize>> {
    let mut n = [0u8; 4];
    input.read_exact(&mut n)?;
    let n = u32::from_le_bytes(n) as usize;
    if n == 0 {
        return Ok(None);
    }
    buf.resize(n, 0);
    input.read_exact(&mut buf[..n])?;
    Ok(Some(n))
}

fn put(
    ws: &Ws,
    rel: &str,
    mode: Option<String>,
    cond: Option<String>,
    out: &mut dyn Write,
) -> R<()> {
    let (dir, name) = ws.parent(rel)?;
    let mode = match mode {
        Some(m) => Some(
            u32::from_str_radix(&m, 8).map_err(|_| Fail(400, format!("mode={m}: not octal")))?,
        ),
        None => None,
    };
    // What is there now: its mode and owner are kept, its hash checked against If-Match.
    let old = match beneath::stat_at(dir.as_fd(), &name) {
        Ok(st) => Some(st),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => None,
        Err(e) => return Err(fail(rel, &e)),
    };
    if old.is_some_and(|o| o.is_dir()) {
        return Err(Fail(409, format!("{rel}: is a directory")));
    }
    // The file whose ETag was checked, as `stat` saw it while its bytes were hashed: the
    // replace goes ahead only if the name still holds exactly that (see `replace`).
    let mut checked: Option<Stat> = None;
    if let Some(c) = &cond {
        let current = match old {
            Some(st) if st.is_file() => {
                let fd = at(
                    rel,
                    beneath::open_at(dir.as_fd(), &name, libc::O_RDONLY | libc::O_NONBLOCK, 0),
                )?;
                let before = at(rel, beneath::stat_fd(fd.as_fd()))?;
                let mut f = File::from(fd);
                let tag = etag_of(&mut f, rel)?;
                let after = at(rel, beneath::stat_fd(f.as_fd()))?;
                if before != after {
                    return Err(changed(rel));
                }
                checked = Some(after);
                Some(tag)
            }
            Some(st) => {
                checked = Some(st);
                Some(String::new())
            }
            None => None,
        };
        let ok = match c.as_str() {
            "none:*" => current.is_none(),
            "*" => current.is_some(),
            tags => current.as_ref().is_some_and(|cur| {
                tags.split(',').map(str::trim).any(|t| {
                    let t = t.trim_start_matches("W/");
                    t == cur || format!("\"{t}\"") == *cur
                })
            }),
        };
        if !ok {
            return Err(changed(rel));
        }
    }
    let tmp = PathBuf::from(format!(
        ".{}.keel-put-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let create = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL;
    let fd = at(
        rel,
        beneath::open_at(dir.as_fd(), &tmp, create, mode.unwrap_or(0o666)),
    )?;
    let f = File::from(fd);
    let done = (|| -> R<(u64, String)> {
        let mut h = ContentHasher::default();
        let mut w = BufWriter::with_capacity(1 << 20, &f);
        let mut buf = Vec::new();
        let mut size = 0u64;
        let mut input = io::stdin().lock();
        loop {
            match read_frame(&mut input, &mut buf) {
                Ok(Some(n)) => {
                    h.update(&buf[..n]);
                    at(rel, w.write_all(&buf[..n]))?;
                    size += n as u64;
                }
                Ok(None) => break,
                Err(_) => {
                    return Err(Fail(
                        400,
                        format!("{rel}: the upload ended early; nothing changed"),
                    ))
                }
            }
        }
        at(rel, w.flush())?;
        drop(w);
        let keep = match (mode, old) {
            (Some(m), _) => Some(m & 0o7777),
            (None, Some(o)) if o.is_file() => Some(o.mode & 0o777),
            _ => None,
        };
        if let Some(m) = keep {
            at(rel, beneath::chmod_fd(f.as_fd(), m))?;
        }
        if let Some(o) = old.filter(|o| o.is_file()) {
            if beneath::euid() == 0 {
                let _ = beneath::chown_fd(f.as_fd(), o.uid, o.gid);
            }
        }
        replace(&dir, &tmp, &name, rel, cond.as_deref(), checked)?;
        Ok((size, format!("\"{}\"", h.finish().to_hex())))
    })();
    let (size, etag) = match done {
        Ok(d) => d,
        Err(e) => {
            let _ = beneath::unlink_at(dir.as_fd(), &tmp, false);
            return Err(e);
        }
    };
    line(
        out,
        &json!({ "ok": true, "status": if old.is_some() { 200 } else { 201 }, "path": rel,
                 "size": size, "etag": etag, "created": old.is_none() }),
    )
}

fn changed(rel: &str) -> Fail {
    Fail(
        412,
        format!("{rel}: changed meanwhile (its ETag is not the one If-Match names)"),
    )
}

/// Puts the upload `tmp` in place of `name`. Without a condition: a rename over it. With
/// `If-None-Match: *`: a rename that fails if `name` exists by then (412). With `If-Match`:
/// the two names are exchanged in one step (`RENAME_EXCHANGE`), then the file swapped out
/// must be the one whose ETag was checked (`checked`: same inode, size and mtime; it was
/// also unchanged, ctime included, just before), else the exchange is undone and the answer
/// is 412. So a writer that replaced or wrote the file between the check and the replace
/// is never overwritten; one still holding the old file open can write to it after the
/// replace (the write lands in the replaced file, as with any save by rename).
fn replace(
    dir: &OwnedFd,
    tmp: &Path,
    name: &Path,
    rel: &str,
    cond: Option<&str>,
    checked: Option<Stat>,
) -> R<()> {
    let d = dir.as_fd();
    match (cond, checked) {
        (None, _) => at(rel, beneath::rename_at(d, tmp, d, name, true)),
        (Some("*"), Some(_)) => {
            // Whatever is there by then, as long as something is.
            match beneath::exchange_at(d, tmp, name) {
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Err(changed(rel)),
                r => {
                    at(rel, r)?;
                    let _ = beneath::unlink_at(d, tmp, false);
                    Ok(())
                }
            }
        }
        (Some("none:*"), _) | (Some(_), None) => {
            // If-None-Match: * (or a condition on a file that was not there): only if it
            // still is not.
            match beneath::rename_at(d, tmp, d, name, false) {
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Err(changed(rel)),
                r => at(rel, r),
            }
        }
        (Some(_), Some(c)) => {
            match beneath::stat_at(d, name) {
                Ok(now) if now == c => {}
                Ok(_) => return Err(changed(rel)),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Err(changed(rel)),
                Err(e) => return Err(fail(rel, &e)),
            }
            match beneath::exchange_at(d, tmp, name) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Err(changed(rel)),
                Err(e) => return Err(fail(rel, &e)),
            }
            // `tmp` now names the file that was in place.
            let swapped = at(rel, beneath::stat_at(d, tmp))?;
            if !swapped.same_file_and_bytes(&c) {
                at(rel, beneath::exchange_at(d, tmp, name))?;
                return Err(changed(rel));
            }
            let _ = beneath::unlink_at(d, tmp, false);
            Ok(())
        }
    }
}

fn kind(st: &Stat) -> &'static str {
    match st.kind() {
        libc::S_IFREG => "file",
        libc::S_IFDIR => "dir",
        libc::S_IFLNK => "symlink",
        libc::S_IFIFO => "fifo",
        libc::S_IFSOCK => "socket",
        libc::S_IFCHR => "char",
        libc::S_IFBLK => "block",
        _ => "other",
    }
}

fn join(base: &str, name: &OsStr) -> String {
    let n = name.to_string_lossy();
    if base == "." || base.is_empty() {
        n.into_owned()
    } else {
        format!("{}/{n}", base.trim_end_matches('/'))
    }
}

struct Lister {
    entries: Vec<Value>,
    max: usize,
    truncated: bool,
}

impl Lister {
    fn walk(&mut self, dir: &OwnedFd, rel: &str, depth: u32) {
        let mut names = match beneath::read_dir(dir) {
            Ok(n) => n,
            Err(_) => return,
        };
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        for name in names {
            if self.entries.len() >= self.max {
                self.truncated = true;
                return;
            }
            let path = join(rel, &name);
            let Ok(st) = beneath::stat_at(dir.as_fd(), Path::new(&name)) else {
                continue;
            };
            let mut e = json!({
                "name": name.to_string_lossy(), "path": path, "type": kind(&st),
                "size": st.size, "mode": format!("{:04o}", st.mode & 0o7777),
                "uid": st.uid, "gid": st.gid, "mtime_ns": st.mtime_ns.to_string(),
            });
            if st.is_symlink() {
                if let Ok(t) = beneath::read_link_at(dir.as_fd(), Path::new(&name)) {
                    e["target"] = t.to_string_lossy().into_owned().into();
                }
            }
            let descend = st.is_dir() && depth > 1;
            let sub = descend.then(|| {
                beneath::open_at(
                    dir.as_fd(),
                    Path::new(&name),
                    libc::O_RDONLY | libc::O_DIRECTORY,
                    0,
                )
            });
            if let Some(Err(err)) = &sub {
                e["error"] = err.to_string().into();
            }
            self.entries.push(e);
            if let Some(Ok(sub)) = sub {
                self.walk(&sub, &path, depth - 1);
            }
        }
    }
}

fn list(ws: &Ws, rel: &str, depth: u32, max: usize, out: &mut dyn Write) -> R<()> {
    let fd = ws.open(rel, libc::O_RDONLY | libc::O_DIRECTORY)?;
    let mut l = Lister {
        entries: Vec::new(),
        max,
        truncated: false,
    };
    l.walk(&fd, rel, depth.max(1));
    line(
        out,
        &json!({ "ok": true, "status": 200, "path": rel, "depth": depth.max(1),
                 "entries": l.entries, "truncated": l.truncated }),
    )
}

/// Removes everything in the directory `dir` (opened without following a symlink).
fn empty_dir(dir: &OwnedFd, rel: &str) -> R<()> {
    for name in at(rel, beneath::read_dir(dir))? {
        let n = Path::new(&name);
        let path = join(rel, &name);
        let st = at(&path, beneath::stat_at(dir.as_fd(), n))?;
        if st.is_dir() {
            let sub = at(
                &path,
                beneath::open_at(dir.as_fd(), n, libc::O_RDONLY | libc::O_DIRECTORY, 0),
            )?;
            empty_dir(&sub, &path)?;
        }
        at(&path, beneath::unlink_at(dir.as_fd(), n, st.is_dir()))?;
    }
    Ok(())
}

fn delete(ws: &Ws, rel: &str, recursive: bool, out: &mut dyn Write) -> R<()> {
    let (dir, name) = ws.parent(rel)?;
    let st = at(rel, beneath::stat_at(dir.as_fd(), &name))?;
    if st.is_dir() {
        if recursive {
            let sub = at(
                rel,
                beneath::open_at(dir.as_fd(), &name, libc::O_RDONLY | libc::O_DIRECTORY, 0),
            )?;
            empty_dir(&sub, rel)?;
        }
        match beneath::unlink_at(dir.as_fd(), &name, true) {
            Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => {
                return Err(Fail(
                    409,
                    format!(
                        "{rel}: directory not empty (recursive=1 deletes it with everything in it)"
                    ),
                ))
            }
            r => at(rel, r)?,
        }
    } else {
        at(rel, beneath::unlink_at(dir.as_fd(), &name, false))?;
    }
    line(
        out,
        &json!({ "ok": true, "status": 200, "path": rel, "type": kind(&st) }),
    )
}

fn mv(ws: &Ws, from: &str, to: &str, overwrite: bool, out: &mut dyn Write) -> R<()> {
    let (fd, fname) = ws.parent(from)?;
    let (td, tname) = ws.parent(to)?;
    match beneath::rename_at(fd.as_fd(), &fname, td.as_fd(), &tname, overwrite) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            return Err(Fail(
                409,
                format!("{to}: exists (overwrite=true replaces it)"),
            ))
        }
        r => at(&format!("{from} -> {to}"), r)?,
    }
    line(
        out,
        &json!({ "ok": true, "status": 200, "from": from, "to": to }),
    )
}

fn mkdir(ws: &Ws, rel: &str, mode: Option<String>, parents: bool, out: &mut dyn Write) -> R<()> {
    let mode = match mode {
        Some(m) => {
            u32::from_str_radix(&m, 8).map_err(|_| Fail(400, format!("mode={m}: not octal")))?
        }
        None => 0o777,
    };
    if !parents {
        let (dir, name) = ws.parent(rel)?;
        at(rel, beneath::mkdir_at(dir.as_fd(), &name, mode))?;
        return line(
            out,
            &json!({ "ok": true, "status": 201, "path": rel, "created": true }),
        );
    }
    // Each missing component in turn, every step resolved beneath the workspace.
    let mut done = String::new();
    let mut created = false;
    for c in Path::new(rel).components() {
        let std::path::Component::Normal(n) = c else {
            if matches!(c, std::path::Component::CurDir) {
                continue;
            }
            return Err(Fail(
                400,
                format!("{rel}: `..` is not allowed with parents=true"),
            ));
        };
        let path = join(&done, n);
        let (dir, name) = ws.parent(&path)?;
        match beneath::mkdir_at(dir.as_fd(), &name, mode) {
            Ok(()) => created = true,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                let st = at(&path, beneath::stat_at(dir.as_fd(), &name))?;
                if !st.is_dir() {
                    return Err(Fail(409, format!("{path}: exists and is not a directory")));
                }
                created = false;
            }
            Err(e) => return Err(fail(&path, &e)),
        }
        done = path;
    }
    line(
        out,
        &json!({ "ok": true, "status": if created { 201 } else { 200 }, "path": rel, "created": created }),
    )
}

/// One member of a directory's tar stream: its path in the archive, what it is, and the
/// directory that holds it (to open it by name, without following a symlink).
struct Member {
    path: String,
    dir: std::rc::Rc<OwnedFd>,
    name: OsString,
    st: Stat,
}

/// Walks `dir` as the user: every entry it can see, a 403 for a directory it cannot open or
/// a file it cannot read (checked before a byte is sent, so the answer can still say so).
fn tar_walk(dir: std::rc::Rc<OwnedFd>, prefix: &str, rel: &str, out: &mut Vec<Member>) -> R<()> {
    let mut names = at(rel, beneath::read_dir(&dir))?;
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    for name in names {
        let n = Path::new(&name);
        let path = join(prefix, &name);
        let full = join(rel, &name);
        let st = at(&full, beneath::stat_at(dir.as_fd(), n))?;
        if st.is_dir() {
            let sub = at(
                &full,
                beneath::open_at(dir.as_fd(), n, libc::O_RDONLY | libc::O_DIRECTORY, 0),
            )?;
            out.push(Member {
                path: path.clone(),
                dir: dir.clone(),
                name,
                st,
            });
            tar_walk(std::rc::Rc::new(sub), &path, &full, out)?;
            continue;
        }
        if st.is_file() {
            at(
                &full,
                beneath::open_at(dir.as_fd(), n, libc::O_RDONLY | libc::O_NONBLOCK, 0),
            )?;
        }
        if st.is_file() || st.is_symlink() || st.kind() == libc::S_IFIFO {
            out.push(Member {
                path,
                dir: dir.clone(),
                name,
                st,
            });
        }
    }
    Ok(())
}

/// A directory as a tar stream (its entries relative to it; files, directories, symlinks
/// and FIFOs with their modes, owners and mtimes; sockets and devices are left out).
fn tar(ws: &Ws, rel: &str, out: &mut dyn Write) -> R<()> {
    let fd = ws.open(rel, libc::O_RDONLY | libc::O_DIRECTORY)?;
    let mut members = Vec::new();
    tar_walk(std::rc::Rc::new(fd), "", rel, &mut members)?;
    line(
        out,
        &json!({ "ok": true, "status": 200, "path": rel, "entries": members.len() }),
    )?;
    let mut b = tar::Builder::new(out);
    let broken = |e: io::Error| Fail(500, format!("tar: {e}"));
    for m in &members {
        let mut h = tar::Header::new_gnu();
        h.set_mode(m.st.mode & 0o7777);
        h.set_uid(m.st.uid as u64);
        h.set_gid(m.st.gid as u64);
        h.set_mtime(u64::try_from(m.st.mtime_ns / 1_000_000_000).unwrap_or(0));
        h.set_size(0);
        let n = Path::new(&m.name);
        match m.st.kind() {
            libc::S_IFDIR => {
                h.set_entry_type(tar::EntryType::Directory);
                b.append_data(&mut h, format!("{}/", m.path), io::empty())
                    .map_err(broken)?;
            }
            libc::S_IFLNK => {
                h.set_entry_type(tar::EntryType::Symlink);
                let target = at(&m.path, beneath::read_link_at(m.dir.as_fd(), n))?;
                b.append_link(&mut h, &m.path, Path::new(&target))
                    .map_err(broken)?;
            }
            libc::S_IFIFO => {
                h.set_entry_type(tar::EntryType::Fifo);
                b.append_data(&mut h, &m.path, io::empty())
                    .map_err(broken)?;
            }
            _ => {
                let f = File::from(at(
                    &m.path,
                    beneath::open_at(m.dir.as_fd(), n, libc::O_RDONLY | libc::O_NONBLOCK, 0),
                )?);
                // The size walked: a file that changed since is cut or padded with zeros
                // to it, so the archive stays well formed.
                let size = m.st.size;
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(size);
                let data = (&f).take(size).chain(io::repeat(0)).take(size);
                b.append_data(&mut h, &m.path, data).map_err(broken)?;
            }
        }
    }
    b.finish().map_err(broken)?;
    Ok(())
}

/// The content of an upload (the frames on stdin) as one stream; the end of the stream
/// without a commit frame is an error (the client went away).
struct Frames<'a> {
    input: io::StdinLock<'a>,
    buf: Vec<u8>,
    pos: usize,
    done: bool,
}

impl Read for Frames<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.buf.len() {
            if self.done {
                return Ok(0);
            }
            self.pos = 0;
            match read_frame(&mut self.input, &mut self.buf)? {
                Some(_) => {}
                None => {
                    self.buf.clear();
                    self.done = true;
                }
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Makes the missing directories of `parts` below `top` (as `tar` does for a member whose
/// directories the archive does not list), each step resolved beneath `top`.
fn make_parents(top: &OwnedFd, parts: &[OsString], shown: &str) -> R<OwnedFd> {
    let mut prefix = PathBuf::from(".");
    let mut dir = at(
        shown,
        beneath::open_beneath(top.as_fd(), &prefix, O_PATH_DIR, 0),
    )?;
    for p in parts {
        match beneath::mkdir_at(dir.as_fd(), Path::new(p), 0o777) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(fail(shown, &e)),
        }
        prefix.push(p);
        dir = at(
            shown,
            beneath::open_beneath(top.as_fd(), &prefix, O_PATH_DIR, 0),
        )?;
    }
    Ok(dir)
}

/// Extracts a tar stream into the directory `rel` (made if missing) as the user: every
/// member's path resolved beneath that directory (no absolute path, no `..` out, no
/// symlink followed out, not even one the archive made), files written through
/// `O_NOFOLLOW`; members arrive and land one by one (a stream cut short leaves what
/// arrived). Hard links, devices and sockets are refused.
fn untar(ws: &Ws, rel: &str, out: &mut dyn Write) -> R<()> {
    if rel != "." {
        let (dir, name) = ws.parent(rel)?;
        match beneath::mkdir_at(dir.as_fd(), &name, 0o777) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(fail(rel, &e)),
        }
    }
    let top = ws.open(rel, O_PATH_DIR)?;
    let frames = Frames {
        input: io::stdin().lock(),
        buf: Vec::new(),
        pos: 0,
        done: false,
    };
    let mut a = tar::Archive::new(frames);
    let bad = |e: io::Error| Fail(400, format!("the tar stream: {e}"));
    let mut count = 0u64;
    let mut bytes = 0u64;
    for entry in a.entries().map_err(bad)? {
        let mut e = entry.map_err(bad)?;
        let path = e.path().map_err(bad)?.into_owned();
        let shown = path.to_string_lossy().into_owned();
        let mut parts = Vec::new();
        for c in path.components() {
            match c {
                std::path::Component::Normal(n) => parts.push(n.to_os_string()),
                std::path::Component::CurDir => {}
                _ => {
                    return Err(Fail(
                        403,
                        format!("{shown}: leaves the directory (absolute or `..`); stopped there"),
                    ))
                }
            }
        }
        let Some(name) = parts.pop() else { continue };
        let parent: PathBuf = if parts.is_empty() {
            PathBuf::from(".")
        } else {
            parts.iter().collect()
        };
        let dir = match beneath::open_beneath(top.as_fd(), &parent, O_PATH_DIR, 0) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => make_parents(&top, &parts, &shown)?,
            r => at(&shown, r)?,
        };
        let n = Path::new(&name);
        let mode = e.header().mode().unwrap_or(0o644) & 0o7777;
        match e.header().entry_type() {
            tar::EntryType::Directory => match beneath::mkdir_at(dir.as_fd(), n, mode) {
                Ok(()) => {}
                Err(err) if err.raw_os_error() == Some(libc::EEXIST) => {
                    let st = at(&shown, beneath::stat_at(dir.as_fd(), n))?;
                    if !st.is_dir() {
                        return Err(Fail(409, format!("{shown}: exists and is not a directory")));
                    }
                }
                Err(err) => return Err(fail(&shown, &err)),
            },
            tar::EntryType::Symlink => {
                let target = e
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| Fail(400, format!("{shown}: a symlink without a target")))?
                    .into_owned();
                at(&shown, beneath::symlink_at(&target, dir.as_fd(), n))?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC;
                let f = File::from(at(&shown, beneath::open_at(dir.as_fd(), n, flags, mode))?);
                bytes += at(&shown, io::copy(&mut e, &mut &f))?;
                at(&shown, beneath::chmod_fd(f.as_fd(), mode))?;
            }
            t => {
                return Err(Fail(
                    400,
                    format!("{shown}: {t:?} members are not extracted (files, directories and symlinks are)"),
                ))
            }
        }
        count += 1;
    }
    line(
        out,
        &json!({ "ok": true, "status": 200, "path": rel, "entries": count, "bytes": bytes }),
    )
}
