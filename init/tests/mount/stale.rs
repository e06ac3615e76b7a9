//! The stale-read stress (issue 39): threads of this process and child processes write a
//! file through one name or handle and read it back through another, in lock step per
//! file: a write has returned (its handle closed, or on purpose still open) before the read
//! of that file starts, so every read must return exactly the bytes of the last write.
//! Handles are held open across rounds, files are replaced and recreated, and sizes cross
//! the inline threshold (4 KiB: small files live in SQLite, larger ones in body files) both
//! ways; every `--passthrough` and `--cache` mode gets its own mount.
//!
//! The outcome depends on nothing but the bytes read: load and timing only change which
//! interleavings of keel's requests happen (an OPEN against the last writer's asynchronous
//! RELEASE, FORGETs, the body pool's recycler), never what a correct keel must return.
//!
//! CI runs [`CI_ROUNDS`] rounds per mount; `KEEL_STALE_ROUNDS=N` runs N per mount and
//! `KEEL_STALE_CONFIGS="on:auto off:none ..."` picks mounts (`script/stale-stress.sh` is
//! the long run).

use crate::support;

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Read as _, Write as _};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use support::mount::{pattern, Keel};

/// Rounds per mount in the test command: a few seconds each.
const CI_ROUNDS: u64 = 2000;
/// Set in the child processes: they serve operations on stdin (see `stale_worker`).
const WORKER_ENV: &str = "KEEL_STALE_WORKER";
/// Driver threads per mount; each owns `FILES` files and two child processes.
const THREADS: u64 = 3;
const FILES: u64 = 2;
/// File sizes: around the inline threshold (4 KiB) and well past it, so that consecutive
/// rounds move a file between SQLite and a body file in both directions.
const SIZES: &[usize] = &[
    0, 1, 7, 100, 3000, 4095, 4096, 4097, 5000, 8191, 12_293, 65_539, 300_007,
];
/// Sizes of a tight round: inline-sized, so that each last close moves the file back to
/// SQLite and the next writable open gives it a body again.
const SMALL: &[usize] = &[0, 1, 7, 100, 3000, 4095, 4096];

/// How a round writes the file's new bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Write {
    /// `open(O_WRONLY|O_CREAT|O_TRUNC)`, write, close: `fs::write`, `echo >`.
    Trunc,
    /// The same, opened read-write.
    RdwrTrunc,
    /// `open(O_WRONLY)` (no truncate), `pwrite` at 0, `ftruncate` to the new size, close.
    Overwrite,
    /// The same, opened read-write.
    OverwriteRdwr,
    /// The first half truncating, the rest through a second open with `O_APPEND`.
    Append,
    /// Through a read-write handle this actor keeps open across rounds.
    Held,
    /// `Trunc`, but the handle stays open until the actor's next operation is done (so
    /// through the read when the same actor reads).
    KeepOpen,
    /// A new file under a temporary name renamed over this one (a new inode).
    Replace,
    /// Both names removed and the file created again, write-only (a new inode).
    Recreate,
    /// The same, created read-write.
    RecreateRdwr,
}

const WRITES: &[Write] = &[
    Write::Trunc,
    Write::Trunc,
    Write::Trunc,
    Write::RdwrTrunc,
    Write::Overwrite,
    Write::OverwriteRdwr,
    Write::Append,
    Write::Held,
    Write::KeepOpen,
    Write::KeepOpen,
    Write::Replace,
    Write::Recreate,
    Write::RecreateRdwr,
];

/// The writes of a tight round: each closes its handle at once (or at the next step).
const TIGHT_WRITES: &[Write] = &[
    Write::Trunc,
    Write::Trunc,
    Write::RdwrTrunc,
    Write::Overwrite,
    Write::OverwriteRdwr,
    Write::Append,
    Write::KeepOpen,
    Write::Recreate,
];

/// How a round reads the file back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    /// `fs::read`: open, fstat, read to the end, close.
    Whole,
    /// Opened read-write, read to the end, closed.
    Rdwr,
    /// Through a read-only handle this actor keeps open across rounds: fstat, pread.
    Held,
    /// The same through a kept read-write handle.
    HeldRdwr,
    /// `stat` of the name first (the size must be the new one), then `Whole`.
    StatFirst,
}

const READS: &[Read] = &[
    Read::Whole,
    Read::Whole,
    Read::Whole,
    Read::Rdwr,
    Read::Held,
    Read::HeldRdwr,
    Read::StatFirst,
];

/// The reads of a tight round: each opens and closes a handle.
const TIGHT_READS: &[Read] = &[Read::Whole, Read::Whole, Read::Rdwr, Read::StatFirst];

/// One operation, run by the driver thread itself or sent to a child process as a line.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    /// Write `pattern(len, seed)` to `path` (`other` is the file's second name).
    Write {
        how: Write,
        path: PathBuf,
        other: PathBuf,
        len: usize,
        seed: u64,
    },
    /// Read `path`: it must hold exactly `pattern(len, seed)`.
    Read {
        how: Read,
        path: PathBuf,
        len: usize,
        seed: u64,
    },
    /// Close every kept handle of paths starting with `prefix`.
    Drop { prefix: String },
}

fn write_name(w: Write) -> &'static str {
    match w {
        Write::Trunc => "trunc",
        Write::RdwrTrunc => "rdwr-trunc",
        Write::Overwrite => "overwrite",
        Write::OverwriteRdwr => "overwrite-rdwr",
        Write::Append => "append",
        Write::Held => "held",
        Write::KeepOpen => "keep-open",
        Write::Replace => "replace",
        Write::Recreate => "recreate",
        Write::RecreateRdwr => "recreate-rdwr",
    }
}

fn read_name(r: Read) -> &'static str {
    match r {
        Read::Whole => "whole",
        Read::Rdwr => "rdwr",
        Read::Held => "held",
        Read::HeldRdwr => "held-rdwr",
        Read::StatFirst => "stat-first",
    }
}

impl Op {
    /// One line: the child's request (paths on a test mount have no spaces).
    fn encode(&self) -> String {
        match self {
            Op::Write {
                how,
                path,
                other,
                len,
                seed,
            } => format!(
                "W {} {} {} {len} {seed}",
                write_name(*how),
                path.display(),
                other.display()
            ),
            Op::Read {
                how,
                path,
                len,
                seed,
            } => format!("R {} {} {len} {seed}", read_name(*how), path.display()),
            Op::Drop { prefix } => format!("D {prefix}"),
        }
    }

    fn decode(line: &str) -> Op {
        let f: Vec<&str> = line.split(' ').collect();
        let num = |i: usize| f[i].parse::<u64>().expect("number");
        match f[0] {
            "W" => Op::Write {
                how: *WRITES
                    .iter()
                    .find(|w| write_name(**w) == f[1])
                    .expect("write"),
                path: f[2].into(),
                other: f[3].into(),
                len: num(4) as usize,
                seed: num(5),
            },
            "R" => Op::Read {
                how: *READS.iter().find(|r| read_name(**r) == f[1]).expect("read"),
                path: f[2].into(),
                len: num(3) as usize,
                seed: num(4),
            },
            "D" => Op::Drop {
                prefix: f[1].into(),
            },
            _ => panic!("bad request {line:?}"),
        }
    }
}

/// What an actor (a driver thread or a child process) keeps between operations.
#[derive(Default)]
struct Actor {
    /// Kept handles by (path, read-write).
    held: HashMap<(PathBuf, bool), File>,
    /// A `KeepOpen` write's handle, closed after the next operation.
    pending: Option<File>,
}

fn err(what: &str, path: &Path, e: std::io::Error) -> String {
    format!("error: {what} {}: {e}", path.display())
}

impl Actor {
    /// Runs `op`; `bytes` is `pattern(len, seed)` of a write or read (made beforehand, so
    /// that nothing but syscalls lies between one operation's close and the next open).
    fn run(&mut self, op: &Op, bytes: &[u8]) -> Result<(), String> {
        let earlier = self.pending.take();
        let r = match op {
            Op::Write {
                how, path, other, ..
            } => self.write(*how, path, other, bytes),
            Op::Read { how, path, .. } => self.read(*how, path, bytes),
            Op::Drop { prefix } => {
                self.held
                    .retain(|(p, _), _| !p.to_string_lossy().starts_with(prefix.as_str()));
                Ok(())
            }
        };
        drop(earlier);
        r
    }

    fn kept(&mut self, path: &Path, rw: bool) -> Result<&File, String> {
        let key = (path.to_path_buf(), rw);
        if !self.held.contains_key(&key) {
            let f = OpenOptions::new()
                .read(true)
                .write(rw)
                .open(path)
                .map_err(|e| err("open kept", path, e))?;
            self.held.insert(key.clone(), f);
        }
        Ok(&self.held[&key])
    }

    fn write(&mut self, how: Write, path: &Path, other: &Path, bytes: &[u8]) -> Result<(), String> {
        let open = |opts: &mut OpenOptions, p: &Path| opts.open(p).map_err(|e| err("open", p, e));
        let put = |f: &File, p: &Path, at: u64, b: &[u8]| {
            f.write_all_at(b, at).map_err(|e| err("write", p, e))
        };
        let cut = |f: &File, p: &Path, len: usize| {
            f.set_len(len as u64).map_err(|e| err("ftruncate", p, e))
        };
        match how {
            Write::Trunc | Write::RdwrTrunc | Write::KeepOpen => {
                let f = open(
                    OpenOptions::new()
                        .read(how == Write::RdwrTrunc)
                        .write(true)
                        .create(true)
                        .truncate(true),
                    path,
                )?;
                put(&f, path, 0, bytes)?;
                if how == Write::KeepOpen {
                    self.pending = Some(f);
                }
            }
            Write::Overwrite | Write::OverwriteRdwr => {
                let f = open(
                    OpenOptions::new()
                        .read(how == Write::OverwriteRdwr)
                        .write(true),
                    path,
                )?;
                put(&f, path, 0, bytes)?;
                cut(&f, path, bytes.len())?;
            }
            Write::Append => {
                let half = bytes.len() / 2;
                let f = open(OpenOptions::new().write(true).truncate(true), path)?;
                put(&f, path, 0, &bytes[..half])?;
                drop(f);
                let mut f = open(OpenOptions::new().append(true), path)?;
                f.write_all(&bytes[half..])
                    .map_err(|e| err("append", path, e))?;
            }
            Write::Held => {
                let f = self.kept(path, true)?;
                put(f, path, 0, bytes)?;
                cut(f, path, bytes.len())?;
            }
            Write::Replace | Write::Recreate | Write::RecreateRdwr => {
                // The names get a new inode: this actor's handles kept on the old one
                // (through any name of the file) would rightly keep reading it (the
                // driver has the others close theirs).
                let stem = path.with_extension("");
                self.held.retain(|(p, _), _| p.with_extension("") != stem);
                self.fresh_inode(how, path, other, bytes)?;
            }
        }
        Ok(())
    }

    fn fresh_inode(
        &mut self,
        how: Write,
        path: &Path,
        other: &Path,
        bytes: &[u8],
    ) -> Result<(), String> {
        let open = |opts: &mut OpenOptions, p: &Path| opts.open(p).map_err(|e| err("open", p, e));
        let put = |f: &File, p: &Path, at: u64, b: &[u8]| {
            f.write_all_at(b, at).map_err(|e| err("write", p, e))
        };
        match how {
            Write::Replace => {
                let tmp = path.with_extension("tmp");
                let f = open(OpenOptions::new().write(true).create_new(true), &tmp)?;
                put(&f, &tmp, 0, bytes)?;
                drop(f);
                fs::rename(&tmp, path).map_err(|e| err("rename", path, e))?;
                relink(path, other)?;
            }
            Write::Recreate | Write::RecreateRdwr => {
                for p in [path, other] {
                    fs::remove_file(p).map_err(|e| err("unlink", p, e))?;
                }
                let f = open(
                    OpenOptions::new()
                        .read(how == Write::RecreateRdwr)
                        .write(true)
                        .create_new(true)
                        .mode(0o644),
                    path,
                )?;
                put(&f, path, 0, bytes)?;
                drop(f);
                fs::hard_link(path, other).map_err(|e| err("link", other, e))?;
            }
            _ => unreachable!("not a new inode"),
        }
        Ok(())
    }

    fn read(&mut self, how: Read, path: &Path, want: &[u8]) -> Result<(), String> {
        let got = match how {
            Read::Whole => fs::read(path).map_err(|e| err("read", path, e))?,
            Read::StatFirst => {
                let len = fs::metadata(path).map_err(|e| err("stat", path, e))?.len();
                if len != want.len() as u64 {
                    return Err(format!(
                        "stale size: stat says {len}, {} written",
                        want.len()
                    ));
                }
                fs::read(path).map_err(|e| err("read", path, e))?
            }
            Read::Rdwr => {
                let mut f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(path)
                    .map_err(|e| err("open", path, e))?;
                let mut v = Vec::new();
                f.read_to_end(&mut v).map_err(|e| err("read", path, e))?;
                v
            }
            Read::Held | Read::HeldRdwr => {
                let f = self.kept(path, how == Read::HeldRdwr)?;
                let len = f.metadata().map_err(|e| err("fstat", path, e))?.len();
                if len != want.len() as u64 {
                    return Err(format!(
                        "stale size: fstat of a kept handle says {len}, {} written",
                        want.len()
                    ));
                }
                // One byte past the end too: a kept handle must not see old bytes there.
                let mut v = vec![0u8; want.len() + 1];
                let mut n = 0;
                loop {
                    match f.read_at(&mut v[n..], n as u64) {
                        Ok(0) => break,
                        Ok(k) => n += k,
                        Err(e) => return Err(err("pread", path, e)),
                    }
                    if n == v.len() {
                        break;
                    }
                }
                v.truncate(n);
                v
            }
        };
        if got == want {
            return Ok(());
        }
        let head: String = got.iter().take(12).map(|b| format!("{b:02x}")).collect();
        Err(format!("stale len={} head={head}", got.len()))
    }
}

/// Makes `other` a second name of `path` again after `path` became a new inode.
fn relink(path: &Path, other: &Path) -> Result<(), String> {
    fs::remove_file(other).map_err(|e| err("unlink", other, e))?;
    fs::hard_link(path, other).map_err(|e| err("link", other, e))
}

/// Runs a script of operations in order; stops at the first that fails (its index and
/// why).
fn run_script(actor: &mut Actor, ops: &[Op]) -> Result<(), (usize, String)> {
    let bytes: Vec<Vec<u8>> = ops
        .iter()
        .map(|op| match op {
            Op::Write { len, seed, .. } | Op::Read { len, seed, .. } => pattern(*len, *seed),
            Op::Drop { .. } => Vec::new(),
        })
        .collect();
    for (i, op) in ops.iter().enumerate() {
        actor.run(op, &bytes[i]).map_err(|e| (i, e))?;
    }
    Ok(())
}

fn encode_script(ops: &[Op]) -> String {
    ops.iter().map(Op::encode).collect::<Vec<_>>().join(" ; ")
}

/// The child process side: runs the scripts read from stdin, one reply line each on
/// stdout (prefixed `@`: the test harness prints its own lines there too).
#[test]
#[ignore = "the process the stale-read stress tests start; nothing to do alone"]
fn stale_worker() {
    assert!(
        std::env::var_os(WORKER_ENV).is_some(),
        "started by the stale-read stress tests (with {WORKER_ENV} set), never alone"
    );
    let mut actor = Actor::default();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let line = line.expect("read a request");
        let ops: Vec<Op> = line.split(" ; ").map(Op::decode).collect();
        let reply = match run_script(&mut actor, &ops) {
            Ok(()) => "@ok".to_string(),
            Err((i, e)) => format!("@fail {i} {e}"),
        };
        writeln!(out, "{reply}").expect("reply");
        out.flush().expect("reply");
    }
}

/// `stale_worker`'s name in this test binary (its module path without the crate's name).
fn worker_test_name() -> String {
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    format!("{module}::stale_worker")
}

/// A child process serving operations (see `stale_worker`).
struct Worker {
    child: Child,
    tx: ChildStdin,
    rx: BufReader<ChildStdout>,
}

impl Worker {
    fn spawn() -> Worker {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .arg(worker_test_name())
            .args([
                "--exact",
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
                "--quiet",
            ])
            .env(WORKER_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn a worker process");
        let tx = child.stdin.take().expect("stdin");
        let rx = BufReader::new(child.stdout.take().expect("stdout"));
        Worker { child, tx, rx }
    }

    fn call(&mut self, ops: &[Op]) -> Result<(), (usize, String)> {
        writeln!(self.tx, "{}", encode_script(ops)).expect("send to a worker");
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.rx.read_line(&mut line).expect("worker reply");
            assert!(n > 0, "a worker process died");
            if let Some(reply) = line.trim_end().strip_prefix('@') {
                let Some(fail) = reply.strip_prefix("fail ") else {
                    return Ok(());
                };
                let (i, e) = fail.split_once(' ').expect("index and reason");
                return Err((i.parse().expect("index"), e.to_string()));
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// splitmix64: the driver's choices, reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len())]
    }
}

/// Who runs an operation: the driver thread itself or one of its two worker processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    Me,
    Proc(usize),
}

/// What one driver thread saw.
#[derive(Default)]
struct Tally {
    rounds: u64,
    /// Reads that returned other bytes than the last write's.
    stale: Vec<String>,
    /// Operations that failed outright.
    errors: Vec<String>,
}

struct Driver {
    me: Actor,
    procs: [Worker; 2],
    rng: Rng,
}

impl Driver {
    fn run(&mut self, who: Who, ops: &[Op]) -> Result<(), (usize, String)> {
        match who {
            Who::Me => run_script(&mut self.me, ops),
            Who::Proc(i) => self.procs[i].call(ops),
        }
    }

    fn who(&mut self) -> Who {
        match self.rng.below(3) {
            0 => Who::Me,
            i => Who::Proc(i - 1),
        }
    }

    /// Every actor closes its kept handles of the file `prefix` names.
    fn drop_kept(&mut self, prefix: &str) -> Result<(), String> {
        let op = [Op::Drop {
            prefix: prefix.to_string(),
        }];
        for who in [Who::Me, Who::Proc(0), Who::Proc(1)] {
            self.run(who, &op).map_err(|(_, e)| e)?;
        }
        Ok(())
    }

    /// A read (one of `from`) of the file's last write (`len`, `seed`), through either name
    /// or the symlink to the first.
    fn read_op(&mut self, from: &[Read], names: [&PathBuf; 3], len: usize, seed: u64) -> Op {
        Op::Read {
            how: self.rng.pick(from),
            path: names[self.rng.below(3)].clone(),
            len,
            seed,
        }
    }
}

/// The bytes a failed read of write `want` got, told against the file's recent writes
/// (newest first).
fn explain(fail: &str, history: &[(usize, u64)], want: u64) -> String {
    let parse = |key: &str| {
        fail.split(' ')
            .find_map(|w| w.strip_prefix(key))
            .map(str::to_string)
    };
    let (Some(len), Some(head)) = (parse("len="), parse("head=")) else {
        return fail.to_string();
    };
    let len: usize = len.parse().unwrap_or(usize::MAX);
    let at = history.iter().position(|(_, s)| *s == want).unwrap_or(0);
    for (age, (l, s)) in history.iter().enumerate() {
        let old = pattern(*l, *s);
        let old_head: String = old.iter().take(12).map(|b| format!("{b:02x}")).collect();
        if *l == len && old_head == head {
            let when = age as i64 - at as i64;
            return format!("{fail}: the bytes of the write {when} before the one read");
        }
    }
    fail.to_string()
}

/// One driver thread: rounds over its own `FILES` files until `reads` reads were checked.
/// A round is a burst of one to three writes through either name, each maybe read back,
/// run back to back by one actor (no message between a close and the next open), and a
/// last read by that actor or another.
fn drive(dir: &Path, thread: u64, reads: u64, seed: u64) -> Tally {
    let mut d = Driver {
        me: Actor::default(),
        procs: [Worker::spawn(), Worker::spawn()],
        rng: Rng(seed ^ thread.wrapping_mul(0xA24B_AED4_963E_E407)),
    };
    let mut t = Tally::default();
    // Per file: its two names, a symlink to the first, and the prefix of all three.
    let names: Vec<(PathBuf, PathBuf, PathBuf, String)> = (0..FILES)
        .map(|f| {
            let stem = dir.join(format!("t{thread}f{f}"));
            let prefix = stem.to_string_lossy().into_owned() + ".";
            let (a, l) = (stem.with_extension("a"), stem.with_extension("l"));
            std::os::unix::fs::symlink(a.file_name().expect("name"), &l).expect("symlink");
            (a, stem.with_extension("b"), l, prefix)
        })
        .collect();
    let mut gen = 1u64 << 32 | thread << 16;
    let mut history: Vec<Vec<(usize, u64)>> = vec![Vec::new(); FILES as usize];
    let start_over = |a: &Path, b: &Path, gen: u64| {
        let _ = fs::remove_file(a);
        let _ = fs::remove_file(b);
        fs::write(a, pattern(5, gen)).expect("create");
        fs::hard_link(a, b).expect("link");
    };
    for (f, (a, b, _, _)) in names.iter().enumerate() {
        gen += 1;
        start_over(a, b, gen);
        history[f] = vec![(5, gen)];
    }
    while t.rounds < reads {
        let f = d.rng.below(FILES as usize);
        let (a, b, l, prefix) = names[f].clone();
        // A tight round: small files, nobody keeps a handle, every step right after the
        // last one's close (an OPEN against the asynchronous RELEASE before it).
        let tight = d.rng.below(2) == 0;
        let (writes, reads, sizes) = if tight {
            (TIGHT_WRITES, TIGHT_READS, SMALL)
        } else {
            (WRITES, READS, SIZES)
        };
        let mut script = Vec::new();
        let mut fresh_inode = false;
        for _ in 0..1 + d.rng.below(4) {
            let how = d.rng.pick(writes);
            fresh_inode |= matches!(how, Write::Replace | Write::Recreate | Write::RecreateRdwr);
            let (path, other) = if d.rng.below(2) == 0 {
                (&a, &b)
            } else {
                (&b, &a)
            };
            let len = d.rng.pick(sizes);
            gen += 1;
            script.push(Op::Write {
                how,
                path: path.clone(),
                other: other.clone(),
                len,
                seed: gen,
            });
            history[f].insert(0, (len, gen));
            if d.rng.below(3) == 0 {
                script.push(d.read_op(reads, [&a, &b, &l], len, gen));
            }
        }
        history[f].truncate(8);
        let (len, seed) = history[f][0];
        // Now and then nobody keeps a handle of this file, so the next rounds open it
        // afresh; always before it becomes a new inode (a handle kept on the old one
        // rightly reads the old bytes).
        if tight || fresh_inode || d.rng.below(3) == 0 {
            if let Err(e) = d.drop_kept(&prefix) {
                t.errors.push(e);
            }
        }
        let writer = d.who();
        let last = d.read_op(reads, [&a, &b, &l], len, seed);
        let reader = d.who();
        let same = tight || (reader == writer && d.rng.below(2) == 0);
        if same {
            script.push(last.clone());
        }
        let mut outcome = d.run(writer, &script).map_err(|(i, e)| (writer, i, e));
        if outcome.is_ok() && !same {
            script.push(last.clone());
            outcome = d
                .run(reader, std::slice::from_ref(&last))
                .map_err(|(_, e)| (reader, script.len() - 1, e));
        }
        t.rounds += script
            .iter()
            .filter(|op| matches!(op, Op::Read { .. }))
            .count() as u64;
        let Err((who, i, e)) = outcome else {
            continue;
        };
        let steps: Vec<String> = script[..=i].iter().map(Op::encode).collect();
        let what = format!("{who:?} at step {i} of [{}]", steps.join(" ; "));
        if e.starts_with("stale") {
            let want = match &script[i] {
                Op::Read { seed, .. } => *seed,
                _ => 0,
            };
            t.stale
                .push(format!("{what}: {}", explain(&e, &history[f], want)));
        } else {
            t.errors.push(format!("{what}: {e}"));
        }
        // The file's state is unknown now: start it over.
        if let Err(e) = d.drop_kept(&prefix) {
            t.errors.push(e);
        }
        gen += 1;
        start_over(&a, &b, gen);
        history[f] = vec![(5, gen)];
    }
    t
}

fn rounds() -> u64 {
    std::env::var("KEEL_STALE_ROUNDS")
        .ok()
        .map(|v| v.parse().expect("KEEL_STALE_ROUNDS is a number"))
        .unwrap_or(CI_ROUNDS)
}

/// Whether `KEEL_STALE_CONFIGS` (e.g. "on:auto off:none") asks for this mount (all when
/// unset).
fn wanted(passthrough: &str, cache: &str) -> bool {
    std::env::var("KEEL_STALE_CONFIGS").map_or(true, |v| {
        v.split_whitespace()
            .any(|c| c == format!("{passthrough}:{cache}"))
    })
}

/// The stress on one mount; panics on any stale read or failed operation.
fn stress(passthrough: &str, cache: &str) {
    if !wanted(passthrough, cache) {
        eprintln!("not asked for by KEEL_STALE_CONFIGS");
        return;
    }
    let Some(k) = Keel::start(&["--passthrough", passthrough, "--cache", cache]) else {
        return;
    };
    let total = rounds();
    let seed = std::env::var("KEEL_STALE_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    let t0 = Instant::now();
    let tallies: Vec<Tally> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|i| {
                let per = total / THREADS + u64::from(i < total % THREADS);
                let mnt = k.mnt.clone();
                s.spawn(move || drive(&mnt, i, per, seed))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("driver thread"))
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    let rounds: u64 = tallies.iter().map(|t| t.rounds).sum();
    let stale: Vec<&String> = tallies.iter().flat_map(|t| &t.stale).collect();
    let errors: Vec<&String> = tallies.iter().flat_map(|t| &t.errors).collect();
    println!(
        "stale-stress passthrough={passthrough} cache={cache} seed={seed}: {rounds} rounds, {} stale, {} errors, {:.0} rounds/s",
        stale.len(),
        errors.len(),
        rounds as f64 / secs
    );
    for s in stale.iter().take(10) {
        println!("  stale: {s}");
    }
    for e in errors.iter().take(10) {
        println!("  error: {e}");
    }
    assert!(
        stale.is_empty() && errors.is_empty(),
        "passthrough={passthrough} cache={cache} seed={seed}: {} stale reads and {} failed operations in {rounds} rounds (first: {:?})",
        stale.len(),
        errors.len(),
        stale.first().or(errors.first())
    );
}

#[test]
fn no_stale_reads_passthrough_on_cache_auto() {
    stress("on", "auto");
}

#[test]
fn no_stale_reads_passthrough_on_cache_kernel() {
    stress("on", "kernel");
}

#[test]
fn no_stale_reads_passthrough_on_cache_none() {
    stress("on", "none");
}

#[test]
fn no_stale_reads_passthrough_off_cache_auto() {
    stress("off", "auto");
}

#[test]
fn no_stale_reads_passthrough_off_cache_kernel() {
    stress("off", "kernel");
}

#[test]
fn no_stale_reads_passthrough_off_cache_none() {
    stress("off", "none");
}
