//! `keel run [--takeover[=MODE]] [--] [CMD [ARGS]...]`, also bare `keel CMD ARGS`: keel as the
//! container's init. Options end at the command: what follows is the command's.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use keel::run::RunError;

/// Run as the container's init (PID 1): boot, mount the workspace, supervise CMD and the
/// configured services, then save the workspace and exit with CMD's status.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub lease: super::TakeoverArg,
    /// The main command and its arguments (none: only the configured services)
    #[arg(trailing_var_arg = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

pub fn main(config: Option<&Path>, a: RunArgs) -> i32 {
    let r = keel::run::main(keel::run::RunOptions {
        config: config.map(Path::to_path_buf),
        takeover: a.lease.takeover,
        command: a.command,
    });
    match r {
        Ok(code) => code,
        Err(e) => exit_code(&e),
    }
}

/// A bare `keel WORD ...`: `keel run WORD ...`, unless keel is not PID 1, WORD is a near
/// miss of one of the `subcommands` and neither a path nor a command on PATH. On a host that
/// is a mistyped subcommand (`keel restor`), and running it would set up an init first (the
/// state dir, the mount point): refused before anything is made, exit 2. Any other word
/// runs, PID 1 or not (`podman run --init`, a pod sharing its process namespace): a command
/// may live where only the mount makes it appear.
pub fn implicit(config: Option<&Path>, a: RunArgs, subcommands: &[String]) -> i32 {
    if let Some(word) = a.command.first() {
        if !keel::sys::process::is_pid1() && near_miss(word, subcommands) && !runnable(word) {
            eprintln!(
                "keel: '{}' is not a keel subcommand and no command of that name is on PATH \
                 (`keel --help` lists the subcommands; `keel run -- CMD` runs CMD anyway)",
                word.to_string_lossy()
            );
            return super::EXIT_USAGE;
        }
    }
    main(config, a)
}

/// `word` is at most two edits (insert, delete, substitute, swap two neighbours) from one of
/// `names`, one for a name of four letters or fewer (`gcc` is a typo of `gc`, `ls` is not),
/// or one of them exactly (`keel status` spelled with a flag first).
fn near_miss(word: &OsStr, names: &[String]) -> bool {
    let Some(word) = word.to_str() else {
        return false;
    };
    names
        .iter()
        .any(|n| edit_distance(word, n) <= if n.chars().count() <= 4 { 1 } else { 2 })
}

/// Optimal-string-alignment distance between `a` and `b` (Levenshtein plus swaps of two
/// neighbours), over chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // d[i][j]: the distance between a[..i] and b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

/// `word` names a path (it holds a `/`) or an executable file in a directory of PATH.
fn runnable(word: &OsStr) -> bool {
    if word.as_bytes().contains(&b'/') {
        return true;
    }
    let Some(path) = std::env::var_os("PATH") else {
        return false;
    };
    std::env::split_paths(&path).any(|dir| {
        std::fs::metadata(dir.join(word))
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    })
}

/// keel's exit code when `keel run` stopped before supervising anything (the error is
/// logged already): 2 for usage and config, 1 for setup.
fn exit_code(e: &RunError) -> i32 {
    match e {
        RunError::Config(_) | RunError::Credentials(_) => super::EXIT_USAGE,
        RunError::Control(keel::control::ControlError::Token(_)) => super::EXIT_USAGE,
        _ => super::EXIT_SETUP,
    }
}

#[cfg(test)]
mod tests {
    use super::{edit_distance, near_miss, runnable};
    use std::ffi::OsStr;

    #[test]
    fn only_a_near_miss_of_a_subcommand_counts_as_a_typo() {
        let names: Vec<String> = ["restore", "status", "snapshot", "gc"]
            .map(String::from)
            .to_vec();
        for typo in ["restor", "stauts", "statsu", "snapshto", "gcc", "rstore"] {
            assert!(near_miss(OsStr::new(typo), &names), "{typo}");
        }
        // A command of the sandbox's own, found only once the workspace is mounted.
        for word in [
            "my-build-tool",
            "pytest",
            "deploy.sh",
            "cargo",
            "ls",
            "make",
        ] {
            assert!(!near_miss(OsStr::new(word), &names), "{word}");
        }
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("ab", "ba"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn a_path_or_a_command_on_path_is_runnable_and_a_typo_is_not() {
        assert!(runnable(OsStr::new("/nonexistent/cmd")));
        assert!(runnable(OsStr::new("./cmd")));
        assert!(runnable(OsStr::new("sh")));
        assert!(!runnable(OsStr::new("restor")));
        assert!(!runnable(OsStr::new("keel-no-such-command-anywhere")));
    }
}
