//! File bytes on local disk: one *body* file per regular file that outgrew inline storage,
//! written in place (`bodies/XX/<id>` under the state dir). Content-addressed chunks for
//! checkpoints will live here too. This module imports no sibling module except `sys`.

pub mod body;
pub mod reserve;

pub use body::{BodyError, BodyStore};
