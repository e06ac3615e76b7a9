//! boot (PID-1 issue).
