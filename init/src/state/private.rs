//! Private state on disk: what keel keeps in a state dir or a `file://` remote is for keel's
//! own user only (directories 0700, files 0600), whatever the umask and whoever made the
//! directory. New files and directories get those modes when they are created (explicit
//! creation modes: a umask can only take bits away, never add any), and keel's process
//! umask is left alone, since everything it starts inherits it. A state dir or remote left
//! with looser modes (an older keel, a directory made by hand or by a volume driver) is
//! tightened when keel starts on it ([`secure_dir`]); `keel fsck` reports whatever is still
//! group- or world-accessible and `--repair` fixes it ([`loose_paths`]).
//!
//! The cheap signal: [`secure_dir`] walks the tree only when the root's own mode is loose,
//! and makes the root 0700 last, after everything below it, so a walk cut short is redone
//! at the next start. Under a 0700 root nothing is reachable by other users whatever its
//! own mode (they cannot search the root), so skipping the walk for a private root leaves
//! nothing exposed; a start on a private root costs one `stat`.

use std::fs::{DirBuilder, Metadata, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Mode of every directory keel creates in a state dir or a `file://` remote.
pub const DIR_MODE: u32 = 0o700;
/// Mode of every file keel creates there.
pub const FILE_MODE: u32 = 0o600;

/// Bits a private entry never has: any access for group or others, set-ID and sticky.
const LOOSE_BITS: u32 = 0o7077;

/// Entries of a state dir that are the sandbox's, not keel's: the `dir` provider's tree
/// (and the one being built). Walks leave them alone, and a state dir that holds one is
/// searchable by everyone (0711: the sandbox user reaches its workspace through it, but
/// lists nothing, and every other entry stays 0700/0600).
pub const SHARED: &[&str] = &[super::TREE, super::TREE_NEW];

/// Bits the root of `root` may have beyond 0700: search for group and others when it holds
/// the `dir` provider's tree.
fn root_allowed(root: &Path) -> u32 {
    if std::fs::symlink_metadata(root.join(SHARED[0])).is_ok_and(|m| m.is_dir()) {
        0o011
    } else {
        0
    }
}

/// Whether keel may change the mode of what `meta` describes: root may, another user only
/// what it owns. A state dir keel's user does not own (a volume given to its group, as
/// Kubernetes' `fsGroup` gives one to a non-root pod) keeps the mode its owner chose; keel
/// makes whatever it creates there 0700/0600 all the same, and walks nothing at each start
/// (it could never mark the walk done by making the root private).
pub fn may_chmod(meta: &Metadata) -> bool {
    let me = crate::sys::beneath::euid();
    me == 0 || meta.uid() == me
}

/// Whether `mode` gives group or others any access (or carries set-ID/sticky bits).
pub fn is_loose(mode: u32) -> bool {
    mode & LOOSE_BITS != 0
}

/// The private mode for an entry of this kind.
fn private_mode(is_dir: bool) -> u32 {
    if is_dir {
        DIR_MODE
    } else {
        FILE_MODE
    }
}

/// Creates `path` and any missing parents with mode 0700 (existing ones are left as they
/// are).
pub fn create_dir_all(path: &Path) -> io::Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(path)
}

/// Replaces the contents of the file at `path` with `data`; the file is 0600 afterwards
/// even if it existed with a looser mode.
pub fn write(path: &Path, data: &[u8]) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)?;
    if is_loose(f.metadata()?.mode()) {
        f.set_permissions(Permissions::from_mode(FILE_MODE))?;
    }
    f.write_all(data)
}

/// Whether the directory `dir` looks like keel's own, so that tightening it cannot touch
/// someone else's files (a state dir pointed at a home directory by mistake): it holds one
/// of `markers`, or nothing but names in `fresh` (a name ending in `*` is a prefix), as a
/// directory keel has not written much to yet; an empty directory qualifies.
pub fn looks_like_keels(dir: &Path, markers: &[&str], fresh: &[&str]) -> io::Result<bool> {
    for m in markers {
        if std::fs::symlink_metadata(dir.join(m)).is_ok() {
            return Ok(true);
        }
    }
    for e in std::fs::read_dir(dir)? {
        let name = e?.file_name();
        let name = name.to_string_lossy();
        let known = fresh.iter().any(|f| match f.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => name == *f,
        });
        if !known {
            return Ok(false);
        }
    }
    Ok(true)
}

/// What [`secure_dir`] changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tightened {
    /// Entries (the root included) whose mode was made 0600/0700.
    pub changed: u64,
    /// Entries that could not be changed.
    pub failed: u64,
    /// The first failure, for the log line.
    pub first_error: Option<String>,
}

/// Makes the directory `root` private, creating it (0700) when absent. When its own mode is
/// loose, every entry below it that is group- or world-accessible is made 0600 (0700 for
/// directories) first, then the root itself; one log line says how many, naming the root
/// as `what` ("state dir", "file:// remote"). `Ok(None)`: the root was private already,
/// nothing was walked. The caller makes sure the directory is keel's ([`looks_like_keels`]).
pub fn secure_dir(root: &Path, what: &str) -> io::Result<Option<Tightened>> {
    // The root itself may be a symlink to the real directory: follow it (only the root).
    let meta = match std::fs::metadata(root) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            create_dir_all(root)?;
            std::fs::metadata(root)?
        }
        r => r?,
    };
    if !meta.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a directory", root.display()),
        ));
    }
    let allowed = root_allowed(root);
    if !is_loose(meta.mode() & !allowed) || !may_chmod(&meta) {
        return Ok(None);
    }
    let mut t = Tightened::default();
    walk(root, meta.dev(), &mut |path, m| {
        if is_loose(m.mode()) {
            match tighten(path, m.is_dir()) {
                Ok(()) => t.changed += 1,
                Err(e) => note(&mut t, path, e),
            }
        }
    })
    .unwrap_or_else(|e| note(&mut t, root, e));
    // The root last: a walk cut short leaves it loose, so the next start walks again.
    match std::fs::set_permissions(root, Permissions::from_mode(DIR_MODE | allowed)) {
        Ok(()) => t.changed += 1,
        Err(e) => note(&mut t, root, e),
    }
    tracing::info!(
        "{what} {}: tightened {} files/dirs to 0600/0700 (it was {:04o}: made by an older keel or with looser modes)",
        root.display(),
        t.changed,
        meta.mode() & 0o7777
    );
    if let Some(e) = &t.first_error {
        tracing::warn!(
            "{what} {}: could not tighten {} files/dirs (first: {e}); `keel fsck --repair` retries",
            root.display(),
            t.failed
        );
    }
    Ok(Some(t))
}

fn note(t: &mut Tightened, path: &Path, e: io::Error) {
    t.failed += 1;
    if t.first_error.is_none() {
        t.first_error = Some(format!("{}: {e}", path.display()));
    }
}

/// Makes one entry private (0700 for a directory, else 0600). Never follows a symlink at
/// `path`: it is left alone (its own mode means nothing).
pub fn tighten(path: &Path, is_dir: bool) -> io::Result<()> {
    if std::fs::symlink_metadata(path)?.file_type().is_symlink() {
        return Ok(());
    }
    std::fs::set_permissions(path, Permissions::from_mode(private_mode(is_dir)))
}

/// One group- or world-accessible entry found by [`loose_paths`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loose {
    pub path: PathBuf,
    /// Permission bits (with set-ID/sticky) as found.
    pub mode: u32,
    pub is_dir: bool,
}

/// Every entry of the tree at `root` (the root included) that is group- or world-accessible,
/// sorted by path. Symlinks are not followed and other filesystems mounted below `root` are
/// not entered.
pub fn loose_paths(root: &Path) -> io::Result<Vec<Loose>> {
    let meta = std::fs::metadata(root)?;
    let mut out = Vec::new();
    if is_loose(meta.mode() & !root_allowed(root)) {
        out.push(Loose {
            path: root.to_path_buf(),
            mode: meta.mode() & 0o7777,
            is_dir: meta.is_dir(),
        });
    }
    walk(root, meta.dev(), &mut |path, m| {
        if is_loose(m.mode()) {
            out.push(Loose {
                path: path.to_path_buf(),
                mode: m.mode() & 0o7777,
                is_dir: m.is_dir(),
            });
        }
    })?;
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// Calls `f` for every entry below `root` (not the root): symlinks are reported but never
/// followed, and directories on another device than `dev` are reported but not entered.
/// Entries that vanish meanwhile are skipped.
fn walk(root: &Path, dev: u64, f: &mut dyn FnMut(&Path, &Metadata)) -> io::Result<()> {
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound && dir != root => continue,
            Err(e) => return Err(e),
        };
        for e in entries {
            let e = e?;
            if dir == root && SHARED.iter().any(|n| e.file_name() == *n) {
                continue;
            }
            let path = e.path();
            let m = match std::fs::symlink_metadata(&path) {
                Ok(m) => m,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            if m.file_type().is_symlink() {
                continue;
            }
            f(&path, &m);
            if m.is_dir() && m.dev() == dev {
                stack.push(path);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{BODIES, LEASE_HOLDER, LOCK, META_DB};

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    fn chmod(p: &Path, m: u32) {
        std::fs::set_permissions(p, Permissions::from_mode(m)).unwrap();
    }

    /// A tree as an older keel left it under umask 022.
    fn loose_tree(root: &Path) {
        std::fs::create_dir_all(root.join(BODIES).join("0a")).unwrap();
        std::fs::write(root.join(META_DB), b"x").unwrap();
        std::fs::write(root.join(BODIES).join("0a/10a"), b"y").unwrap();
        std::fs::write(root.join("private"), b"z").unwrap();
        chmod(root, 0o755);
        chmod(&root.join(BODIES), 0o755);
        chmod(&root.join(BODIES).join("0a"), 0o777);
        chmod(&root.join(META_DB), 0o644);
        chmod(&root.join(BODIES).join("0a/10a"), 0o4666);
        chmod(&root.join("private"), 0o600);
    }

    #[test]
    fn secure_dir_tightens_a_loose_tree_once() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("state");
        loose_tree(&root);
        // A symlink below the root pointing out of it: never followed.
        let outside = d.path().join("outside");
        std::fs::write(&outside, b"o").unwrap();
        chmod(&outside, 0o644);
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();

        assert_eq!(loose_paths(&root).unwrap().len(), 5);
        let t = secure_dir(&root, "state dir").unwrap().expect("walked");
        assert_eq!(t.changed, 5, "{t:?}");
        assert_eq!(t.failed, 0);
        assert_eq!(mode(&root), 0o700);
        assert_eq!(mode(&root.join(BODIES)), 0o700);
        assert_eq!(mode(&root.join(BODIES).join("0a")), 0o700);
        assert_eq!(mode(&root.join(META_DB)), 0o600);
        assert_eq!(mode(&root.join(BODIES).join("0a/10a")), 0o600);
        assert_eq!(mode(&root.join("private")), 0o600);
        assert_eq!(mode(&outside), 0o644, "followed a symlink");
        assert!(loose_paths(&root).unwrap().is_empty());

        // A private root is not walked: a loose file below it stays (fsck finds it).
        chmod(&root.join(META_DB), 0o644);
        assert_eq!(secure_dir(&root, "state dir").unwrap(), None);
        assert_eq!(mode(&root.join(META_DB)), 0o644);
        let l = loose_paths(&root).unwrap();
        assert_eq!(
            l,
            vec![Loose {
                path: root.join(META_DB),
                mode: 0o644,
                is_dir: false
            }]
        );
    }

    #[test]
    fn secure_dir_creates_missing_dirs_private() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("a/b/state");
        assert_eq!(secure_dir(&root, "state dir").unwrap(), None);
        assert_eq!(mode(&root), 0o700);
        assert_eq!(mode(&d.path().join("a")), 0o700);
        let f = d.path().join("not-a-dir");
        std::fs::write(&f, b"").unwrap();
        let e = secure_dir(&f, "state dir").unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");
    }

    #[test]
    fn only_keels_own_dirs_look_like_keels() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let ours = |dir: &Path| looks_like_keels(dir, &[META_DB], &[LOCK, ".tmp.*"]);
        assert!(ours(dir).unwrap(), "an empty dir");
        std::fs::write(dir.join(LOCK), b"").unwrap();
        std::fs::write(dir.join(".tmp.12.0"), b"").unwrap();
        assert!(ours(dir).unwrap(), "only fresh names");
        std::fs::write(dir.join(".bashrc"), b"").unwrap();
        assert!(!ours(dir).unwrap(), "someone else's file");
        std::fs::write(dir.join(META_DB), b"").unwrap();
        assert!(ours(dir).unwrap(), "the marker");
    }

    #[test]
    fn write_makes_an_existing_loose_file_private() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(LEASE_HOLDER);
        std::fs::write(&p, b"old old old").unwrap();
        chmod(&p, 0o666);
        write(&p, b"new").unwrap();
        assert_eq!(mode(&p), 0o600);
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        let q = d.path().join("fresh");
        write(&q, b"1").unwrap();
        assert_eq!(mode(&q), 0o600);
    }
}
