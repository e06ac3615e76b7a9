//! Serving a FUSE connection: mounts it, answers INIT, and runs the workers that carry
//! requests between the kernel and [`FuseAdapter`]: over FUSE over io_uring when the kernel
//! offers it (one queue per CPU, each served by threads pinned to that CPU, so a request is
//! answered where it was made, without waking the other vCPU), and always over the classic
//! `/dev/fuse` read/write loop, which carries FORGET and INTERRUPT and everything before the
//! rings are ready (and everything, when io_uring is off).

use std::io::{self, IoSlice};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use super::fuse::{FuseAdapter, Negotiated, MAX_WRITE};
use super::proto::{self, Op, Reply};
use super::sched::RingClass;
use crate::config::RingSched;
use crate::sys::fusedev::{self, EventFd, FuseDev};
use crate::sys::uring::{Event, FuseQueue};

/// How requests reach keel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// `/dev/fuse` read/write by `n` threads, each on its own cloned fd.
    Classic,
    /// FUSE over io_uring, one queue per CPU (plus one classic thread).
    IoUring,
}

impl Transport {
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Classic => "classic",
            Transport::IoUring => "io_uring",
        }
    }
}

/// How to serve the connection.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// Classic worker threads when io_uring is not in use.
    pub threads: usize,
    /// Ring threads per CPU queue when it is.
    pub ring_threads: usize,
    /// Use FUSE over io_uring when the kernel offers it.
    pub io_uring: bool,
    /// Scheduling class of the ring threads.
    pub ring_sched: RingSched,
}

/// A mounted, served FUSE connection.
pub struct Session {
    mount_point: PathBuf,
    adapter: Arc<FuseAdapter>,
    workers: Vec<JoinHandle<()>>,
    stop: Arc<EventFd>,
    ended: Arc<Ended>,
    /// The mount's device number, to recognise it at the unmount.
    dev: Option<u64>,
    transport: Transport,
    /// The ring threads' scheduling class (io_uring only).
    ring_class: Option<Arc<RingClass>>,
    unmounted: bool,
}

/// Set by the workers when the kernel ends the connection (ENODEV): an unmount, keel's own
/// or from outside (`umount`, `fusermount -u`), or an abort through `/sys/fs/fuse`.
#[derive(Debug)]
pub struct Ended {
    gone: AtomicBool,
    fd: EventFd,
}

impl Ended {
    fn new() -> io::Result<Ended> {
        Ok(Ended {
            gone: AtomicBool::new(false),
            fd: EventFd::new()?,
        })
    }

    fn set(&self) {
        if !self.gone.swap(true, Ordering::SeqCst) {
            let _ = self.fd.signal();
        }
    }

    /// The connection is gone.
    pub fn is_set(&self) -> bool {
        self.gone.load(Ordering::SeqCst)
    }

    /// Readable once the connection is gone.
    pub fn fd(&self) -> &EventFd {
        &self.fd
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("mount_point", &self.mount_point)
            .field("transport", &self.transport)
            .finish()
    }
}

/// Bytes a classic worker reads at once: the largest WRITE plus its headers.
const READ_BUF_LEN: usize = MAX_WRITE as usize + 4096;

/// Mounts `dev` on `mount_point`, answers INIT through `adapter` and starts the workers.
/// `adapter` must have been built on `dev`. On any failure nothing stays mounted.
///
/// Once INIT has promised rings, the kernel holds every request until all queues are
/// registered, so the rings are built before INIT is answered (where io_uring is not allowed
/// that fails, and INIT goes out without it), and a registration the kernel then refuses
/// unmounts and mounts again over `/dev/fuse` alone.
pub fn start(
    dev: Arc<FuseDev>,
    adapter: FuseAdapter,
    mount_point: &Path,
    opts: ServeOptions,
) -> io::Result<Session> {
    let adapter = Arc::new(adapter);
    match start_once(&dev, &adapter, mount_point, opts) {
        Err(Retry::Classic(e)) => {
            tracing::warn!(error = %e, "FUSE over io_uring was refused; mounting again over /dev/fuse");
            let dev = Arc::new(FuseDev::open()?);
            adapter.set_dev(dev.clone());
            let opts = ServeOptions {
                io_uring: false,
                ..opts
            };
            start_once(&dev, &adapter, mount_point, opts).map_err(Retry::into_io)
        }
        r => r.map_err(Retry::into_io),
    }
}

/// Why one mount attempt failed.
enum Retry {
    /// The rings were refused after INIT: try again without them.
    Classic(io::Error),
    Fatal(io::Error),
}

impl Retry {
    fn into_io(self) -> io::Error {
        match self {
            Retry::Classic(e) | Retry::Fatal(e) => e,
        }
    }
}

fn start_once(
    dev: &Arc<FuseDev>,
    adapter: &Arc<FuseAdapter>,
    mount_point: &Path,
    opts: ServeOptions,
) -> Result<Session, Retry> {
    fusedev::mount_fuse(dev, mount_point, "keel").map_err(Retry::Fatal)?;
    let mut s = Session {
        mount_point: mount_point.to_path_buf(),
        adapter: adapter.clone(),
        workers: Vec::new(),
        stop: Arc::new(EventFd::new().map_err(Retry::Fatal)?),
        ended: Arc::new(Ended::new().map_err(Retry::Fatal)?),
        dev: None,
        transport: Transport::Classic,
        ring_class: None,
        unmounted: false,
    };
    // From here on, dropping `s` unmounts.
    let (unique, init) = read_init(dev).map_err(Retry::Fatal)?;
    let rings = if opts.io_uring && init.flags & proto::init_flags::OVER_IO_URING != 0 {
        match Rings::build(dev, &s, opts.ring_threads.max(1), opts.ring_sched) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::info!(error = %e, "FUSE over io_uring is offered but cannot be used here; serving over /dev/fuse");
                None
            }
        }
    } else {
        None
    };
    let negotiated =
        answer_init(dev, adapter, unique, &init, rings.is_some()).map_err(Retry::Fatal)?;
    let classic = if negotiated.io_uring {
        1
    } else {
        opts.threads.max(1)
    };
    for n in 0..classic {
        let d = if n == 0 {
            dev.clone()
        } else {
            match dev.clone_dev() {
                Ok(d) => Arc::new(d),
                Err(e) => {
                    tracing::warn!(error = %e, "FUSE_DEV_IOC_CLONE failed; sharing one fd");
                    dev.clone()
                }
            }
        };
        let a = s.adapter.clone();
        let ended = s.ended.clone();
        // With rings, this one worker only ever sees FORGETs (and INTERRUPTs, which keel
        // does not act on): it may let them gather.
        let pause = negotiated.io_uring.then_some(FORGET_BATCH);
        let t = std::thread::Builder::new()
            .name(format!("keel-fuse-{n}"))
            .spawn(move || classic_worker(&d, &a, &ended, pause))
            .map_err(Retry::Fatal)?;
        s.workers.push(t);
    }
    if let Some(rings) = rings {
        if !negotiated.io_uring {
            rings.cancel();
        } else {
            match rings.register(&mut s) {
                Ok(()) => s.transport = Transport::IoUring,
                Err(e) => {
                    // This connection can never serve: the kernel holds its requests for
                    // rings that will not all register. Get it off the mount point even if
                    // something already waits on it, so the next mount's stat of the
                    // mount point does not wait too.
                    if fusedev::unmount(mount_point).is_err() {
                        let _ = crate::sys::file::detach_mount(mount_point);
                    }
                    s.unmounted = true;
                    let _ = s.stop.signal();
                    return Err(Retry::Classic(e));
                }
            }
        }
    }
    s.dev = std::fs::metadata(mount_point).ok().map(|m| m.dev());
    Ok(s)
}

/// Reads the kernel's INIT from a new connection: its `unique` and its arguments.
fn read_init(dev: &FuseDev) -> io::Result<(u64, proto::InitIn)> {
    // The kernel refuses reads into less than FUSE_MIN_READ_BUFFER (8 KiB).
    let mut buf = vec![0u8; 8192];
    let n = dev.read_request(&mut buf)?;
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let msg = proto::split_message(&buf[..n]).map_err(|e| bad(format!("FUSE INIT: {e}")))?;
    let init = match msg.parse() {
        Ok(Op::Init(i)) => i,
        Ok(_) => {
            return Err(bad(format!(
                "FUSE: opcode {} before INIT",
                msg.header.opcode
            )))
        }
        Err(e) => return Err(bad(format!("FUSE INIT: {e}"))),
    };
    Ok((msg.header.unique, init))
}

/// Answers INIT, with FUSE_OVER_IO_URING when `rings` are ready.
fn answer_init(
    dev: &FuseDev,
    adapter: &FuseAdapter,
    unique: u64,
    init: &proto::InitIn,
    rings: bool,
) -> io::Result<Negotiated> {
    let mut reply = Reply::default();
    if init.major != proto::KERNEL_VERSION || init.minor < 31 {
        reply.err(libc::EPROTO);
        send(dev, unique, &reply)?;
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "FUSE protocol {}.{} of this kernel is not supported (need 7.31 or newer)",
                init.major, init.minor
            ),
        ));
    }
    let negotiated = adapter.init(init, rings);
    reply.init(&negotiated.out);
    send(dev, unique, &reply)?;
    Ok(negotiated)
}

fn send(dev: &FuseDev, unique: u64, r: &Reply) -> io::Result<()> {
    let header = proto::out_header(unique, r.error, r.body.len());
    let body: &[u8] = if r.error == 0 { &r.body } else { &[] };
    dev.write_reply(&[IoSlice::new(&header), IoSlice::new(body)])
}

/// How long the worker beside the rings waits after a FORGET before it reads again: the
/// kernel queues the FORGETs of that time (an `rm -r` sends one per file) and hands them
/// over as one BATCH_FORGET, instead of waking the worker, usually on the other CPU, for
/// each (1000 `rm`s: 75-95 -> 51-64 ms here). Only the purge of unlinked files waits.
const FORGET_BATCH: std::time::Duration = std::time::Duration::from_millis(20);

/// The classic loop: read a request, run it, write the reply; until the unmount (ENODEV).
/// With rings, one of these still serves what the kernel sends outside them (FORGET,
/// INTERRUPT), so it sees the end of the connection in either transport; `forget_pause`
/// then lets FORGETs gather (see [`FORGET_BATCH`]).
fn classic_worker(
    dev: &FuseDev,
    adapter: &FuseAdapter,
    ended: &Ended,
    forget_pause: Option<std::time::Duration>,
) {
    let mut buf = vec![0u8; READ_BUF_LEN];
    let mut reply = Reply::default();
    loop {
        let n = match dev.read_request(&mut buf) {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return ended.set(),
            Err(e) => {
                tracing::error!(error = %e, "reading from /dev/fuse failed; worker stops");
                return;
            }
        };
        let msg = match proto::split_message(&buf[..n]) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(error = %e, "malformed FUSE request");
                continue;
            }
        };
        let h = msg.header;
        handle(adapter, &msg, &mut reply);
        if !proto::wants_reply(h.opcode) {
            if let Some(p) = forget_pause.filter(|_| proto::is_forget(h.opcode)) {
                std::thread::sleep(p);
            }
            continue;
        }
        match send(dev, h.unique, &reply) {
            Ok(()) => {}
            // The request was interrupted and is gone.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return ended.set(),
            Err(e) => tracing::warn!(error = %e, "writing a FUSE reply failed"),
        }
    }
}

/// Decodes and runs one request, leaving the answer in `reply`.
fn handle(adapter: &FuseAdapter, msg: &proto::Message<'_>, reply: &mut Reply) {
    match msg.parse() {
        Ok(Op::Destroy) => reply.clear(),
        Ok(op) => adapter.dispatch(&msg.header, op, reply),
        Err(e) => {
            tracing::error!(error = %e, "malformed FUSE request");
            reply.err(libc::EIO);
        }
    }
}

/// The ring threads of a connection between building their rings and serving them.
struct Rings {
    threads: Vec<JoinHandle<()>>,
    /// Each thread waits here for the word to register (`true`) or to give up.
    go: Vec<mpsc::Sender<bool>>,
    /// Each thread's registration result.
    registered: mpsc::Receiver<io::Result<()>>,
    class: Arc<RingClass>,
}

impl Rings {
    /// Starts `per_queue` threads for every CPU queue, each pinned to its CPU, and waits
    /// until each has built its ring (or failed).
    fn build(
        dev: &Arc<FuseDev>,
        s: &Session,
        per_queue: usize,
        sched: RingSched,
    ) -> io::Result<Rings> {
        let queues = fusedev::possible_cpus()?;
        let queues = u16::try_from(queues).map_err(|_| io::Error::other("too many CPUs"))?;
        // The kernel refuses entries smaller than the largest request it may send.
        // KEEL_TEST_RING_PAYLOAD (tests only) makes them too small, to exercise that refusal.
        let payload = std::env::var("KEEL_TEST_RING_PAYLOAD")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or((MAX_WRITE as usize).max(8192));
        let (built_tx, built) = mpsc::channel::<io::Result<()>>();
        let (reg_tx, registered) = mpsc::channel::<io::Result<()>>();
        let mut rings = Rings {
            threads: Vec::new(),
            go: Vec::new(),
            registered,
            class: RingClass::new(sched),
        };
        for qid in 0..queues {
            for k in 0..per_queue {
                let (dev, adapter, stop) = (dev.clone(), s.adapter.clone(), s.stop.clone());
                let class = rings.class.clone();
                let (built_tx, reg_tx) = (built_tx.clone(), reg_tx.clone());
                let (go_tx, go) = mpsc::channel::<bool>();
                let t = std::thread::Builder::new()
                    .name(format!("keel-ring-{qid}.{k}"))
                    .spawn(move || {
                        if let Err(e) = fusedev::pin_to_cpu(usize::from(qid)) {
                            tracing::debug!(qid, error = %e, "could not pin ring thread");
                        }
                        let q = FuseQueue::new(&dev, qid, 1, proto::URING_HEADER_LEN, payload);
                        let mut q = match q {
                            Ok(q) => q,
                            Err(e) => return drop(built_tx.send(Err(e))),
                        };
                        let _ = built_tx.send(Ok(()));
                        if go.recv() != Ok(true) {
                            return;
                        }
                        let r = q.register(&stop);
                        let ok = r.is_ok();
                        let _ = reg_tx.send(r);
                        if ok {
                            let _member = class.enlist();
                            ring_worker(q, &adapter);
                        }
                    });
                match t {
                    Ok(t) => {
                        rings.threads.push(t);
                        rings.go.push(go_tx);
                    }
                    Err(e) => {
                        rings.go.clear();
                        return Err(e);
                    }
                }
            }
        }
        drop(built_tx);
        let mut first_err = None;
        for r in built.iter().take(rings.threads.len()) {
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            None => Ok(rings),
            Some(e) => {
                // Dropping `go` tells every thread to give up.
                rings.go.clear();
                Err(e)
            }
        }
    }

    /// Not used after all: the threads exit without registering.
    fn cancel(self) {
        drop(self.go);
        for t in self.threads {
            let _ = t.join();
        }
    }

    /// Registers every ring with the connection; the threads then serve (and join `s`),
    /// with the governor of their scheduling class.
    fn register(self, s: &mut Session) -> io::Result<()> {
        for g in &self.go {
            let _ = g.send(true);
        }
        let n = self.threads.len();
        s.workers.extend(self.threads);
        let mut first_err = None;
        for r in self.registered.iter().take(n) {
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        if let Some(e) = first_err {
            let _ = s.stop.signal();
            return Err(e);
        }
        match self.class.govern(s.stop.clone()) {
            Ok(g) => s.workers.extend(g),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the ring scheduling governor; ring threads stay in the normal class");
                self.class.set(false);
            }
        }
        s.ring_class = Some(self.class);
        Ok(())
    }
}

/// One ring thread: wait for requests in its entries, answer each, re-arm; until the
/// connection ends every entry or the stop eventfd fires.
fn ring_worker(mut q: FuseQueue, adapter: &FuseAdapter) {
    let mut events = Vec::new();
    let mut reply = Reply::default();
    loop {
        if let Err(e) = q.wait(&mut events) {
            tracing::error!(error = %e, "io_uring wait failed; ring thread stops");
            return;
        }
        for &ev in &events {
            match ev {
                Event::Stop => return,
                Event::Ended(_, errno) => {
                    if errno != libc::ENOTCONN && errno != libc::ECONNABORTED {
                        tracing::warn!(errno, "FUSE ring entry ended");
                    }
                    if q.live() == 0 {
                        return;
                    }
                }
                Event::Request(i) => {
                    let (header, payload) = q.buffers(i);
                    let (unique, commit_id) = match proto::split_uring(header, payload) {
                        Ok(msg) => {
                            handle(adapter, &msg, &mut reply);
                            (msg.header.unique, msg.commit_id)
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "malformed FUSE ring request");
                            continue;
                        }
                    };
                    let body = if reply.error == 0 {
                        &reply.body[..]
                    } else {
                        &[]
                    };
                    let (error, len) = if body.len() <= payload.len() {
                        payload[..body.len()].copy_from_slice(body);
                        (reply.error, body.len())
                    } else {
                        tracing::error!(len = body.len(), "FUSE reply larger than the ring buffer");
                        (-libc::EIO, 0)
                    };
                    proto::fill_uring_reply(header, unique, error, len);
                    if let Err(e) = q.commit(i, commit_id) {
                        tracing::error!(error = %e, "io_uring commit failed; ring thread stops");
                        return;
                    }
                }
            }
        }
    }
}

impl Session {
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// The ring threads' scheduling class (None over `/dev/fuse`).
    pub fn ring_class(&self) -> Option<Arc<RingClass>> {
        self.ring_class.clone()
    }

    /// Set when the kernel ends the connection.
    pub fn ended(&self) -> Arc<Ended> {
        self.ended.clone()
    }

    /// Unmounts and waits for the workers. Fails (EBUSY) while the mount is in use; the
    /// workers then keep serving. Syncing the store is the caller's (`Mounted::unmount`).
    /// A mount already unmounted from outside only has its workers joined.
    pub fn unmount(mut self) -> io::Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> io::Result<()> {
        if !self.unmounted_from_outside() {
            fusedev::unmount(&self.mount_point)?;
        }
        self.unmounted = true;
        // The connection is gone; wake any ring thread the kernel has not ended yet.
        let _ = self.stop.signal();
        for t in self.workers.drain(..) {
            let _ = t.join();
        }
        Ok(())
    }
}

impl Session {
    /// The kernel ended the connection and the mount point no longer shows this mount (an
    /// aborted connection still mounted fails the stat with ENOTCONN and is unmounted as
    /// usual; whatever was mounted there since is left alone).
    fn unmounted_from_outside(&self) -> bool {
        self.ended.is_set()
            && std::fs::metadata(&self.mount_point)
                .is_ok_and(|m| self.dev.is_some_and(|d| d != m.dev()))
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if !self.unmounted {
            let _ = self.unmount_inner();
        }
    }
}
