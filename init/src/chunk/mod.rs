//! File bodies and content chunks.
