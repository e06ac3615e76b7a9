//! A diff written out as it is produced, to any `Write`: text (one line per change, then a
//! summary line) or JSON (`{"from":A,"to":B,"changes":[` one change per line `]` and any
//! fields known only at the end, such as how long it took). Nothing is kept but the counts.

use std::io::Write;

use super::{Change, DiffError};

/// How a diff is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    Text,
    Json,
}

/// One diff being written.
pub struct Answer<W: Write> {
    w: W,
    format: Format,
    from: u64,
    to: u64,
    /// added, removed, modified, renamed.
    counts: [u64; 4],
    started: bool,
}

fn write_err(e: std::io::Error) -> DiffError {
    DiffError::Write(e)
}

impl<W: Write> Answer<W> {
    pub fn new(w: W, format: Format, from: u64, to: u64) -> Self {
        Answer {
            w,
            format,
            from,
            to,
            counts: [0; 4],
            started: false,
        }
    }

    fn start(&mut self) -> Result<(), DiffError> {
        if !self.started && self.format == Format::Json {
            write!(
                self.w,
                "{{\"from\":{},\"to\":{},\"changes\":[",
                self.from, self.to
            )
            .map_err(write_err)?;
        }
        self.started = true;
        Ok(())
    }

    /// Writes one change.
    pub fn change(&mut self, c: &Change) -> Result<(), DiffError> {
        let first = !self.started || self.counts.iter().sum::<u64>() == 0;
        self.start()?;
        let (i, tag) = match c.change {
            "added" => (0, "A"),
            "removed" => (1, "D"),
            "renamed" => (3, "R"),
            _ => (2, "M"),
        };
        self.counts[i] += 1;
        let w = &mut self.w;
        match self.format {
            Format::Json => {
                w.write_all(if first { b"\n" } else { b",\n" })
                    .map_err(write_err)?;
                serde_json::to_writer(&mut *w, c).map_err(|e| write_err(e.into()))?;
            }
            Format::Text => {
                let sz = |v: Option<u64>| v.map(|n| n.to_string()).unwrap_or_else(|| "-".into());
                let what = if c.what.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", c.what.join(","))
                };
                let sizes = match (c.size_before, c.size_after) {
                    (None, None) => String::new(),
                    (Some(a), None) | (None, Some(a)) => format!("  {a} bytes"),
                    (a, b) if a == b => format!("  {} bytes", sz(a)),
                    (a, b) => format!("  {} -> {} bytes", sz(a), sz(b)),
                };
                let r = match &c.from {
                    Some(f) => writeln!(w, "{tag} {f} -> {}{what}{sizes}", c.path),
                    None => writeln!(w, "{tag} {}{what}{sizes}", c.path),
                };
                r.map_err(write_err)?;
            }
        }
        Ok(())
    }

    /// Ends the diff: the summary line, or the JSON's `extra` fields and its end; returns
    /// the writer, flushed.
    pub fn finish(mut self, extra: &[(&str, serde_json::Value)]) -> Result<W, DiffError> {
        let any = self.counts.iter().sum::<u64>() > 0;
        self.start()?;
        let [added, removed, modified, renamed] = self.counts;
        let w = &mut self.w;
        match self.format {
            Format::Text => writeln!(
                w,
                "snapshot {} -> {}: {added} added, {removed} removed, {modified} modified, {renamed} renamed",
                self.from, self.to
            ),
            Format::Json => {
                let mut tail = String::from(if any { "\n]" } else { "]" });
                for (k, v) in extra {
                    tail.push_str(&format!(",{}:{v}", serde_json::Value::from(*k)));
                }
                tail.push_str("}\n");
                w.write_all(tail.as_bytes())
            }
        }
        .map_err(write_err)?;
        self.w.flush().map_err(write_err)?;
        Ok(self.w)
    }
}
