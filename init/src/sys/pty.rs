//! Pseudo-terminals for processes started through the API with `pty`: a pair made with
//! `openpty` at the size asked for, the slave handed to the child as its controlling
//! terminal (`process::Stdio::Terminal`), the master kept by keel to read output, write
//! input and resize (`TIOCSWINSZ`, which sends SIGWINCH to the terminal's foreground group).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

/// keel's side of a terminal and the child's.
#[derive(Debug)]
pub struct Pty {
    pub master: OwnedFd,
    pub slave: OwnedFd,
}

fn winsize(rows: u16, cols: u16) -> nix::pty::Winsize {
    nix::pty::Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

/// A new terminal of `rows` x `cols`; both ends close on exec.
pub fn open(rows: u16, cols: u16) -> io::Result<Pty> {
    let ws = winsize(rows, cols);
    let p =
        nix::pty::openpty(Some(&ws), None).map_err(|e| io::Error::from_raw_os_error(e as i32))?;
    for fd in [&p.master, &p.slave] {
        nix::fcntl::fcntl(
            fd,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )
        .map_err(|e| io::Error::from_raw_os_error(e as i32))?;
    }
    Ok(Pty {
        master: p.master,
        slave: p.slave,
    })
}

/// Sets the terminal's size (through its master side).
pub fn resize(master: &OwnedFd, rows: u16, cols: u16) -> io::Result<()> {
    let ws = winsize(rows, cols);
    // SAFETY: TIOCSWINSZ reads one winsize struct from the pointer, which lives on our stack.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
