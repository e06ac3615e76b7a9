//! The process table as /proc shows it: every process with its parent and state, the
//! descendants of one, and whether one is still alive. A leaf: both the harness (`keel`,
//! which kills what a test left running) and the PID-1 tests (`pid1`) read it.

/// (pid, ppid, state) of every process, from /proc.
pub fn processes() -> Vec<(i32, i32, char)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let state = f.next().and_then(|s| s.chars().next()).unwrap_or('?');
        let ppid = f.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        out.push((pid, ppid, state));
    }
    out
}

/// Every descendant of `root`, zombies included.
pub fn descendants(root: i32) -> Vec<i32> {
    let all = processes();
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(c, pp, _) in &all {
            if pp == p && !out.contains(&c) {
                out.push(c);
                frontier.push(c);
            }
        }
    }
    out
}

/// True while `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rfind(')')
                .map(|i| !s[i + 1..].trim_start().starts_with('Z'))
                .unwrap_or(false)
        })
        .unwrap_or(false)
}
