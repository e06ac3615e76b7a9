//! `POST /exec`'s request: the JSON body (and the options also accepted as query
//! parameters), checked into an `ExecPlan` before anything starts. Every refusal is one line
//! naming the field (the API answers 400 with it).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// Why a request cannot run (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("the body is not a valid exec request: {0}")]
    Json(String),
    #[error("give exactly one of `argv` (a command and its arguments) or `shell` (a command line for /bin/sh -c)")]
    Command,
    #[error("`argv` is empty or its first element is")]
    EmptyArgv,
    #[error("`{0}` contains a NUL byte")]
    Nul(&'static str),
    #[error("`cwd` {0}: must be an absolute path")]
    CwdRelative(String),
    #[error("`cwd` {0}: no such directory")]
    CwdMissing(String),
    #[error("`env` name `{0}`: must be non-empty without `=` or NUL")]
    EnvName(String),
    #[error("`stdin`: {0}")]
    Stdin(String),
    #[error("`pty`: rows and cols must be 1 to 10000")]
    PtySize,
    #[error("`timeout` {0}: {1}")]
    Timeout(String, String),
    #[error("`request_id`: 1 to 128 visible ASCII characters")]
    RequestId,
    #[error("`rollback_on` {0}: use \"failure\" or \"timeout\"")]
    RollbackOn(String),
    #[error("`checkpoint` {0}: the only value is \"wait\"")]
    Checkpoint(String),
    #[error("`snapshot` {0}: use 1 to 100 of A-Z a-z 0-9 . _ - (not only digits, not starting with . or -)")]
    SnapshotName(String),
    #[error("query parameter `{0}`: {1}")]
    Query(String, String),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum UserSpec {
    Name(String),
    Id(u32),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TimeoutSpec {
    Text(String),
    Secs(f64),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StdinText {
    text: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StdinBase64 {
    base64: String,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum StdinSpec {
    Mode(String),
    Text(StdinText),
    Base64(StdinBase64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    #[serde(default = "default_rows")]
    pub rows: u16,
    #[serde(default = "default_cols")]
    pub cols: u16,
}

fn default_rows() -> u16 {
    24
}
fn default_cols() -> u16 {
    80
}

/// The body as sent.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    argv: Option<Vec<String>>,
    shell: Option<String>,
    cwd: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    user: Option<UserSpec>,
    stdin: Option<StdinSpec>,
    pty: Option<PtySize>,
    timeout: Option<TimeoutSpec>,
    request_id: Option<String>,
    #[serde(default)]
    detach: bool,
    #[serde(default)]
    diff: bool,
    snapshot: Option<String>,
    rollback_on: Option<String>,
    checkpoint: Option<String>,
}

/// What the process reads on its stdin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stdin {
    /// /dev/null.
    None,
    /// These bytes, then end of file.
    Bytes(Vec<u8>),
    /// A pipe kept open until the client closes it (`POST /processes/{id}/stdin`).
    Stream,
}

/// When a transactional exec rolls the workspace back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RollbackOn {
    /// Any exit but code 0 (a signal, a timeout, 127 included).
    Failure,
    /// Only when the timeout killed it.
    Timeout,
}

impl RollbackOn {
    pub fn as_str(self) -> &'static str {
        match self {
            RollbackOn::Failure => "failure",
            RollbackOn::Timeout => "timeout",
        }
    }
}

/// What the workspace options ask around the command (`exec::around`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Around {
    pub diff: bool,
    pub snapshot: Option<String>,
    pub rollback_on: Option<RollbackOn>,
    pub checkpoint_wait: bool,
}

impl Around {
    /// Whether any option needs the checkpoint service.
    pub fn any(&self) -> bool {
        self.diff || self.snapshot.is_some() || self.rollback_on.is_some() || self.checkpoint_wait
    }
}

/// A checked request.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecPlan {
    pub argv: Vec<OsString>,
    /// `None`: the default (the workspace, else the main command's directory).
    pub cwd: Option<PathBuf>,
    pub env: Vec<(String, String)>,
    /// `None`: the main command's user.
    pub user: Option<String>,
    pub stdin: Stdin,
    pub pty: Option<PtySize>,
    pub timeout: Option<Duration>,
    pub request_id: Option<String>,
    /// Answer with the record at once instead of the event stream.
    pub detach: bool,
    pub around: Around,
}

/// Parses and checks a request body and the query string's options (`diff`, `snapshot`,
/// `rollback_on`, `checkpoint`, `detach`, which win over the body's).
pub fn parse(body: &[u8], query: &[(String, String)]) -> Result<ExecPlan, RequestError> {
    let mut b: Body = if body.iter().all(u8::is_ascii_whitespace) {
        Body::default()
    } else {
        serde_json::from_slice(body).map_err(|e| RequestError::Json(e.to_string()))?
    };
    let flag = |k: &str, v: &str| match v {
        "" | "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        _ => Err(RequestError::Query(k.into(), "use 1 or 0".into())),
    };
    for (k, v) in query {
        match k.as_str() {
            "diff" => b.diff = flag(k, v)?,
            "detach" => b.detach = flag(k, v)?,
            "snapshot" => b.snapshot = Some(v.clone()),
            "rollback_on" => b.rollback_on = Some(v.clone()),
            "checkpoint" => b.checkpoint = Some(v.clone()),
            _ => {}
        }
    }
    let argv: Vec<String> = match (b.argv, b.shell) {
        (Some(a), None) => a,
        (None, Some(s)) => vec!["/bin/sh".into(), "-c".into(), s],
        _ => return Err(RequestError::Command),
    };
    if argv.first().is_none_or(|a| a.is_empty()) {
        return Err(RequestError::EmptyArgv);
    }
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(RequestError::Nul("argv"));
    }
    let cwd = match b.cwd {
        None => None,
        Some(c) => {
            if c.contains('\0') {
                return Err(RequestError::Nul("cwd"));
            }
            let p = PathBuf::from(&c);
            if !p.is_absolute() {
                return Err(RequestError::CwdRelative(c));
            }
            if !p.is_dir() {
                return Err(RequestError::CwdMissing(c));
            }
            Some(p)
        }
    };
    for (k, v) in &b.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(RequestError::EnvName(k.clone()));
        }
        if v.contains('\0') {
            return Err(RequestError::Nul("env"));
        }
    }
    let user = match b.user {
        None => None,
        Some(UserSpec::Id(n)) => Some(n.to_string()),
        Some(UserSpec::Name(n)) if n.is_empty() || n.contains('\0') => {
            return Err(RequestError::Nul("user"))
        }
        Some(UserSpec::Name(n)) => Some(n),
    };
    let stdin = match b.stdin {
        None => Stdin::None,
        Some(StdinSpec::Mode(m)) => match m.as_str() {
            "none" => Stdin::None,
            "stream" => Stdin::Stream,
            _ => {
                return Err(RequestError::Stdin(format!(
                    "`{m}`: use \"none\", \"stream\", {{\"text\": ...}} or {{\"base64\": ...}}"
                )))
            }
        },
        Some(StdinSpec::Text(t)) => Stdin::Bytes(t.text.into_bytes()),
        Some(StdinSpec::Base64(d)) => {
            use base64::Engine;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(d.base64.as_bytes())
                .map_err(|e| RequestError::Stdin(format!("base64: {e}")))?;
            Stdin::Bytes(bytes)
        }
    };
    if let Some(p) = &b.pty {
        if !(1..=10000).contains(&p.rows) || !(1..=10000).contains(&p.cols) {
            return Err(RequestError::PtySize);
        }
    }
    let timeout = match b.timeout {
        None => None,
        Some(TimeoutSpec::Text(t)) => Some(
            crate::config::units::parse_duration(&t)
                .map_err(|e| RequestError::Timeout(t.clone(), e.to_string()))?,
        ),
        Some(TimeoutSpec::Secs(s)) => {
            if !s.is_finite() || !(0.0..=1e9).contains(&s) {
                return Err(RequestError::Timeout(s.to_string(), "out of range".into()));
            }
            Some(Duration::from_secs_f64(s))
        }
    };
    if timeout.is_some_and(|t| t.is_zero()) {
        return Err(RequestError::Timeout(
            "0".into(),
            "must be more than 0".into(),
        ));
    }
    if let Some(id) = &b.request_id {
        if id.is_empty() || id.len() > 128 || !id.bytes().all(|c| c.is_ascii_graphic()) {
            return Err(RequestError::RequestId);
        }
    }
    let rollback_on = match b.rollback_on.as_deref() {
        None => None,
        Some("failure") => Some(RollbackOn::Failure),
        Some("timeout") => Some(RollbackOn::Timeout),
        Some(o) => return Err(RequestError::RollbackOn(o.into())),
    };
    let checkpoint_wait = match b.checkpoint.as_deref() {
        None => false,
        Some("wait") => true,
        Some(o) => return Err(RequestError::Checkpoint(o.into())),
    };
    if let Some(n) = &b.snapshot {
        let ok = !n.is_empty()
            && n.len() <= 100
            && !n.bytes().all(|c| c.is_ascii_digit())
            && !n.starts_with(['.', '-'])
            && n.bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'));
        if !ok {
            return Err(RequestError::SnapshotName(n.clone()));
        }
    }
    Ok(ExecPlan {
        argv: argv.into_iter().map(OsString::from).collect(),
        cwd,
        env: b.env.into_iter().collect(),
        user,
        stdin,
        pty: b.pty,
        timeout,
        request_id: b.request_id,
        detach: b.detach,
        around: Around {
            diff: b.diff,
            snapshot: b.snapshot,
            rollback_on,
            checkpoint_wait,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(body: &str) -> Result<ExecPlan, RequestError> {
        parse(body.as_bytes(), &[])
    }

    #[test]
    fn a_command_is_argv_or_a_shell_line() {
        let r = p(r#"{"argv": ["echo", "hi"]}"#).unwrap();
        assert_eq!(r.argv, vec![OsString::from("echo"), "hi".into()]);
        assert_eq!(r.stdin, Stdin::None);
        let r = p(r#"{"shell": "echo hi | wc -c"}"#).unwrap();
        assert_eq!(r.argv[..2], [OsString::from("/bin/sh"), "-c".into()]);
        assert_eq!(
            p(r#"{"argv": ["a"], "shell": "b"}"#),
            Err(RequestError::Command)
        );
        assert_eq!(p("{}"), Err(RequestError::Command));
        assert_eq!(p(r#"{"argv": []}"#), Err(RequestError::EmptyArgv));
        assert!(matches!(
            p(r#"{"argv": ["a"], "bogus": 1}"#),
            Err(RequestError::Json(_))
        ));
    }

    #[test]
    fn every_field_is_checked() {
        let r = p(
            r#"{"argv":["x"],"cwd":"/","env":{"A":"1"},"user":1000,"stdin":{"text":"hi"},
                     "pty":{"rows":30},"timeout":"2s","request_id":"r-1","diff":true,
                     "snapshot":"before-x","rollback_on":"failure","checkpoint":"wait"}"#,
        )
        .unwrap();
        assert_eq!(r.cwd.as_deref(), Some(std::path::Path::new("/")));
        assert_eq!(r.user.as_deref(), Some("1000"));
        assert_eq!(r.stdin, Stdin::Bytes(b"hi".to_vec()));
        assert_eq!(r.pty, Some(PtySize { rows: 30, cols: 80 }));
        assert_eq!(r.timeout, Some(Duration::from_secs(2)));
        assert!(r.around.diff && r.around.checkpoint_wait);
        assert_eq!(r.around.rollback_on, Some(RollbackOn::Failure));
        let r = p(r#"{"argv":["x"],"stdin":{"base64":"AAEC/w=="},"timeout":1.5}"#).unwrap();
        assert_eq!(r.stdin, Stdin::Bytes(vec![0, 1, 2, 255]));
        assert_eq!(r.timeout, Some(Duration::from_millis(1500)));
        for (body, want) in [
            (r#"{"argv":["x"],"cwd":"rel"}"#, "`cwd` rel"),
            (
                r#"{"argv":["x"],"cwd":"/no/such/keel/dir"}"#,
                "`cwd` /no/such/keel/dir",
            ),
            (r#"{"argv":["x"],"env":{"A=B":"1"}}"#, "`env` name"),
            (r#"{"argv":["x"],"stdin":"all"}"#, "`stdin`"),
            (
                r#"{"argv":["x"],"stdin":{"base64":"!!"}}"#,
                "`stdin`: base64",
            ),
            (r#"{"argv":["x"],"pty":{"rows":0}}"#, "`pty`"),
            (r#"{"argv":["x"],"timeout":"soon"}"#, "`timeout` soon"),
            (r#"{"argv":["x"],"timeout":0}"#, "`timeout` 0"),
            (r#"{"argv":["x"],"request_id":""}"#, "`request_id`"),
            (
                r#"{"argv":["x"],"rollback_on":"always"}"#,
                "`rollback_on` always",
            ),
            (r#"{"argv":["x"],"checkpoint":"now"}"#, "`checkpoint` now"),
            (r#"{"argv":["x"],"snapshot":"123"}"#, "`snapshot` 123"),
        ] {
            let e = p(body).unwrap_err().to_string();
            assert!(e.starts_with(want), "{body}: {e}");
        }
    }

    #[test]
    fn query_options_win() {
        let q = |k: &str, v: &str| (k.to_string(), v.to_string());
        let r = parse(
            br#"{"argv":["x"]}"#,
            &[q("diff", "1"), q("rollback_on", "timeout"), q("detach", "")],
        )
        .unwrap();
        assert!(r.around.diff && r.detach);
        assert_eq!(r.around.rollback_on, Some(RollbackOn::Timeout));
        assert!(parse(br#"{"argv":["x"]}"#, &[q("diff", "yes")]).is_err());
    }
}
