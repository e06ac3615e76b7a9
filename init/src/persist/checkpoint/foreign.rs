//! A remote head this state dir did not write. Each checkpoint replaces the head it read;
//! when that head is not the snapshot this state dir last recorded (nor the one it was
//! advancing to when it stopped), someone else checkpointed since: another keel that took
//! the workspace over while this one was stopped, or this state dir was restored from an
//! older snapshot, or it never checkpointed to a remote that has history. Replacing such a
//! head as if it were this state dir's own would drop the other writer's snapshots from the
//! history (a later gc deletes them), and a delta on this state dir's last snapshot could
//! name a parent that writer's gc already took. So the foreign head is named
//! `diverged-S` (kept whatever the retention, with its chain), the checkpoint follows it in
//! the history, and it is a full snapshot that offers every chunk again (the other
//! writer's gc may have deleted chunks this state dir's maps name).

use super::steps::Prior;
use super::{kv_u64, CheckpointError, Persister};
use crate::persist::repo::Head;
use crate::persist::snapshots;
use crate::time::now_ns;

/// The snapshot whose head advance this state dir committed last (set before the head
/// is written, so a checkpoint that died between the two knows the head is its own).
pub(super) const ADVANCING: &str = "advancing_seq";

/// The name that keeps a foreign head `seq`.
pub(super) fn name_of(seq: u64) -> String {
    format!("diverged-{seq}")
}

impl Persister {
    /// Records that this state dir is about to point the head at `seq`.
    pub(super) fn mark_advancing(&self, seq: u64) -> Result<(), CheckpointError> {
        let tx = self.store.write()?;
        tx.persist_set(ADVANCING, &seq.to_string())?;
        tx.commit()?;
        Ok(())
    }

    /// When `head` is not this state dir's own: names it, and makes this checkpoint follow it
    /// as a full snapshot that trusts no chunk map (`prior` changed to say so). A head naming
    /// a snapshot that is not there has nothing to keep: only the chunk maps are distrusted.
    pub(super) fn follow_foreign_head(
        &self,
        prior: &mut Prior,
        head: Option<&Head>,
    ) -> Result<(), CheckpointError> {
        let Some(h) = head else {
            return Ok(());
        };
        if prior.last_seq == Some(h.seq) || kv_u64(&self.store.read(), ADVANCING)? == Some(h.seq) {
            return Ok(());
        }
        let there = self
            .repo
            .remote
            .head(&self.repo.snapshot_key(h.seq))
            .map_err(CheckpointError::FindForeignHead)?
            .is_some();
        let ours = prior
            .last_seq
            .map_or("none".to_string(), |s| format!("snapshot {s}"));
        if there {
            let name = name_of(h.seq);
            snapshots::record(
                &self.repo,
                h.seq,
                Some(&name),
                &format!(
                    "the remote's head when a state dir whose last checkpoint was {ours} checkpointed over it"
                ),
                now_ns(),
            )
            .map_err(|e| CheckpointError::KeepForeignHead(Box::new(e)))?;
            tracing::warn!(
                "the remote's head, snapshot {}, was written by {} (epoch {}), not by this state dir (its last checkpoint: {ours}): it is kept as `{name}` and this checkpoint, a full snapshot, follows it (`keel diff {name}` shows what differs)",
                h.seq,
                h.writer,
                h.epoch
            );
            prior.last_seq = Some(h.seq);
        } else {
            tracing::warn!(
                "the remote's head names snapshot {}, which is not there: this checkpoint is a full snapshot",
                h.seq
            );
        }
        // Only the same remote's chunks can still be there: lazily restored windows carry over.
        prior.diverged = prior.trusted;
        prior.trusted = false;
        if prior.diverged && !prior.missing.is_empty() {
            tracing::warn!(
                windows = prior.missing.values().map(Vec::len).sum::<usize>(),
                "windows of lazily restored files not fetched yet are carried over as they are: if the other writer's gc deleted their chunks, those files cannot be read (`keel fsck` finds them)"
            );
        }
        Ok(())
    }
}
