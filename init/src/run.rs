//! Boot order for `keel run`: boot → open state → mount → spawn services → supervise →
//! shutdown. (Being built in the PID-1 issue.)

use std::ffi::OsString;

/// Entry point of `keel run`; returns the process exit code.
pub fn main(_args: Vec<OsString>) -> i32 {
    eprintln!("keel: run: not implemented yet");
    2
}
