//! Serving a FUSE connection: mounts it, answers INIT, and runs the workers that carry
//! requests between the kernel and [`FuseAdapter`]: over FUSE over io_uring when the kernel
//! offers it (one queue per CPU, each served by threads pinned to that CPU, so a request is
//! answered where it was made, without waking the other vCPU), and always over the classic
//! `/dev/fuse` read/write loop, which carries FORGET and INTERRUPT and everything before the
//! rings are ready (and everything, when io_uring is off).

use std::io::{self, IoSlice};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use super::fuse::{FuseAdapter, Negotiated, MAX_WRITE};
use super::proto::{self, Op, Reply};
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
}

/// A mounted, served FUSE connection.
pub struct Session {
    mount_point: PathBuf,
    adapter: Arc<FuseAdapter>,
    workers: Vec<JoinHandle<()>>,
    stop: Arc<EventFd>,
    transport: Transport,
    unmounted: bool,
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
pub fn start(
    dev: Arc<FuseDev>,
    adapter: FuseAdapter,
    mount_point: &Path,
    opts: ServeOptions,
) -> io::Result<Session> {
    fusedev::mount_fuse(&dev, mount_point, "keel")?;
    let adapter = Arc::new(adapter);
    let unmount_on_err = |e: io::Error| {
        let _ = fusedev::unmount(mount_point);
        e
    };
    let negotiated = handshake(&dev, &adapter).map_err(unmount_on_err)?;
    let stop = Arc::new(EventFd::new().map_err(unmount_on_err)?);
    let mut s = Session {
        mount_point: mount_point.to_path_buf(),
        adapter,
        workers: Vec::new(),
        stop,
        transport: Transport::Classic,
        unmounted: false,
    };
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
        let t = std::thread::Builder::new()
            .name(format!("keel-fuse-{n}"))
            .spawn(move || classic_worker(&d, &a))
            .map_err(unmount_on_err)?;
        s.workers.push(t);
    }
    if negotiated.io_uring {
        match start_rings(&dev, &s, &negotiated, opts.ring_threads.max(1)) {
            Ok(rings) => {
                s.workers.extend(rings);
                s.transport = Transport::IoUring;
            }
            Err(e) => {
                tracing::warn!(error = %e, "FUSE over io_uring did not start; serving over /dev/fuse");
                // The kernel waits for every queue before it uses the rings, so one failed
                // queue leaves all requests on /dev/fuse: serve them with more threads.
                for n in 1..opts.threads.max(1) {
                    let Ok(d) = dev.clone_dev() else { break };
                    let (d, a) = (Arc::new(d), s.adapter.clone());
                    if let Ok(t) = std::thread::Builder::new()
                        .name(format!("keel-fuse-{n}"))
                        .spawn(move || classic_worker(&d, &a))
                    {
                        s.workers.push(t);
                    }
                }
            }
        }
    }
    Ok(s)
}

/// Reads the kernel's INIT from the new connection and answers it.
fn handshake(dev: &FuseDev, adapter: &FuseAdapter) -> io::Result<Negotiated> {
    let mut buf = vec![0u8; READ_BUF_LEN];
    let n = dev.read_request(&mut buf)?;
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let msg = proto::split_message(&buf[..n]).map_err(|e| bad(format!("FUSE INIT: {e}")))?;
    let h = msg.header;
    let init = match msg.parse() {
        Ok(Op::Init(i)) => i,
        Ok(_) => return Err(bad(format!("FUSE: opcode {} before INIT", h.opcode))),
        Err(e) => return Err(bad(format!("FUSE INIT: {e}"))),
    };
    let mut reply = Reply::default();
    if init.major != proto::KERNEL_VERSION || init.minor < 31 {
        reply.err(libc::EPROTO);
        send(dev, h.unique, &reply)?;
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "FUSE protocol {}.{} of this kernel is not supported (need 7.31 or newer)",
                init.major, init.minor
            ),
        ));
    }
    let negotiated = adapter.init(&init);
    reply.init(&negotiated.out);
    send(dev, h.unique, &reply)?;
    Ok(negotiated)
}

fn send(dev: &FuseDev, unique: u64, r: &Reply) -> io::Result<()> {
    let header = proto::out_header(unique, r.error, r.body.len());
    let body: &[u8] = if r.error == 0 { &r.body } else { &[] };
    dev.write_reply(&[IoSlice::new(&header), IoSlice::new(body)])
}

/// The classic loop: read a request, run it, write the reply; until the unmount (ENODEV).
fn classic_worker(dev: &FuseDev, adapter: &FuseAdapter) {
    let mut buf = vec![0u8; READ_BUF_LEN];
    let mut reply = Reply::default();
    loop {
        let n = match dev.read_request(&mut buf) {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return,
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
            continue;
        }
        match send(dev, h.unique, &reply) {
            Ok(()) => {}
            // The request was interrupted and is gone.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return,
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

/// Starts `per_queue` ring threads for every CPU queue and waits until each has registered
/// its entries (or failed).
fn start_rings(
    dev: &Arc<FuseDev>,
    s: &Session,
    n: &Negotiated,
    per_queue: usize,
) -> io::Result<Vec<JoinHandle<()>>> {
    let queues = fusedev::possible_cpus()?;
    let qid_max = u16::try_from(queues).map_err(|_| io::Error::other("too many CPUs"))?;
    // The kernel refuses entries smaller than the largest request it may send.
    let payload = (n.out.max_write as usize)
        .max(usize::from(n.out.max_pages) * 4096)
        .max(8192);
    let (tx, rx) = mpsc::channel::<io::Result<()>>();
    let mut threads = Vec::new();
    for qid in 0..qid_max {
        for k in 0..per_queue {
            let (dev, adapter, stop, tx) =
                (dev.clone(), s.adapter.clone(), s.stop.clone(), tx.clone());
            let t = std::thread::Builder::new()
                .name(format!("keel-ring-{qid}.{k}"))
                .spawn(move || {
                    if let Err(e) = fusedev::pin_to_cpu(usize::from(qid)) {
                        tracing::debug!(qid, error = %e, "could not pin ring thread");
                    }
                    let q = FuseQueue::new(&dev, qid, 1, proto::URING_HEADER_LEN, payload, &stop);
                    match q {
                        Ok(q) => {
                            let _ = tx.send(Ok(()));
                            ring_worker(q, &adapter);
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                })?;
            threads.push(t);
        }
    }
    drop(tx);
    let mut first_err = None;
    for r in rx.iter().take(threads.len()) {
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    }
    match first_err {
        None => Ok(threads),
        Some(e) => {
            // The others stay registered but idle; release them.
            let _ = s.stop.signal();
            Err(e)
        }
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

    /// Unmounts and waits for the workers. Fails (EBUSY) while the mount is in use; the
    /// workers then keep serving.
    pub fn unmount(mut self) -> io::Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> io::Result<()> {
        fusedev::unmount(&self.mount_point)?;
        self.unmounted = true;
        // The connection is gone; wake any ring thread the kernel has not ended yet.
        let _ = self.stop.signal();
        for t in self.workers.drain(..) {
            let _ = t.join();
        }
        self.adapter.destroy();
        Ok(())
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if !self.unmounted {
            let _ = self.unmount_inner();
        }
    }
}
