//! The thread of one process: it reads the process's stdout and stderr (or its terminal) into
//! the record's output files as they come, whether or not a client listens; keeps the
//! timeout, independent of any connection; carries out a kill (TERM to the whole tree,
//! KILL after the grace); and once the process has exited (the reaper says so) and its
//! output is at end of file (and, after a kill, nothing of its tree is left), runs the
//! workspace options after it and marks the record done.

use std::fs::File;
use std::io::{ErrorKind, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::record::{Phase, Record};
use super::{around, kill_tree, signal_tree, tree_alive, Processes};
use crate::persist::CheckpointHandle;
use crate::sys::pipe;

/// keel's ends of a new process's streams.
#[derive(Debug, Default)]
pub(super) struct Io {
    /// (fd, 1 for stdout or the terminal, 2 for stderr).
    pub outputs: Vec<(OwnedFd, u8)>,
    /// Bytes for its stdin, written by a thread of their own, then closed.
    pub stdin_bytes: Option<(Option<File>, Vec<u8>)>,
}

/// Bytes read from one stream per call before the others get their turn.
const ROUND: usize = 4 << 20;
/// While a killed tree is going away, how often it is looked at.
const GONE_POLL: Duration = Duration::from_millis(20);

pub(super) fn run(
    table: &Processes,
    rec: &Arc<Record>,
    io: Io,
    grace: Duration,
    agent: Option<CheckpointHandle>,
    before: around::Before,
) {
    if let Some((Some(w), bytes)) = io.stdin_bytes {
        let id = rec.id;
        let _ = std::thread::Builder::new()
            .name(format!("keel-exec-{id}-in"))
            .spawn(move || {
                use std::io::Write;
                // A process that exits without reading it all closes the pipe: EPIPE.
                let _ = (&w).write_all(&bytes);
            });
    }
    // (its fd, 1 or 2, whether it can be spliced into its file: a pipe can, a terminal not;
    // whether its bytes are kept: not after its file failed, then the pipe is only drained).
    let mut streams: Vec<(File, u8, bool, bool)> = Vec::new();
    for (fd, which) in io.outputs {
        let _ = pipe::set_nonblocking(&fd);
        let _ = pipe::set_pipe_size(&fd, 1 << 20);
        streams.push((File::from(fd), which, !rec.pty, true));
    }
    let mut buf = vec![0u8; 256 << 10];
    let Some(wake) = rec.wake_fd() else {
        // Only a record its pump finished has no wake fd: it is done already, so there is
        // nothing to finish; a second pump is a bug.
        if cfg!(debug_assertions) {
            panic!("exec {}: its pump started twice", rec.id);
        }
        warn!("exec {}: its pump started twice", rec.id);
        return;
    };
    // Counted from the spawn (the options before it may have taken a while).
    let deadline = rec.timeout.map(|t| Instant::now() + t);
    // After a TERM: when the KILL goes out, and whether it did.
    let mut kill_at: Option<Instant> = None;
    let mut killed_hard = false;
    loop {
        let now = Instant::now();
        let (exited, asked) = {
            let s = rec.lock();
            (s.exit.is_some(), s.kill_asked)
        };
        if asked && kill_at.is_none() {
            rec.update(|s| s.kill_asked = false);
            info!("exec {}: killing its process tree", rec.id);
            signal_tree(rec, libc::SIGTERM);
            kill_at = Some(now + grace);
        }
        if deadline.is_some_and(|d| now >= d) && kill_at.is_none() {
            info!(
                "exec {}: timeout after {:?}: TERM to its process tree",
                rec.id,
                rec.timeout.unwrap_or_default()
            );
            rec.update(|s| s.timed_out = true);
            signal_tree(rec, libc::SIGTERM);
            kill_at = Some(now + grace);
        }
        if kill_at.is_some_and(|k| now >= k) && !killed_hard {
            kill_tree(rec);
            killed_hard = true;
        }
        if streams.is_empty() && exited && (kill_at.is_none() || !tree_alive(rec)) {
            break;
        }
        if killed_hard && streams.is_empty() && exited {
            // Forks racing with the KILL: again.
            kill_tree(rec);
        }
        let mut next = deadline.filter(|_| kill_at.is_none());
        if let Some(k) = kill_at.filter(|_| !killed_hard) {
            next = Some(next.map_or(k, |n| n.min(k)));
        }
        if kill_at.is_some() && streams.is_empty() && exited {
            next = Some(now + GONE_POLL);
        }
        let timeout = next.map(|n| n.saturating_duration_since(now));
        let ready = {
            let mut fds: Vec<std::os::fd::BorrowedFd<'_>> =
                streams.iter().map(|(f, ..)| f.as_fd()).collect();
            fds.push(wake.as_fd());
            match pipe::wait_readable(&fds, timeout) {
                Ok(r) => r,
                Err(e) => {
                    warn!("exec {}: poll: {e}", rec.id);
                    std::thread::sleep(GONE_POLL);
                    continue;
                }
            }
        };
        if ready.last() == Some(&true) {
            wake.clear();
        }
        let mut ended = Vec::new();
        for (i, (f, which, splice, keep)) in streams.iter_mut().enumerate() {
            if !ready[i] {
                continue;
            }
            let out = if *which == 1 {
                &rec.stdout
            } else {
                &rec.stderr
            };
            let mut taken = 0;
            while taken < ROUND {
                // Straight from the pipe into the file; a read when it holds nothing (it
                // may be at its end) or cannot be spliced.
                if *splice && *keep {
                    match out.splice_from(f.as_fd(), ROUND - taken) {
                        Ok(0) => {}
                        Ok(n) => {
                            taken += n;
                            rec.update(|_| {});
                            continue;
                        }
                        Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                        Err(_) => *splice = false,
                    }
                }
                match f.read(&mut buf) {
                    Ok(0) => {
                        ended.push(i);
                        break;
                    }
                    Ok(n) => {
                        taken += n;
                        if *keep {
                            if let Err(e) = out.append(&buf[..n]) {
                                // Once: the rest of this stream is read and dropped, so the
                                // process never blocks on a full pipe; the record says why.
                                *keep = false;
                                output_failed(rec, *which, &e);
                            }
                        }
                        rec.update(|_| {});
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    // A terminal whose every slave fd is closed reads EIO.
                    Err(_) => {
                        ended.push(i);
                        break;
                    }
                }
            }
        }
        for i in ended.into_iter().rev() {
            streams.remove(i);
        }
    }
    drop(wake);
    rec.drop_wake();
    finish(table, rec, agent, before);
}

/// The output file of stream `which` (1 stdout or the terminal, 2 stderr) failed with `e`
/// (no space, no descriptor left to create it): the record's `output_error` names the first
/// such failure (the exit event and the process's JSON show it), and one warning says it.
fn output_failed(rec: &Record, which: u8, e: &std::io::Error) {
    let name = if which == 1 { "stdout" } else { "stderr" };
    let at = if which == 1 {
        rec.stdout.len()
    } else {
        rec.stderr.len()
    };
    let msg =
        format!("{name}: keeping its output failed after {at} bytes: {e}; the rest was dropped");
    warn!("exec {}: {msg}", rec.id);
    rec.update(|s| {
        s.output_error.get_or_insert(msg);
    });
}

/// The process has ended and its output is in: count what it cost, run the options after it,
/// mark the record done.
fn finish(
    table: &Processes,
    rec: &Arc<Record>,
    agent: Option<CheckpointHandle>,
    before: around::Before,
) {
    let cg = rec.cgroup.get();
    let (cpu, peak) = (
        cg.and_then(|c| c.cpu()),
        cg.and_then(|c| c.memory_peak_kib()),
    );
    rec.update(|s| {
        s.phase = Phase::Finishing;
        s.tree_cpu = cpu;
        s.tree_peak_kib = peak;
    });
    let (spawned, success, timed_out) = {
        let s = rec.lock();
        (
            s.error.is_none(),
            s.exit.is_some_and(|(e, _)| e.success()) && s.error.is_none(),
            s.timed_out,
        )
    };
    if let Some(agent) = agent.filter(|_| rec.around.any()) {
        let ws = if table.closed() {
            around::skipped(&rec.around, &before, "keel is stopping", &agent)
        } else {
            around::after(&rec.around, &before, spawned, success, timed_out, &agent)
        };
        rec.update(|s| s.workspace = ws);
    }
    let exit = rec.lock().exit;
    // Done, its place in `max_processes` free and queued for `prune`, in one step.
    table.finished(rec);
    if let Some((e, _)) = exit {
        info!(
            "exec {}: ended: {e} after {:.3}s",
            rec.id,
            rec.started.elapsed().as_secs_f64()
        );
    }
    if let Some(cg) = cg {
        if !cg.populated() {
            let _ = cg.remove();
        }
    }
}
