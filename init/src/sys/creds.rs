//! What the kernel knows about another process's credentials, read from
//! `/proc/<pid>/status`: whether it holds CAP_FSETID and which groups it is in. The workspace
//! uses it to drop set-ID bits as the kernel does for a local filesystem (FUSE tells keel the
//! caller's pid, uid and gid, not its capabilities or supplementary groups).

use std::io;

/// The capability number of CAP_FSETID (`include/uapi/linux/capability.h`).
const CAP_FSETID: u32 = 4;

/// A process's credentials as far as set-ID decisions go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Creds {
    /// CAP_FSETID is in its effective set.
    pub fsetid: bool,
    /// Its filesystem gid and supplementary groups.
    pub groups: Vec<u32>,
}

/// Reads the credentials of process `pid`.
pub fn of_pid(pid: u32) -> io::Result<Creds> {
    if pid == 0 {
        return Err(io::Error::new(io::ErrorKind::NotFound, "pid 0"));
    }
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    parse_status(&text).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("/proc/{pid}/status has no CapEff/Gid lines"),
        )
    })
}

fn parse_status(text: &str) -> Option<Creds> {
    let mut cap_eff = None;
    let mut groups = Vec::new();
    let mut fsgid = None;
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("CapEff:") {
            cap_eff = u64::from_str_radix(v.trim(), 16).ok();
        } else if let Some(v) = line.strip_prefix("Gid:") {
            // real, effective, saved, filesystem
            fsgid = v
                .split_whitespace()
                .nth(3)
                .and_then(|g| g.parse::<u32>().ok());
        } else if let Some(v) = line.strip_prefix("Groups:") {
            groups.extend(v.split_whitespace().filter_map(|g| g.parse::<u32>().ok()));
        }
    }
    groups.push(fsgid?);
    Some(Creds {
        fsetid: cap_eff? & (1 << CAP_FSETID) != 0,
        groups,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_caps_and_groups() {
        let s = "Name:\tx\nUid:\t1000\t1000\t1000\t1000\nGid:\t100\t100\t100\t101\n\
                 Groups:\t5 7 \nCapEff:\t0000000000000010\n";
        let c = parse_status(s).unwrap();
        assert!(c.fsetid);
        assert_eq!(c.groups, vec![5, 7, 101]);
        let s = "Gid:\t1\t1\t1\t1\nGroups:\nCapEff:\t00000000000001ef\n";
        assert!(!parse_status(s).unwrap().fsetid);
        assert_eq!(parse_status("Groups:\n"), None);
    }

    #[test]
    fn reads_this_process() {
        let c = of_pid(std::process::id()).unwrap();
        assert!(c.groups.contains(&nix::unistd::getegid().as_raw()));
    }
}
