//! One queue of FUSE over io_uring: an io_uring instance (128-byte SQEs) whose entries are
//! registered with the FUSE connection (`FUSE_IO_URING_CMD_REGISTER`) and then answered and
//! re-armed with `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`. The kernel writes each request into an
//! entry's header and payload buffers and reads the reply back from them, so the buffers live
//! as long as the kernel may hold the entry: if the queue is dropped while entries are still
//! registered, their buffers are leaked rather than freed under the kernel.

use std::io;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::fusedev::{EventFd, FuseDev};

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// `user_data` of the poll on the stop eventfd.
const STOP: u64 = u64::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Held by the kernel (registered or committed, waiting for a request).
    Kernel,
    /// A request is in the buffers; the caller answers it with `commit`.
    Request,
    /// The kernel ended it with an error: the connection is gone.
    Done,
}

#[derive(Debug)]
struct Entry {
    header: Box<[u8]>,
    payload: Box<[u8]>,
    /// `struct iovec[2]` pointing at `header` and `payload`, read by REGISTER.
    iov: Box<[libc::iovec; 2]>,
    commit_id: u64,
    last_cmd: u32,
    state: State,
}

/// What one completion meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Entry `n` holds a request.
    Request(usize),
    /// The stop eventfd fired.
    Stop,
    /// Entry `n` was ended by the kernel with this errno (ENOTCONN at unmount).
    Ended(usize, i32),
}

pub struct FuseQueue {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    entries: Vec<Entry>,
    qid: u16,
    completions: Vec<(u64, i32)>,
}

impl std::fmt::Debug for FuseQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseQueue")
            .field("qid", &self.qid)
            .field("entries", &self.entries.len())
            .finish()
    }
}

/// `struct fuse_uring_cmd_req` in the 80-byte command area of an SQE128.
fn cmd_req(commit_id: u64, qid: u16) -> [u8; 80] {
    let mut c = [0u8; 80];
    c[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    c[16..18].copy_from_slice(&qid.to_ne_bytes());
    c
}

/// Sets `sqe->len`, which the io-uring crate's `UringCmd80` leaves at zero; FUSE's REGISTER
/// reads the iovec count from it.
fn with_len(e: squeue::Entry128, len: u32) -> squeue::Entry128 {
    // SAFETY: `Entry128` is `#[repr(C)]` around the kernel's 128-byte `io_uring_sqe` (64
    // bytes) and 64 bytes of command data, so it has the size and layout of `[u8; 128]`;
    // every bit pattern is a valid value of both. `len` is the u32 at offset 24.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(e) };
    raw[24..28].copy_from_slice(&len.to_ne_bytes());
    // SAFETY: as above, the bytes came from a valid `Entry128`.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

impl FuseQueue {
    /// Creates the ring for queue `qid` with `depth` entries of `header_len` + `payload_len`
    /// bytes. Nothing is registered with the connection yet (see [`FuseQueue::register`]):
    /// this step fails where io_uring is not allowed (container seccomp profiles block
    /// `io_uring_setup`), before the kernel is told that keel will serve rings.
    pub fn new(
        dev: &FuseDev,
        qid: u16,
        depth: usize,
        header_len: usize,
        payload_len: usize,
    ) -> io::Result<FuseQueue> {
        let n = depth as u32 + 1;
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .setup_cqsize(n * 2)
            .build(n)?;
        ring.submitter().register_files(&[dev.raw_fd()])?;
        let mut q = FuseQueue {
            ring,
            entries: Vec::with_capacity(depth),
            qid,
            completions: Vec::with_capacity(depth + 1),
        };
        for _ in 0..depth {
            let mut header = vec![0u8; header_len].into_boxed_slice();
            let mut payload = vec![0u8; payload_len].into_boxed_slice();
            let iov = Box::new([
                libc::iovec {
                    iov_base: header.as_mut_ptr().cast(),
                    iov_len: header.len(),
                },
                libc::iovec {
                    iov_base: payload.as_mut_ptr().cast(),
                    iov_len: payload.len(),
                },
            ]);
            q.entries.push(Entry {
                header,
                payload,
                iov,
                commit_id: 0,
                last_cmd: CMD_REGISTER,
                state: State::Done,
            });
        }
        Ok(q)
    }

    /// Registers every entry with the connection (after its INIT was answered with
    /// FUSE_OVER_IO_URING) and arms the stop eventfd. An entry the kernel refuses at once
    /// fails this call.
    pub fn register(&mut self, stop: &EventFd) -> io::Result<()> {
        for i in 0..self.entries.len() {
            self.push_cmd(i)?;
        }
        let poll = opcode::PollAdd::new(types::Fd(stop.raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(STOP);
        self.push(poll.into())?;
        self.ring.submit()?;
        // A refused REGISTER completes during the submit. Accepted ones stay pending, or
        // complete at once with a request that was waiting for the rings: those are kept for
        // the first `wait`.
        self.completions.clear();
        self.completions
            .extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        let refused = self
            .completions
            .iter()
            .find(|&&(ud, res)| ud != STOP && res < 0 && res != -libc::EAGAIN);
        match refused {
            Some(&(_, res)) => Err(io::Error::from_raw_os_error(-res)),
            None => Ok(()),
        }
    }

    fn push(&mut self, e: squeue::Entry128) -> io::Result<()> {
        // SAFETY: every SQE pushed here points only at memory owned by `self.entries` (the
        // iovec array and, through it, the header and payload buffers), boxed so its address
        // never moves, and kept alive for as long as the kernel may use it: `Drop` leaks the
        // buffers of entries the kernel still holds.
        unsafe { self.ring.submission().push(&e) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))
    }

    /// Queues entry `i`'s next command: REGISTER the first time, then COMMIT_AND_FETCH.
    fn push_cmd(&mut self, i: usize) -> io::Result<()> {
        let e = &self.entries[i];
        let commit_id = if e.last_cmd == CMD_REGISTER {
            0
        } else {
            e.commit_id
        };
        let cmd = cmd_req(commit_id, self.qid);
        let mut b = opcode::UringCmd80::new(types::Fixed(0), e.last_cmd).cmd(cmd);
        if e.last_cmd == CMD_REGISTER {
            b = b.addr(Some(e.iov.as_ptr() as u64));
        }
        let sqe = b.build().user_data(i as u64);
        let sqe = if e.last_cmd == CMD_REGISTER {
            with_len(sqe, 2)
        } else {
            sqe
        };
        self.entries[i].state = State::Kernel;
        self.push(sqe)
    }

    /// Submits what is queued and blocks until at least one completion; returns what the
    /// completions meant. A completion of EAGAIN/EINTR re-queues its command.
    pub fn wait(&mut self, events: &mut Vec<Event>) -> io::Result<()> {
        events.clear();
        // Completions `register` collected come first.
        if self.completions.is_empty() {
            loop {
                match self.ring.submit_and_wait(1) {
                    Ok(_) => break,
                    Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                    Err(e) => return Err(e),
                }
            }
            self.completions
                .extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        }
        for k in 0..self.completions.len() {
            let (ud, res) = self.completions[k];
            if ud == STOP {
                events.push(Event::Stop);
                continue;
            }
            let i = ud as usize;
            if res == -libc::EAGAIN || res == -libc::EINTR {
                self.push_cmd(i)?;
            } else if res < 0 {
                self.entries[i].state = State::Done;
                events.push(Event::Ended(i, -res));
            } else {
                self.entries[i].state = State::Request;
                events.push(Event::Request(i));
            }
        }
        self.completions.clear();
        Ok(())
    }

    /// The header and payload buffers of entry `i` (only while it holds a request).
    pub fn buffers(&mut self, i: usize) -> (&mut [u8], &mut [u8]) {
        let e = &mut self.entries[i];
        debug_assert_eq!(e.state, State::Request);
        (&mut e.header, &mut e.payload)
    }

    /// Queues the answer in entry `i`'s buffers (to the request the kernel labelled
    /// `commit_id`) and re-arms the entry for the next request.
    pub fn commit(&mut self, i: usize, commit_id: u64) -> io::Result<()> {
        let e = &mut self.entries[i];
        e.last_cmd = CMD_COMMIT_AND_FETCH;
        e.commit_id = commit_id;
        self.push_cmd(i)
    }

    /// Entries the kernel has not ended yet.
    pub fn live(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| e.state != State::Done)
            .count()
    }
}

impl Drop for FuseQueue {
    fn drop(&mut self) {
        if self.live() > 0 {
            // The kernel may still write into these buffers (until the io_uring instance's
            // teardown cancels the commands); never free them under it.
            std::mem::forget(std::mem::take(&mut self.entries));
        }
    }
}
