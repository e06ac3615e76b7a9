//! The scheduling class of the FUSE-over-io_uring ring threads. A ring thread answers a
//! request by waking the process that made it, on the ring's CPU. If the ring thread is an
//! ordinary task at that moment, its CPU is busy and the scheduler moves the woken process to
//! an idle CPU: one migration per request, and on a VM whose idle vCPUs halt, an
//! interprocessor interrupt and a vCPU wake-up each time (measured here: a bare round trip
//! of ~50 µs instead of ~15 µs). In the idle class (`SCHED_IDLE`) the ring thread's CPU
//! counts as idle, so the process stays where it is and its next request is served on the
//! same CPU again. The idle class yields to every ordinary task, though, so under CPU
//! contention it would slow the workspace down: in `auto` a governor samples the idle time
//! of the CPUs keel may run on and keeps the ring threads in the normal class while those
//! are busy (when no CPU is idle there is nothing to gain anyway), and in the idle class
//! once they have had idle time again for a while. It also keeps them normal while
//! processes are being started in quick succession (a shell loop, `make`): `exec` puts the
//! new program on the idlest CPU, and a CPU running only an idle-class thread counts as
//! idle, so with every exec the program moved to the CPU where a ring thread was serving
//! (`perf stat -e sched:sched_migrate_task`, 500 × `cat >> f`: 553 migrations in the idle
//! class, 59 in the normal one and 102 on ext4; the loop took ~10 % longer).

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::config::RingSched;
use crate::sys::fusedev::EventFd;
use crate::sys::sched;

/// How often the governor samples the CPUs.
const SAMPLE: Duration = Duration::from_millis(200);
/// A sample whose CPUs were idle for less than this fraction of their time is busy.
const BUSY_BELOW: f64 = 0.15;
/// Calm samples in a row before the ring threads go back to the idle class.
const CALM_SAMPLES: u32 = 3;
/// A sample with more new processes or threads than this (200 a second) is busy.
const FORKS_BUSY: u64 = 40;

/// The ring threads of one connection and the class they are in.
#[derive(Debug)]
pub struct RingClass {
    /// `ring_sched` as it turned out (`auto` may have fallen back to `normal`).
    mode: RingSched,
    idle: AtomicBool,
    /// Thread ids of the ring threads serving now.
    tids: Mutex<Vec<i32>>,
}

/// A ring thread's membership: leaves the list when dropped (the thread ends), so the
/// governor never touches a thread id that may have been reused.
pub struct Enlisted<'a> {
    class: &'a RingClass,
    tid: i32,
}

impl Drop for Enlisted<'_> {
    fn drop(&mut self) {
        self.class.tids().retain(|&t| t != self.tid);
    }
}

impl RingClass {
    /// The class for `mode`, and for `auto` the governor's first decision (idle). `auto`
    /// falls back to `normal` for good where a thread could not leave the idle class again
    /// (that needs CAP_SYS_NICE, which container runtimes do not grant by default).
    pub fn new(mode: RingSched) -> Arc<RingClass> {
        let mode = match mode {
            RingSched::Auto if !can_leave_idle_class() => {
                tracing::info!("ring threads stay in the normal scheduling class: leaving SCHED_IDLE needs CAP_SYS_NICE");
                RingSched::Normal
            }
            m => m,
        };
        Arc::new(RingClass {
            mode,
            idle: AtomicBool::new(mode != RingSched::Normal),
            tids: Mutex::new(Vec::new()),
        })
    }

    fn tids(&self) -> std::sync::MutexGuard<'_, Vec<i32>> {
        self.tids.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Called by each ring thread before it serves: puts it in the current class.
    pub fn enlist(&self) -> Enlisted<'_> {
        let tid = sched::thread_id();
        let mut tids = self.tids();
        if self.is_idle() {
            if let Err(e) = sched::set_idle_class(0, true) {
                tracing::debug!(error = %e, "could not put a ring thread in the idle class");
            }
        }
        tids.push(tid);
        Enlisted { class: self, tid }
    }

    /// The ring threads are in the idle class.
    pub fn is_idle(&self) -> bool {
        self.idle.load(Ordering::Relaxed)
    }

    /// Moves every ring thread to the idle class, or back to the normal one.
    pub fn set(&self, idle: bool) {
        let tids = self.tids();
        self.idle.store(idle, Ordering::Relaxed);
        for &tid in tids.iter() {
            if let Err(e) = sched::set_idle_class(tid, idle) {
                tracing::warn!(tid, idle, error = %e, "could not change a ring thread's scheduling class");
            }
        }
        tracing::debug!(idle, "ring threads' scheduling class changed");
    }

    /// Starts the governor of `auto` (nothing for the fixed modes); it stops when `stop`
    /// is signalled.
    pub fn govern(self: &Arc<Self>, stop: Arc<EventFd>) -> io::Result<Option<JoinHandle<()>>> {
        if self.mode != RingSched::Auto {
            return Ok(None);
        }
        let cpus = sched::allowed_cpus()?;
        let class = self.clone();
        let t = std::thread::Builder::new()
            .name("keel-ring-sched".into())
            .spawn(move || class.governor(&cpus, &stop))?;
        Ok(Some(t))
    }

    fn governor(&self, cpus: &[usize], stop: &EventFd) {
        let mut g = Governor {
            idle: self.is_idle(),
            calm: 0,
        };
        let mut stat = ProcStat::open();
        let mut last = stat.sample(cpus);
        loop {
            match stop.wait_timeout(SAMPLE) {
                Ok(false) => {}
                Ok(true) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "ring scheduling governor stops; ring threads go to the normal class");
                    return self.set(false);
                }
            }
            let now = stat.sample(cpus);
            let Some((frac, forks)) = last.zip(now).and_then(|(a, b)| b.since(a)) else {
                if now.is_none() {
                    tracing::info!(
                        "cannot read /proc/stat; ring threads stay in the normal scheduling class"
                    );
                    return self.set(false);
                }
                last = now;
                continue;
            };
            last = now;
            let idle = g.step(frac, forks);
            if idle != self.is_idle() {
                self.set(idle);
            }
        }
    }
}

/// Whether a thread of this process can go into the idle class and come back out of it.
/// Tried on a throwaway thread, which may be left stuck in the idle class.
fn can_leave_idle_class() -> bool {
    std::thread::Builder::new()
        .name("keel-sched-probe".into())
        .spawn(|| sched::set_idle_class(0, true).is_ok() && sched::set_idle_class(0, false).is_ok())
        .ok()
        .and_then(|t| t.join().ok())
        .unwrap_or(false)
}

/// The `auto` decision, one sample at a time.
#[derive(Debug)]
struct Governor {
    idle: bool,
    calm: u32,
}

impl Governor {
    /// Takes the idle fraction of the last sample and the processes started in it; returns
    /// whether the ring threads should be in the idle class now: not after a busy sample,
    /// again after `CALM_SAMPLES` calm ones in a row.
    fn step(&mut self, idle_frac: f64, forks: u64) -> bool {
        if idle_frac < BUSY_BELOW || forks > FORKS_BUSY {
            self.idle = false;
            self.calm = 0;
        } else if !self.idle {
            self.calm += 1;
            self.idle = self.calm >= CALM_SAMPLES;
        }
        self.idle
    }
}

/// Cumulative idle and total time of a set of CPUs, in the kernel's clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CpuTime {
    idle: u64,
    total: u64,
}

impl CpuTime {
    /// The fraction of the time since `earlier` that the CPUs were idle (None: no time
    /// passed, or the counters went backwards).
    fn idle_since(self, earlier: CpuTime) -> Option<f64> {
        let total = self.total.checked_sub(earlier.total)?;
        let idle = self.idle.checked_sub(earlier.idle)?;
        (total > 0).then(|| idle.min(total) as f64 / total as f64)
    }
}

/// One reading of `/proc/stat`: the allowed CPUs' times and the processes (and threads)
/// started since boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sample {
    cpu: CpuTime,
    forks: u64,
}

impl Sample {
    /// The idle fraction and the processes started since `earlier` (None as for
    /// `CpuTime::idle_since`).
    fn since(self, earlier: Sample) -> Option<(f64, u64)> {
        let frac = self.cpu.idle_since(earlier.cpu)?;
        Some((frac, self.forks.saturating_sub(earlier.forks)))
    }
}

/// `/proc/stat`, kept open and read again from the start for every sample.
struct ProcStat {
    file: Option<std::fs::File>,
    buf: Vec<u8>,
}

impl ProcStat {
    fn open() -> ProcStat {
        ProcStat {
            file: std::fs::File::open("/proc/stat").ok(),
            buf: vec![0; 16 << 10],
        }
    }

    fn sample(&mut self, cpus: &[usize]) -> Option<Sample> {
        use std::os::unix::fs::FileExt;
        let f = self.file.as_ref()?;
        loop {
            let n = f.read_at(&mut self.buf, 0).ok()?;
            if n < self.buf.len() {
                let text = std::str::from_utf8(&self.buf[..n]).ok()?;
                return Some(Sample {
                    cpu: parse_cpu_time(text, cpus)?,
                    forks: parse_forks(text)?,
                });
            }
            // Did not fit (many CPUs): grow the buffer and read it again.
            let more = self.buf.len() * 2;
            self.buf.resize(more, 0);
        }
    }
}

/// Sums the `cpuN` lines of `/proc/stat` for the CPUs in `cpus`: idle time is idle plus
/// iowait (a ring thread waiting for requests counts as iowait), total time is everything up
/// to steal. None when no line of those CPUs is there.
fn parse_cpu_time(stat: &str, cpus: &[usize]) -> Option<CpuTime> {
    let mut t = CpuTime { idle: 0, total: 0 };
    let mut seen = false;
    for line in stat.lines() {
        let mut f = line.split_ascii_whitespace();
        let Some(cpu) = f.next().and_then(|n| n.strip_prefix("cpu")) else {
            continue;
        };
        let Ok(n) = cpu.parse::<usize>() else {
            continue;
        };
        if !cpus.contains(&n) {
            continue;
        }
        // user nice system idle iowait irq softirq steal [guest guest_nice: inside user]
        let v: Vec<u64> = f.take(8).map_while(|x| x.parse().ok()).collect();
        if v.len() < 5 {
            continue;
        }
        t.idle += v[3] + v[4];
        t.total += v.iter().sum::<u64>();
        seen = true;
    }
    seen.then_some(t)
}

/// The `processes` line of `/proc/stat`: processes and threads created since boot.
fn parse_forks(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|l| l.strip_prefix("processes "))
        .and_then(|n| n.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  100 0 50 1000 20 0 5 0 0 0
cpu0 60 0 30 400 10 0 3 0 0 0
cpu1 40 0 20 600 10 0 2 7 0 0
intr 12345 0 1 2
ctxt 999
processes 4321
";

    #[test]
    fn sums_the_allowed_cpus_only() {
        assert_eq!(
            parse_cpu_time(STAT, &[0, 1]),
            Some(CpuTime {
                idle: 1020,
                total: 1182
            })
        );
        assert_eq!(
            parse_cpu_time(STAT, &[1]),
            Some(CpuTime {
                idle: 610,
                total: 679
            })
        );
        assert_eq!(parse_cpu_time(STAT, &[5]), None);
        assert_eq!(parse_cpu_time("garbage\n", &[0]), None);
        assert_eq!(parse_forks(STAT), Some(4321));
        assert_eq!(parse_forks("cpu0 1 2 3 4 5\n"), None);
    }

    #[test]
    fn reads_this_machines_cpus_again_and_again() {
        let cpus = sched::allowed_cpus().unwrap();
        let mut stat = ProcStat::open();
        stat.buf.truncate(64); // forces the growing path
        let a = stat.sample(&cpus).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        std::thread::spawn(|| ()).join().unwrap();
        let b = stat.sample(&cpus).unwrap();
        assert!(
            a.cpu.total > 0 && b.cpu.total >= a.cpu.total && b.cpu.idle >= a.cpu.idle,
            "{a:?} {b:?}"
        );
        assert!(b.forks > a.forks, "a new thread counts: {a:?} {b:?}");
    }

    #[test]
    fn idle_fraction_between_two_samples() {
        let a = CpuTime {
            idle: 100,
            total: 200,
        };
        let b = CpuTime {
            idle: 130,
            total: 300,
        };
        assert_eq!(b.idle_since(a), Some(0.3));
        assert_eq!(a.idle_since(a), None);
        assert_eq!(a.idle_since(b), None);
    }

    #[test]
    fn busy_goes_normal_at_once_and_calm_returns_slowly() {
        let mut g = Governor {
            idle: true,
            calm: 0,
        };
        assert!(g.step(0.5, 0));
        assert!(!g.step(0.05, 0), "one busy sample is enough");
        assert!(!g.step(0.5, 0));
        assert!(!g.step(0.5, 0));
        assert!(!g.step(0.01, 0), "a busy sample restarts the count");
        for _ in 1..CALM_SAMPLES {
            assert!(!g.step(0.9, 0));
        }
        assert!(g.step(0.9, 0), "{CALM_SAMPLES} calm samples in a row");
        assert!(
            g.step(BUSY_BELOW, FORKS_BUSY),
            "the thresholds themselves are calm"
        );
        assert!(
            !g.step(0.9, FORKS_BUSY + 1),
            "processes started in quick succession are busy too"
        );
        assert!(!g.step(0.9, 2), "and the count starts again");
    }

    #[test]
    fn a_thread_can_join_and_leave_the_idle_class() {
        let class = RingClass::new(RingSched::Idle);
        assert_eq!(class.mode, RingSched::Idle);
        std::thread::scope(|s| {
            s.spawn(|| {
                let e = class.enlist();
                assert!(sched::is_idle_class(0).unwrap());
                assert_eq!(class.tids().len(), 1);
                drop(e);
                assert!(class.tids().is_empty());
            });
        });
    }
}
