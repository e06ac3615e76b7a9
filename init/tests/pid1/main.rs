//! keel as PID 1 and init, black-box: `keel run` as a subreaper and as a true PID 1, signal
//! forwarding and reaping, the ordered stop, and what the sandbox it starts can and cannot
//! reach. One test binary, each file a module.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod basic;
mod dir_run;
mod full_volume;
mod hold;
mod isolation;
mod ns;
mod seccomp;
mod shutdown;
mod signals;
mod workspace;
