//! The `keel` binary: `cli` parses the command line and runs the subcommand; the exit code it
//! returns ends the process. This is the only place that exits. No unsafe code: syscalls go through the library's `sys`.

#![deny(unsafe_code)]

mod cli;

fn main() {
    std::process::exit(cli::main());
}
