//! `${VAR}` and `${VAR:-default}` in the config values that name places, so one profile
//! serves many instances (`remote = "s3://bucket/${KEEL_WORKSPACE_ID}"`). A pure function
//! over a string and a lookup; the loader applies it to the keys listed in `EXPANDED_KEYS`
//! after parsing and before validating, so a variable that is missing stops keel with one
//! line naming the key and the variable before anything is mounted.
//!
//! Rules: `${NAME}` is NAME's value, and NAME unset or empty is an error (an empty workspace
//! id must not silently become the root of a bucket); `${NAME:-default}` is NAME's value, or
//! `default` (literal text up to the next `}`) when NAME is unset or empty; `$$` is one `$`.
//! Any other `$` is an error, so a shell-style `$NAME` is not left in a path by mistake.
//! NAME is `[A-Za-z_][A-Za-z0-9_]*`. Values are not expanded again.

/// The keys whose values are expanded: every config string that names a place.
pub const EXPANDED_KEYS: &[&str] = &[
    "workspace.mount_point",
    "workspace.state_dir",
    "persist.remote",
    "persist.endpoint",
    "persist.region",
    "persist.credentials_file",
    "control.listen",
    "control.socket",
];

/// Why a value could not be expanded; the loader prefixes the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpandError {
    #[error("${{{0}}} is not set and has no default (set {0}, or write ${{{0}:-default}})")]
    Unset(String),
    #[error("${{{0}}} is set but empty and has no default (write ${{{0}:-default}})")]
    Empty(String),
    #[error("`${{` at byte {0} has no closing `}}`")]
    Unclosed(usize),
    #[error("`{0}` is not a variable name (letters, digits and _, not starting with a digit)")]
    BadName(String),
    #[error("`$` at byte {0} is not `${{NAME}}`, `${{NAME:-default}}` or `$$` (a literal $)")]
    LoneDollar(usize),
}

/// Expands `${NAME}`, `${NAME:-default}` and `$$` in `s`, looking variables up with `lookup`.
pub fn expand(s: &str, lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, ExpandError> {
    if !s.contains('$') {
        return Ok(s.to_string());
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let at = s.len() - rest.len() + i;
        let after = &rest[i + 1..];
        if let Some(r) = after.strip_prefix('$') {
            out.push('$');
            rest = r;
            continue;
        }
        let Some(body) = after.strip_prefix('{') else {
            return Err(ExpandError::LoneDollar(at));
        };
        let end = body.find('}').ok_or(ExpandError::Unclosed(at))?;
        let inner = &body[..end];
        let (name, default) = match inner.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (inner, None),
        };
        if !is_name(name) {
            return Err(ExpandError::BadName(name.to_string()));
        }
        match (lookup(name), default) {
            (Some(v), _) if !v.is_empty() => out.push_str(&v),
            (_, Some(d)) => out.push_str(d),
            (Some(_), None) => return Err(ExpandError::Empty(name.to_string())),
            (None, None) => return Err(ExpandError::Unset(name.to_string())),
        }
        rest = &body[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn is_name(n: &str) -> bool {
    let mut b = n.bytes();
    matches!(b.next(), Some(c) if c == b'_' || c.is_ascii_alphabetic())
        && b.all(|c| c == b'_' || c.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "ID" => Some("w-42".into()),
            "EMPTY" => Some(String::new()),
            "DOLLAR" => Some("a$b${X}".into()),
            _ => None,
        }
    }

    fn x(s: &str) -> Result<String, ExpandError> {
        expand(s, &env)
    }

    #[test]
    fn plain_strings_are_unchanged() {
        assert_eq!(x("s3://b/p").unwrap(), "s3://b/p");
        assert_eq!(x("").unwrap(), "");
    }

    #[test]
    fn variables_and_defaults() {
        assert_eq!(x("s3://b/${ID}").unwrap(), "s3://b/w-42");
        assert_eq!(x("${ID}/${ID}").unwrap(), "w-42/w-42");
        assert_eq!(x("s3://b/${NOPE:-shared}/x").unwrap(), "s3://b/shared/x");
        assert_eq!(x("${ID:-other}").unwrap(), "w-42");
        assert_eq!(x("${EMPTY:-d}").unwrap(), "d", "empty takes the default");
        assert_eq!(x("${NOPE:-}").unwrap(), "", "an explicitly empty default");
        assert_eq!(
            x("0.0.0.0:${NOPE:-8787}").unwrap(),
            "0.0.0.0:8787",
            "defaults may hold `:`"
        );
        assert_eq!(x("${NOPE:-a-b:c}").unwrap(), "a-b:c");
    }

    #[test]
    fn values_are_not_expanded_again() {
        assert_eq!(x("${DOLLAR}").unwrap(), "a$b${X}");
    }

    #[test]
    fn dollar_escape() {
        assert_eq!(x("a$$b").unwrap(), "a$b");
        assert_eq!(x("$$${ID}$$").unwrap(), "$w-42$");
        assert_eq!(x("$${ID}").unwrap(), "${ID}");
    }

    #[test]
    fn errors_name_the_variable() {
        assert_eq!(x("s3://b/${NOPE}"), Err(ExpandError::Unset("NOPE".into())));
        assert_eq!(x("${EMPTY}"), Err(ExpandError::Empty("EMPTY".into())));
        assert_eq!(x("a${ID"), Err(ExpandError::Unclosed(1)));
        assert_eq!(x("$ID"), Err(ExpandError::LoneDollar(0)));
        assert_eq!(x("ab$"), Err(ExpandError::LoneDollar(2)));
        assert_eq!(x("${1X}"), Err(ExpandError::BadName("1X".into())));
        assert_eq!(x("${}"), Err(ExpandError::BadName(String::new())));
        assert_eq!(x("${A B}"), Err(ExpandError::BadName("A B".into())));
        let msg = x("${KEEL_WORKSPACE_ID}").unwrap_err().to_string();
        assert!(
            msg.contains("${KEEL_WORKSPACE_ID} is not set") && !msg.contains('\n'),
            "{msg}"
        );
    }
}
