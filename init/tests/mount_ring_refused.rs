//! The kernel refuses keel's ring entries after INIT already promised them (simulated with
//! `KEEL_TEST_RING_PAYLOAD`: entries smaller than the kernel's largest request). The kernel
//! would hold every request until the rings are ready, so keel unmounts and mounts again over
//! `/dev/fuse`: the mount works, and it says so. Its own test binary, because the variable
//! applies to every keel this process starts.

mod common;

use std::fs;

#[test]
fn refused_rings_fall_back_to_dev_fuse() {
    if !common::fuse_available() {
        return;
    }
    let on = fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .is_ok_and(|s| s.trim() == "Y");
    if !on {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but enable_uring is not Y"
        );
        eprintln!("skipping: FUSE over io_uring is not enabled on this host");
        return;
    }
    std::env::set_var("KEEL_TEST_RING_PAYLOAD", "4096");
    let mut k = keel_or_skip!();
    // keel logs its transport after the kernel already shows the mount: wait for the line.
    let deadline = std::time::Instant::now() + common::READY_TIMEOUT;
    while !k.log_text().contains("workspace mounted") && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let log = k.log_text();
    assert!(log.contains("mounting again over /dev/fuse"), "{log}");
    assert!(log.contains("transport=\"classic\""), "{log}");
    fs::create_dir(k.p("d")).unwrap();
    for i in 0..50 {
        fs::write(k.p(&format!("d/{i}")), format!("{i}")).unwrap();
    }
    let big = common::pattern(3 << 20, 1);
    fs::write(k.p("big"), &big).unwrap();
    k.remount();
    assert_eq!(fs::read(k.p("d/49")).unwrap(), b"49");
    assert_eq!(fs::read(k.p("big")).unwrap(), big);
}
