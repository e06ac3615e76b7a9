//! The `[sandbox]` table: the seccomp filter on everything keel starts (`seccomp`): on by
//! default, off, or on with some of what it refuses allowed by name.

use super::BadKey;
use serde::Deserialize;

use crate::sys::seccomp::{MOUNT_FAMILY, USERNS};

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxConfig {
    pub seccomp: Seccomp,
}

/// `seccomp = true` (the default), `false`, or the list of what to allow.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Seccomp {
    On(bool),
    Allow(Vec<String>),
}

impl Default for Seccomp {
    fn default() -> Self {
        Seccomp::On(true)
    }
}

impl Seccomp {
    /// What the filter lets through; None: no filter.
    pub fn allowed(&self) -> Option<&[String]> {
        match self {
            Seccomp::On(false) => None,
            Seccomp::On(true) => Some(&[]),
            Seccomp::Allow(a) => Some(a),
        }
    }
}

impl SandboxConfig {
    pub fn validate(&self) -> Result<(), BadKey> {
        if let Seccomp::Allow(list) = &self.seccomp {
            for a in list {
                if a != USERNS && !MOUNT_FAMILY.contains(&a.as_str()) {
                    return Err(BadKey::new(
                        "sandbox.seccomp".into(),
                        format!(
                            "cannot allow `{a}`: true, false or a list of {USERNS}, {}",
                            MOUNT_FAMILY.join(", ")
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Seccomp;
    use crate::config::Config;
    use std::path::Path;

    #[test]
    fn default_on_off_and_lists() {
        let p = Path::new("c.toml");
        let c = Config::parse("", p).unwrap();
        assert_eq!(c.sandbox.seccomp, Seccomp::On(true));
        assert_eq!(c.sandbox.seccomp.allowed(), Some(&[][..]));
        let c = Config::parse("[sandbox]\nseccomp = false\n", p).unwrap();
        assert_eq!(c.sandbox.seccomp.allowed(), None);
        let c = Config::parse("[sandbox]\nseccomp = [\"userns\", \"mount\"]\n", p).unwrap();
        assert_eq!(
            c.sandbox.seccomp.allowed().unwrap(),
            &["userns".to_string(), "mount".to_string()]
        );
        let e = Config::parse("[sandbox]\nseccomp = [\"ptrace\"]\n", p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sandbox.seccomp") && e.contains("ptrace"), "{e}");
        assert!(Config::parse("[sandbox]\nseccomp = \"on\"\n", p).is_err());
        assert!(Config::parse("[sandbox]\nfilter = true\n", p).is_err());
    }
}
