//! The FUSE wire protocol, as plain bytes: decoding the kernel's requests into [`Op`]s and
//! encoding replies. Pure code (no syscalls, no file descriptors), so both transports — the
//! classic `/dev/fuse` read/write loop and FUSE over io_uring — share it, and it is tested
//! without a kernel. Layouts follow `include/uapi/linux/fuse.h` (ABI 7.x, native endian).

use std::time::Duration;

/// The protocol version keel speaks (7.40 brought passthrough; 7.42 io_uring).
pub const KERNEL_VERSION: u32 = 7;
pub const KERNEL_MINOR_VERSION: u32 = 42;

/// `sizeof(struct fuse_in_header)`.
pub const IN_HEADER_LEN: usize = 40;
/// `sizeof(struct fuse_out_header)`.
pub const OUT_HEADER_LEN: usize = 16;
/// `sizeof(struct fuse_uring_req_header)`: in/out header area, op argument area, entry trailer.
pub const URING_HEADER_LEN: usize = URING_OP_IN_OFFSET + URING_OP_IN_LEN + 32;
/// Where the op argument area starts in a ring entry's header buffer.
pub const URING_OP_IN_OFFSET: usize = 128;
pub const URING_OP_IN_LEN: usize = 128;
/// Where `struct fuse_uring_ent_in_out` starts in a ring entry's header buffer.
pub const URING_ENT_OFFSET: usize = URING_OP_IN_OFFSET + URING_OP_IN_LEN;

/// Opcodes (`enum fuse_opcode`) keel decodes.
pub mod opcode {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const SETXATTR: u32 = 21;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const REMOVEXATTR: u32 = 24;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const IOCTL: u32 = 39;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const READDIRPLUS: u32 = 44;
    pub const RENAME2: u32 = 45;
    pub const LSEEK: u32 = 46;
    pub const COPY_FILE_RANGE: u32 = 47;
}

/// `FUSE_INIT` flags (the high 32 travel in `flags2` with `FUSE_INIT_EXT`).
pub mod init_flags {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const ATOMIC_O_TRUNC: u64 = 1 << 3;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const DO_READDIRPLUS: u64 = 1 << 13;
    pub const READDIRPLUS_AUTO: u64 = 1 << 14;
    pub const ASYNC_DIO: u64 = 1 << 15;
    pub const WRITEBACK_CACHE: u64 = 1 << 16;
    pub const PARALLEL_DIROPS: u64 = 1 << 18;
    pub const AUTO_INVAL_DATA: u64 = 1 << 12;
    pub const MAX_PAGES: u64 = 1 << 22;
    pub const CACHE_SYMLINKS: u64 = 1 << 23;
    pub const INIT_EXT: u64 = 1 << 30;
    pub const HANDLE_KILLPRIV_V2: u64 = 1 << 28;
    pub const DIRECT_IO_ALLOW_MMAP: u64 = 1 << 36;
    pub const PASSTHROUGH: u64 = 1 << 37;
    pub const OVER_IO_URING: u64 = 1 << 41;
}

/// `FOPEN_*` flags of an open reply.
pub mod fopen {
    pub const DIRECT_IO: u32 = 1 << 0;
    pub const KEEP_CACHE: u32 = 1 << 1;
    pub const NOFLUSH: u32 = 1 << 5;
    pub const PARALLEL_DIRECT_WRITES: u32 = 1 << 6;
    pub const PASSTHROUGH: u32 = 1 << 7;
}

/// `FATTR_*` bits of `fuse_setattr_in.valid`.
mod fattr {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
    pub const ATIME: u32 = 1 << 4;
    pub const MTIME: u32 = 1 << 5;
    pub const ATIME_NOW: u32 = 1 << 7;
    pub const MTIME_NOW: u32 = 1 << 8;
    pub const CTIME: u32 = 1 << 10;
    pub const KILL_SUIDGID: u32 = 1 << 11;
}

const FUSE_OPEN_KILL_SUIDGID: u32 = 1 << 0;
const FUSE_WRITE_KILL_SUIDGID: u32 = 1 << 2;
const FUSE_FSYNC_FDATASYNC: u32 = 1 << 0;

/// A request the protocol layer could not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("request of {got} bytes is shorter than its header")]
    ShortHeader { got: usize },
    #[error("request length {len} does not match the {got} bytes received")]
    BadLength { len: u32, got: usize },
    #[error("opcode {opcode}: argument of {got} bytes, need {need}")]
    ShortArg {
        opcode: u32,
        got: usize,
        need: usize,
    },
    #[error("opcode {opcode}: name or value not terminated")]
    BadName { opcode: u32 },
}

/// `struct fuse_in_header`, minus what keel never reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_ne_bytes([b[off], b[off + 1]])
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_ne_bytes(a)
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_ne_bytes(a)
}

impl InHeader {
    pub fn parse(b: &[u8]) -> Result<InHeader, ProtoError> {
        if b.len() < IN_HEADER_LEN {
            return Err(ProtoError::ShortHeader { got: b.len() });
        }
        Ok(InHeader {
            len: u32_at(b, 0),
            opcode: u32_at(b, 4),
            unique: u64_at(b, 8),
            nodeid: u64_at(b, 16),
            uid: u32_at(b, 24),
            gid: u32_at(b, 28),
            pid: u32_at(b, 32),
        })
    }

    /// Extension bytes after the arguments (`total_extlen` is in units of 8 bytes).
    fn ext_len(b: &[u8]) -> usize {
        usize::from(u16_at(b, 36)) * 8
    }
}

/// The size of each opcode's fixed argument struct (the part FUSE over io_uring puts in the
/// op area; the rest — names, data — is the payload). `None`: variable (INIT) or unknown.
pub fn arg_len(opcode: u32) -> Option<usize> {
    use opcode::*;
    Some(match opcode {
        LOOKUP | READLINK | SYMLINK | UNLINK | RMDIR | REMOVEXATTR | STATFS | DESTROY => 0,
        FORGET | RENAME | LINK | MKDIR | OPEN | OPENDIR | SETXATTR | GETXATTR | LISTXATTR
        | ACCESS | INTERRUPT | BATCH_FORGET => 8,
        GETATTR | MKNOD | CREATE | FSYNC | FSYNCDIR | RENAME2 => 16,
        RELEASE | RELEASEDIR | FLUSH | LSEEK => 24,
        FALLOCATE | IOCTL => 32,
        READ | WRITE | READDIR | READDIRPLUS => 40,
        COPY_FILE_RANGE => 56,
        SETATTR => 88,
        _ => return None,
    })
}

/// `struct fuse_init_in`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitIn {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    /// `flags | flags2 << 32` (flags2 only counts with `FUSE_INIT_EXT`).
    pub flags: u64,
}

/// `struct fuse_setattr_in`, as the fields to change.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SetattrIn {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeIn>,
    pub mtime: Option<TimeIn>,
    pub ctime: Option<(i64, u32)>,
    /// FATTR_KILL_SUIDGID: the kernel asks the server to drop setuid/setgid.
    pub kill_suidgid: bool,
}

/// A time to set: the caller's clock now, or seconds and nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeIn {
    Now,
    At(i64, u32),
}

/// One decoded request; names and data borrow the request buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Op<'a> {
    Init(InitIn),
    Destroy,
    Lookup {
        name: &'a [u8],
    },
    Forget {
        nlookup: u64,
    },
    /// `(nodeid, nlookup)` pairs.
    BatchForget(Vec<(u64, u64)>),
    Getattr,
    Setattr(SetattrIn),
    Readlink,
    Symlink {
        name: &'a [u8],
        target: &'a [u8],
    },
    Mknod {
        mode: u32,
        rdev: u32,
        name: &'a [u8],
    },
    Mkdir {
        mode: u32,
        name: &'a [u8],
    },
    Unlink {
        name: &'a [u8],
    },
    Rmdir {
        name: &'a [u8],
    },
    Rename {
        newdir: u64,
        flags: u32,
        name: &'a [u8],
        newname: &'a [u8],
    },
    Link {
        oldnodeid: u64,
        name: &'a [u8],
    },
    Open {
        flags: i32,
        kill_suidgid: bool,
    },
    Read {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Write {
        fh: u64,
        offset: u64,
        kill_suidgid: bool,
        data: &'a [u8],
    },
    Statfs,
    Release {
        fh: u64,
    },
    Fsync {
        fh: u64,
        datasync: bool,
    },
    Setxattr {
        flags: i32,
        name: &'a [u8],
        value: &'a [u8],
    },
    Getxattr {
        size: u32,
        name: &'a [u8],
    },
    Listxattr {
        size: u32,
    },
    Removexattr {
        name: &'a [u8],
    },
    Flush {
        fh: u64,
    },
    Opendir,
    Readdir {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Readdirplus {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Releasedir {
        fh: u64,
    },
    Fsyncdir,
    Access {
        mask: i32,
    },
    Create {
        flags: i32,
        mode: u32,
        name: &'a [u8],
    },
    Interrupt,
    Ioctl,
    Fallocate {
        offset: u64,
        length: u64,
        mode: i32,
    },
    Lseek {
        offset: i64,
        whence: i32,
    },
    CopyFileRange {
        off_in: u64,
        nodeid_out: u64,
        off_out: u64,
        len: u64,
    },
    /// An opcode keel does not implement: answered with ENOSYS.
    Unsupported(u32),
}

/// A request split into its parts, before decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    pub header: InHeader,
    /// The opcode's fixed argument struct.
    pub arg: &'a [u8],
    /// What follows it: names, data.
    pub payload: &'a [u8],
    /// FUSE over io_uring: the id to commit the answer with (0 on `/dev/fuse`).
    pub commit_id: u64,
}

impl<'a> Message<'a> {
    pub fn parse(&self) -> Result<Op<'a>, ProtoError> {
        parse(self.header.opcode, self.arg, self.payload)
    }
}

/// Splits a message read from `/dev/fuse` into its header, the opcode's fixed argument and
/// the payload after it (names, data).
pub fn split_message(buf: &[u8]) -> Result<Message<'_>, ProtoError> {
    let h = InHeader::parse(buf)?;
    let len = h.len as usize;
    if len != buf.len() || len < IN_HEADER_LEN {
        return Err(ProtoError::BadLength {
            len: h.len,
            got: buf.len(),
        });
    }
    let ext = InHeader::ext_len(buf).min(len - IN_HEADER_LEN);
    let body = &buf[IN_HEADER_LEN..len - ext];
    let n = if h.opcode == opcode::INIT {
        body.len()
    } else {
        arg_len(h.opcode).unwrap_or(0).min(body.len())
    };
    Ok(Message {
        header: h,
        arg: &body[..n],
        payload: &body[n..],
        commit_id: 0,
    })
}

/// The bytes up to the first NUL, and what follows it.
fn cstr(op: u32, b: &[u8]) -> Result<(&[u8], &[u8]), ProtoError> {
    let end = b
        .iter()
        .position(|&c| c == 0)
        .ok_or(ProtoError::BadName { opcode: op })?;
    Ok((&b[..end], &b[end + 1..]))
}

fn time_in(set: bool, now: bool, secs: u64, nsec: u32) -> Option<TimeIn> {
    match (set, now) {
        (false, _) => None,
        (true, true) => Some(TimeIn::Now),
        (true, false) => Some(TimeIn::At(secs as i64, nsec)),
    }
}

/// Decodes one request from its opcode, fixed argument and payload.
pub fn parse<'a>(opcode: u32, arg: &'a [u8], payload: &'a [u8]) -> Result<Op<'a>, ProtoError> {
    use opcode::*;
    if let Some(need) = arg_len(opcode) {
        if arg.len() < need {
            return Err(ProtoError::ShortArg {
                opcode,
                got: arg.len(),
                need,
            });
        }
    }
    let name = || cstr(opcode, payload).map(|(n, _)| n);
    let a = arg;
    Ok(match opcode {
        INIT => {
            if a.len() < 16 {
                return Err(ProtoError::ShortArg {
                    opcode,
                    got: a.len(),
                    need: 16,
                });
            }
            let mut flags = u64::from(u32_at(a, 12));
            if flags & init_flags::INIT_EXT != 0 && a.len() >= 20 {
                flags |= u64::from(u32_at(a, 16)) << 32;
            }
            Op::Init(InitIn {
                major: u32_at(a, 0),
                minor: u32_at(a, 4),
                max_readahead: u32_at(a, 8),
                flags,
            })
        }
        DESTROY => Op::Destroy,
        LOOKUP => Op::Lookup { name: name()? },
        FORGET => Op::Forget {
            nlookup: u64_at(a, 0),
        },
        BATCH_FORGET => {
            let count = u32_at(a, 0) as usize;
            let pairs = payload
                .chunks_exact(16)
                .take(count)
                .map(|c| (u64_at(c, 0), u64_at(c, 8)))
                .collect();
            Op::BatchForget(pairs)
        }
        GETATTR => Op::Getattr,
        SETATTR => {
            let valid = u32_at(a, 0);
            let has = |bit: u32| valid & bit != 0;
            Op::Setattr(SetattrIn {
                mode: has(fattr::MODE).then(|| u32_at(a, 68)),
                uid: has(fattr::UID).then(|| u32_at(a, 76)),
                gid: has(fattr::GID).then(|| u32_at(a, 80)),
                size: has(fattr::SIZE).then(|| u64_at(a, 16)),
                atime: time_in(
                    has(fattr::ATIME),
                    has(fattr::ATIME_NOW),
                    u64_at(a, 32),
                    u32_at(a, 56),
                ),
                mtime: time_in(
                    has(fattr::MTIME),
                    has(fattr::MTIME_NOW),
                    u64_at(a, 40),
                    u32_at(a, 60),
                ),
                ctime: has(fattr::CTIME).then(|| (u64_at(a, 48) as i64, u32_at(a, 64))),
                kill_suidgid: has(fattr::KILL_SUIDGID),
            })
        }
        READLINK => Op::Readlink,
        SYMLINK => {
            let (name, rest) = cstr(opcode, payload)?;
            let (target, _) = cstr(opcode, rest)?;
            Op::Symlink { name, target }
        }
        MKNOD => Op::Mknod {
            mode: u32_at(a, 0),
            rdev: u32_at(a, 4),
            name: name()?,
        },
        MKDIR => Op::Mkdir {
            mode: u32_at(a, 0),
            name: name()?,
        },
        UNLINK => Op::Unlink { name: name()? },
        RMDIR => Op::Rmdir { name: name()? },
        RENAME | RENAME2 => {
            let (name, rest) = cstr(opcode, payload)?;
            let (newname, _) = cstr(opcode, rest)?;
            Op::Rename {
                newdir: u64_at(a, 0),
                flags: if opcode == RENAME2 { u32_at(a, 8) } else { 0 },
                name,
                newname,
            }
        }
        LINK => Op::Link {
            oldnodeid: u64_at(a, 0),
            name: name()?,
        },
        OPEN => Op::Open {
            flags: u32_at(a, 0) as i32,
            kill_suidgid: u32_at(a, 4) & FUSE_OPEN_KILL_SUIDGID != 0,
        },
        READ => Op::Read {
            fh: u64_at(a, 0),
            offset: u64_at(a, 8),
            size: u32_at(a, 16),
        },
        WRITE => {
            let size = u32_at(a, 16) as usize;
            if payload.len() < size {
                return Err(ProtoError::ShortArg {
                    opcode,
                    got: payload.len(),
                    need: size,
                });
            }
            Op::Write {
                fh: u64_at(a, 0),
                offset: u64_at(a, 8),
                kill_suidgid: u32_at(a, 20) & FUSE_WRITE_KILL_SUIDGID != 0,
                data: &payload[..size],
            }
        }
        STATFS => Op::Statfs,
        RELEASE => Op::Release { fh: u64_at(a, 0) },
        FSYNC => Op::Fsync {
            fh: u64_at(a, 0),
            datasync: u32_at(a, 8) & FUSE_FSYNC_FDATASYNC != 0,
        },
        SETXATTR => {
            let size = u32_at(a, 0) as usize;
            let (name, rest) = cstr(opcode, payload)?;
            if rest.len() < size {
                return Err(ProtoError::ShortArg {
                    opcode,
                    got: rest.len(),
                    need: size,
                });
            }
            Op::Setxattr {
                flags: u32_at(a, 4) as i32,
                name,
                value: &rest[..size],
            }
        }
        GETXATTR => Op::Getxattr {
            size: u32_at(a, 0),
            name: name()?,
        },
        LISTXATTR => Op::Listxattr { size: u32_at(a, 0) },
        REMOVEXATTR => Op::Removexattr { name: name()? },
        FLUSH => Op::Flush { fh: u64_at(a, 0) },
        OPENDIR => Op::Opendir,
        READDIR | READDIRPLUS => {
            let (fh, offset, size) = (u64_at(a, 0), u64_at(a, 8), u32_at(a, 16));
            if opcode == READDIR {
                Op::Readdir { fh, offset, size }
            } else {
                Op::Readdirplus { fh, offset, size }
            }
        }
        RELEASEDIR => Op::Releasedir { fh: u64_at(a, 0) },
        FSYNCDIR => Op::Fsyncdir,
        ACCESS => Op::Access {
            mask: u32_at(a, 0) as i32,
        },
        CREATE => Op::Create {
            flags: u32_at(a, 0) as i32,
            mode: u32_at(a, 4),
            name: name()?,
        },
        INTERRUPT => Op::Interrupt,
        IOCTL => Op::Ioctl,
        FALLOCATE => Op::Fallocate {
            offset: u64_at(a, 8),
            length: u64_at(a, 16),
            mode: u32_at(a, 24) as i32,
        },
        LSEEK => Op::Lseek {
            offset: u64_at(a, 8) as i64,
            whence: u32_at(a, 16) as i32,
        },
        COPY_FILE_RANGE => Op::CopyFileRange {
            off_in: u64_at(a, 8),
            nodeid_out: u64_at(a, 16),
            off_out: u64_at(a, 32),
            len: u64_at(a, 40),
        },
        other => Op::Unsupported(other),
    })
}

/// Does the kernel expect a reply to this opcode?
pub fn wants_reply(opcode: u32) -> bool {
    !matches!(
        opcode,
        opcode::FORGET | opcode::BATCH_FORGET | opcode::INTERRUPT
    )
}

/// FORGET or BATCH_FORGET: the kernel dropping inode references.
pub fn is_forget(opcode: u32) -> bool {
    matches!(opcode, opcode::FORGET | opcode::BATCH_FORGET)
}

/// `struct fuse_attr`, ready to encode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttrOut {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: (i64, u32),
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    /// File type and permission bits (`st_mode`).
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
}

/// What the kernel should cache of a name or an inode, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryOut {
    /// 0 for a negative entry (the name does not exist).
    pub nodeid: u64,
    pub entry_ttl: Duration,
    pub attr_ttl: Duration,
    pub attr: AttrOut,
}

/// `struct fuse_kstatfs`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatfsOut {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

/// `struct fuse_init_out` fields keel sets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InitOut {
    pub max_readahead: u32,
    pub flags: u64,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub max_pages: u16,
    pub max_stack_depth: u32,
}

/// A reply being built: an error, or the body after the `fuse_out_header`. The transport adds
/// the header. One per worker thread, reused from request to request.
#[derive(Debug, Default)]
pub struct Reply {
    pub error: i32,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn clear(&mut self) {
        self.error = 0;
        self.body.clear();
    }

    /// Answer with `-errno` and no body.
    pub fn err(&mut self, errno: i32) {
        self.body.clear();
        self.error = -errno.abs();
    }

    fn u32(&mut self, v: u32) {
        self.body.extend_from_slice(&v.to_ne_bytes());
    }

    fn u64(&mut self, v: u64) {
        self.body.extend_from_slice(&v.to_ne_bytes());
    }

    fn ttl(&mut self, d: Duration) -> u32 {
        self.u64(d.as_secs());
        d.subsec_nanos()
    }

    /// `struct fuse_attr` (88 bytes).
    fn attr_body(&mut self, a: &AttrOut) {
        for v in [a.ino, a.size, a.blocks] {
            self.u64(v);
        }
        for t in [a.atime, a.mtime, a.ctime] {
            self.u64(t.0 as u64);
        }
        for v in [
            a.atime.1, a.mtime.1, a.ctime.1, a.mode, a.nlink, a.uid, a.gid, a.rdev, a.blksize, 0,
        ] {
            self.u32(v);
        }
    }

    /// `struct fuse_entry_out` (128 bytes).
    fn entry_body(&mut self, e: &EntryOut) {
        self.u64(e.nodeid);
        self.u64(0); // generation
        let en = self.ttl(e.entry_ttl);
        let an = self.ttl(e.attr_ttl);
        self.u32(en);
        self.u32(an);
        self.attr_body(&e.attr);
    }

    /// `struct fuse_open_out` (16 bytes).
    fn open_body(&mut self, fh: u64, flags: u32, backing_id: i32) {
        self.u64(fh);
        self.u32(flags);
        self.u32(backing_id as u32);
    }

    pub fn entry(&mut self, e: &EntryOut) {
        self.clear();
        self.entry_body(e);
    }

    /// `struct fuse_attr_out`.
    pub fn attr(&mut self, ttl: Duration, a: &AttrOut) {
        self.clear();
        let n = self.ttl(ttl);
        self.u32(n);
        self.u32(0);
        self.attr_body(a);
    }

    pub fn open(&mut self, fh: u64, flags: u32, backing_id: i32) {
        self.clear();
        self.open_body(fh, flags, backing_id);
    }

    /// CREATE: `fuse_entry_out` then `fuse_open_out`.
    pub fn create(&mut self, e: &EntryOut, fh: u64, flags: u32, backing_id: i32) {
        self.clear();
        self.entry_body(e);
        self.open_body(fh, flags, backing_id);
    }

    /// `struct fuse_write_out` (WRITE, COPY_FILE_RANGE).
    pub fn written(&mut self, n: u32) {
        self.clear();
        self.u32(n);
        self.u32(0);
    }

    /// `struct fuse_getxattr_out`: the size a GETXATTR/LISTXATTR with size 0 asks for.
    pub fn xattr_size(&mut self, n: u32) {
        self.written(n);
    }

    /// `struct fuse_lseek_out`.
    pub fn offset(&mut self, off: u64) {
        self.clear();
        self.u64(off);
    }

    pub fn statfs(&mut self, s: &StatfsOut) {
        self.clear();
        for v in [s.blocks, s.bfree, s.bavail, s.files, s.ffree] {
            self.u64(v);
        }
        for v in [s.bsize, s.namelen, s.frsize, 0, 0, 0, 0, 0, 0, 0] {
            self.u32(v);
        }
    }

    /// `struct fuse_init_out` (64 bytes).
    pub fn init(&mut self, o: &InitOut) {
        self.clear();
        self.u32(KERNEL_VERSION);
        self.u32(KERNEL_MINOR_VERSION);
        self.u32(o.max_readahead);
        self.u32(o.flags as u32);
        self.body.extend_from_slice(&o.max_background.to_ne_bytes());
        self.body
            .extend_from_slice(&o.congestion_threshold.to_ne_bytes());
        self.u32(o.max_write);
        self.u32(1); // time_gran: nanoseconds
        self.body.extend_from_slice(&o.max_pages.to_ne_bytes());
        self.body.extend_from_slice(&0u16.to_ne_bytes());
        self.u32((o.flags >> 32) as u32);
        self.u32(o.max_stack_depth);
        for _ in 0..6 {
            self.u32(0);
        }
    }

    /// Raw data (READ, READLINK, xattr values, directory listings).
    pub fn data(&mut self, d: &[u8]) {
        self.clear();
        self.body.extend_from_slice(d);
    }

    /// Starts a READDIR/READDIRPLUS reply of at most `max` bytes.
    pub fn dir(&mut self, max: u32) -> DirReply<'_> {
        self.clear();
        DirReply {
            reply: self,
            max: max as usize,
        }
    }
}

/// A directory listing being filled; `add` returns true when the entry did not fit.
#[derive(Debug)]
pub struct DirReply<'r> {
    reply: &'r mut Reply,
    max: usize,
}

/// `struct fuse_dirent` is 24 bytes before the name; entries are padded to 8 bytes.
const DIRENT_LEN: usize = 24;

fn dirent_size(name_len: usize) -> usize {
    (DIRENT_LEN + name_len + 7) & !7
}

impl DirReply<'_> {
    fn dirent(&mut self, ino: u64, next: u64, mode: u32, name: &[u8]) {
        let r = &mut *self.reply;
        let start = r.body.len();
        r.u64(ino);
        r.u64(next);
        r.u32(name.len() as u32);
        r.u32((mode & libc::S_IFMT) >> 12);
        r.body.extend_from_slice(name);
        r.body.resize(start + dirent_size(name.len()), 0);
    }

    /// One READDIR entry: inode, the offset of the next entry, `st_mode` type bits, name.
    pub fn add(&mut self, ino: u64, next: u64, mode: u32, name: &[u8]) -> bool {
        if self.reply.body.len() + dirent_size(name.len()) > self.max {
            return true;
        }
        self.dirent(ino, next, mode, name);
        false
    }

    /// One READDIRPLUS entry: `fuse_entry_out` then the dirent.
    pub fn add_plus(&mut self, e: &EntryOut, next: u64, name: &[u8]) -> bool {
        if self.reply.body.len() + 128 + dirent_size(name.len()) > self.max {
            return true;
        }
        self.reply.entry_body(e);
        self.dirent(e.attr.ino, next, e.attr.mode, name);
        false
    }
}

/// `struct fuse_out_header` for a reply of `body_len` bytes.
pub fn out_header(unique: u64, error: i32, body_len: usize) -> [u8; OUT_HEADER_LEN] {
    let mut h = [0u8; OUT_HEADER_LEN];
    h[0..4].copy_from_slice(&((OUT_HEADER_LEN + body_len) as u32).to_ne_bytes());
    h[4..8].copy_from_slice(&error.to_ne_bytes());
    h[8..16].copy_from_slice(&unique.to_ne_bytes());
    h
}

/// A request as FUSE over io_uring delivered it into a ring entry: the header buffer (in
/// header, op argument area, entry trailer) and the payload buffer.
pub fn split_uring<'a>(header: &'a [u8], payload: &'a [u8]) -> Result<Message<'a>, ProtoError> {
    if header.len() < URING_HEADER_LEN {
        return Err(ProtoError::ShortHeader { got: header.len() });
    }
    let h = InHeader::parse(header)?;
    let commit_id = u64_at(header, URING_ENT_OFFSET + 8);
    let payload_sz = (u32_at(header, URING_ENT_OFFSET + 16) as usize).min(payload.len());
    let n = arg_len(h.opcode).unwrap_or(0).min(URING_OP_IN_LEN);
    let arg = &header[URING_OP_IN_OFFSET..URING_OP_IN_OFFSET + n];
    Ok(Message {
        header: h,
        arg,
        payload: &payload[..payload_sz],
        commit_id,
    })
}

/// Writes a reply into a ring entry: the `fuse_out_header` at the start of the header
/// buffer, the payload size into the entry trailer. The body must already be in the payload.
pub fn fill_uring_reply(header: &mut [u8], unique: u64, error: i32, body_len: usize) {
    header[..OUT_HEADER_LEN].copy_from_slice(&out_header(unique, error, body_len));
    let at = URING_ENT_OFFSET + 16;
    header[at..at + 4].copy_from_slice(&(body_len as u32).to_ne_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(opcode: u32, arg: &[u8], payload: &[u8]) -> Vec<u8> {
        let len = IN_HEADER_LEN + arg.len() + payload.len();
        let mut m = Vec::new();
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&opcode.to_ne_bytes());
        m.extend_from_slice(&7u64.to_ne_bytes()); // unique
        m.extend_from_slice(&42u64.to_ne_bytes()); // nodeid
        m.extend_from_slice(&1000u32.to_ne_bytes());
        m.extend_from_slice(&100u32.to_ne_bytes());
        m.extend_from_slice(&55u32.to_ne_bytes());
        m.extend_from_slice(&[0u8; 4]);
        m.extend_from_slice(arg);
        m.extend_from_slice(payload);
        m
    }

    fn decode(m: &[u8]) -> (InHeader, Op<'_>) {
        let msg = split_message(m).unwrap();
        (msg.header, msg.parse().unwrap())
    }

    #[test]
    fn header_fields_and_lookup_name() {
        let m = message(opcode::LOOKUP, &[], b"hello\0");
        let (h, op) = decode(&m);
        assert_eq!(
            h,
            InHeader {
                len: m.len() as u32,
                opcode: opcode::LOOKUP,
                unique: 7,
                nodeid: 42,
                uid: 1000,
                gid: 100,
                pid: 55
            }
        );
        assert_eq!(op, Op::Lookup { name: b"hello" });
    }

    #[test]
    fn write_carries_data_and_kill_flag() {
        let mut arg = vec![0u8; 40];
        arg[0..8].copy_from_slice(&9u64.to_ne_bytes());
        arg[8..16].copy_from_slice(&4096u64.to_ne_bytes());
        arg[16..20].copy_from_slice(&3u32.to_ne_bytes());
        arg[20..24].copy_from_slice(&FUSE_WRITE_KILL_SUIDGID.to_ne_bytes());
        let m = message(opcode::WRITE, &arg, b"abc");
        assert_eq!(
            decode(&m).1,
            Op::Write {
                fh: 9,
                offset: 4096,
                kill_suidgid: true,
                data: b"abc"
            }
        );
        // A size beyond the payload is an error, not a short write.
        arg[16..20].copy_from_slice(&4u32.to_ne_bytes());
        let m = message(opcode::WRITE, &arg, b"abc");
        assert!(matches!(
            split_message(&m).unwrap().parse(),
            Err(ProtoError::ShortArg { .. })
        ));
    }

    #[test]
    fn setattr_fields_follow_valid_bits() {
        let mut arg = vec![0u8; 88];
        let valid = fattr::MODE | fattr::SIZE | fattr::ATIME | fattr::ATIME_NOW | fattr::MTIME;
        arg[0..4].copy_from_slice(&valid.to_ne_bytes());
        arg[16..24].copy_from_slice(&123u64.to_ne_bytes());
        arg[40..48].copy_from_slice(&1_700_000_000u64.to_ne_bytes());
        arg[60..64].copy_from_slice(&5u32.to_ne_bytes());
        arg[68..72].copy_from_slice(&0o100644u32.to_ne_bytes());
        arg[76..80].copy_from_slice(&77u32.to_ne_bytes()); // uid, not valid
        let m = message(opcode::SETATTR, &arg, &[]);
        assert_eq!(
            decode(&m).1,
            Op::Setattr(SetattrIn {
                mode: Some(0o100644),
                size: Some(123),
                atime: Some(TimeIn::Now),
                mtime: Some(TimeIn::At(1_700_000_000, 5)),
                ..SetattrIn::default()
            })
        );
    }

    #[test]
    fn two_name_ops() {
        let mut arg = vec![0u8; 16];
        arg[0..8].copy_from_slice(&3u64.to_ne_bytes());
        arg[8..12].copy_from_slice(&1u32.to_ne_bytes());
        let m = message(opcode::RENAME2, &arg, b"a\0bb\0");
        assert_eq!(
            decode(&m).1,
            Op::Rename {
                newdir: 3,
                flags: 1,
                name: b"a",
                newname: b"bb"
            }
        );
        let m = message(opcode::SYMLINK, &[], b"link\0/target\0");
        assert_eq!(
            decode(&m).1,
            Op::Symlink {
                name: b"link",
                target: b"/target"
            }
        );
        let m = message(opcode::SYMLINK, &[], b"link\0/target");
        assert_eq!(
            split_message(&m).unwrap().parse(),
            Err(ProtoError::BadName {
                opcode: opcode::SYMLINK
            })
        );
    }

    #[test]
    fn setxattr_value_is_sized_not_terminated() {
        let mut arg = vec![0u8; 8];
        arg[0..4].copy_from_slice(&3u32.to_ne_bytes());
        arg[4..8].copy_from_slice(&1i32.to_ne_bytes());
        let m = message(opcode::SETXATTR, &arg, b"user.x\0a\0b");
        assert_eq!(
            decode(&m).1,
            Op::Setxattr {
                flags: 1,
                name: b"user.x",
                value: b"a\0b"
            }
        );
    }

    #[test]
    fn init_reads_flags2_only_with_init_ext() {
        let mut arg = vec![0u8; 64];
        arg[0..4].copy_from_slice(&7u32.to_ne_bytes());
        arg[4..8].copy_from_slice(&45u32.to_ne_bytes());
        arg[8..12].copy_from_slice(&131072u32.to_ne_bytes());
        arg[12..16].copy_from_slice(&(init_flags::INIT_EXT as u32 | 1).to_ne_bytes());
        arg[16..20].copy_from_slice(&(1u32 << 9).to_ne_bytes());
        let m = message(opcode::INIT, &arg, &[]);
        let Op::Init(i) = decode(&m).1 else {
            panic!("not init")
        };
        assert_eq!((i.major, i.minor, i.max_readahead), (7, 45, 131072));
        assert_eq!(
            i.flags,
            init_flags::INIT_EXT | 1 | init_flags::OVER_IO_URING
        );
        arg[12..16].copy_from_slice(&1u32.to_ne_bytes());
        let m = message(opcode::INIT, &arg, &[]);
        let Op::Init(i) = decode(&m).1 else {
            panic!("not init")
        };
        assert_eq!(i.flags, 1);
    }

    #[test]
    fn short_and_mislabelled_messages_are_errors() {
        assert_eq!(
            split_message(&[0u8; 10]),
            Err(ProtoError::ShortHeader { got: 10 })
        );
        let mut m = message(opcode::GETATTR, &[0u8; 16], &[]);
        m.push(0);
        assert!(matches!(
            split_message(&m),
            Err(ProtoError::BadLength { .. })
        ));
        let m = message(opcode::READ, &[0u8; 8], &[]);
        assert_eq!(
            split_message(&m).unwrap().parse(),
            Err(ProtoError::ShortArg {
                opcode: opcode::READ,
                got: 8,
                need: 40
            })
        );
        let m = message(9999, &[1, 2, 3], &[]);
        assert_eq!(decode(&m).1, Op::Unsupported(9999));
    }

    #[test]
    fn batch_forget_pairs() {
        let mut arg = vec![0u8; 8];
        arg[0..4].copy_from_slice(&2u32.to_ne_bytes());
        let mut p = Vec::new();
        for v in [5u64, 1, 6, 2] {
            p.extend_from_slice(&v.to_ne_bytes());
        }
        let m = message(opcode::BATCH_FORGET, &arg, &p);
        assert_eq!(decode(&m).1, Op::BatchForget(vec![(5, 1), (6, 2)]));
    }

    #[test]
    fn reply_layouts_have_kernel_sizes() {
        let e = EntryOut {
            nodeid: 5,
            entry_ttl: Duration::new(1, 500),
            attr_ttl: Duration::from_secs(2),
            attr: AttrOut {
                ino: 5,
                mode: 0o100644,
                ..AttrOut::default()
            },
        };
        let mut r = Reply::default();
        r.entry(&e);
        assert_eq!(r.body.len(), 128);
        assert_eq!(u64_at(&r.body, 0), 5);
        assert_eq!(u64_at(&r.body, 16), 1);
        assert_eq!(u32_at(&r.body, 32), 500);
        assert_eq!(u64_at(&r.body, 40), 5); // attr.ino
        assert_eq!(u32_at(&r.body, 40 + 60), 0o100644); // attr.mode
        r.attr(Duration::from_secs(3), &e.attr);
        assert_eq!(r.body.len(), 104);
        r.create(&e, 9, fopen::PASSTHROUGH, 4);
        assert_eq!(r.body.len(), 144);
        assert_eq!(u32_at(&r.body, 140), 4);
        r.statfs(&StatfsOut::default());
        assert_eq!(r.body.len(), 80);
        r.init(&InitOut {
            flags: init_flags::PASSTHROUGH | 1,
            ..InitOut::default()
        });
        assert_eq!(r.body.len(), 64);
        assert_eq!(u32_at(&r.body, 12), 1);
        assert_eq!(u32_at(&r.body, 32), 1 << 5);
        r.err(libc::ENOENT);
        assert_eq!((r.error, r.body.len()), (-libc::ENOENT, 0));
    }

    #[test]
    fn dir_replies_pad_and_stop_when_full() {
        let mut r = Reply::default();
        let mut d = r.dir(72);
        assert!(!d.add(1, 1, libc::S_IFDIR, b"."));
        assert!(!d.add(7, 2, libc::S_IFREG, b"file-name"));
        assert!(d.add(8, 3, libc::S_IFREG, b"x"));
        assert_eq!(r.body.len(), 32 + 40);
        let mut r = Reply::default();
        let mut d = r.dir(4096);
        let e = EntryOut {
            nodeid: 7,
            entry_ttl: Duration::ZERO,
            attr_ttl: Duration::ZERO,
            attr: AttrOut {
                ino: 7,
                mode: libc::S_IFLNK | 0o777,
                ..AttrOut::default()
            },
        };
        assert!(!d.add_plus(&e, 1, b"l"));
        assert_eq!(r.body.len(), 128 + 32);
        assert_eq!(u32_at(&r.body, 128 + 20), libc::DT_LNK as u32);
    }

    #[test]
    fn uring_entries_round_trip() {
        let m = message(
            opcode::MKDIR,
            &[0o755u32.to_ne_bytes(), [0; 4]].concat(),
            b"",
        );
        let mut header = vec![0u8; URING_HEADER_LEN];
        header[..IN_HEADER_LEN].copy_from_slice(&m[..IN_HEADER_LEN]);
        header[URING_OP_IN_OFFSET..URING_OP_IN_OFFSET + 4].copy_from_slice(&0o755u32.to_ne_bytes());
        header[URING_ENT_OFFSET + 8..URING_ENT_OFFSET + 16].copy_from_slice(&99u64.to_ne_bytes());
        header[URING_ENT_OFFSET + 16..URING_ENT_OFFSET + 20].copy_from_slice(&4u32.to_ne_bytes());
        let payload = b"dir\0garbage";
        let msg = split_uring(&header, payload).unwrap();
        assert_eq!(msg.commit_id, 99);
        assert_eq!(
            msg.parse().unwrap(),
            Op::Mkdir {
                mode: 0o755,
                name: b"dir"
            }
        );
        fill_uring_reply(&mut header, 7, -2, 10);
        assert_eq!(u32_at(&header, 0), 26);
        assert_eq!(u32_at(&header, 4) as i32, -2);
        assert_eq!(u64_at(&header, 8), 7);
        assert_eq!(u32_at(&header, URING_ENT_OFFSET + 16), 10);
    }
}
