//! `keel mount`: argument parsing for mounting the workspace in the foreground.

use std::ffi::OsString;

pub fn mount_main(_args: Vec<OsString>) -> i32 {
    eprintln!("keel: mount: not implemented yet");
    2
}
