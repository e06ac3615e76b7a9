//! supervisor (PID-1 issue).
