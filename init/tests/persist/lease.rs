//! The single-writer lease and remote resilience against a real S3 endpoint (moto_server):
//! a second writer is refused with the holder named and gets the lease once the first
//! releases; an abandoned lease is refused while live, waited out with `wait`, taken at once
//! with `force` (and the old holder's next checkpoint fails with "lease lost" without
//! moving the head); a remote cut in the middle of a large checkpoint is retried until it
//! is back, with nothing lost; a lease that lapsed in an outage longer than its ttl is
//! taken back when the remote answers (checkpoints resume without a restart), and a start
//! while the remote is gone serves the local workspace with the lease pending; and no
//! credential ever shows up in an error or status.
//!
//! Every test uses the same distinctive secret key (set once for the whole binary), so any
//! string a test sees can be checked for it.

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::config::{PersistConfig, Takeover, WorkspaceConfig};
use keel::persist::lease::LeaseState;
use keel::persist::{acquire_lease, open_remote, restore, CheckpointOptions, Persister, Service};
use support::persist::*;
use support::s3::{start_moto, Proxy};

const SECRET: &str = support::s3::SECRET_ACCESS_KEY;
const KEY_ID: &str = support::s3::ACCESS_KEY_ID;

fn creds() {
    support::s3::credentials();
}

fn cfg(port: u16, prefix: &str, ttl: Duration, takeover: Takeover) -> PersistConfig {
    creds();
    PersistConfig {
        remote: format!("s3://keel/{prefix}"),
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        region: Some("us-east-1".into()),
        allow_http: true,
        lease_ttl: ttl,
        takeover,
        ..Default::default()
    }
}

fn no_secret(what: &str, text: &str) {
    assert!(
        !text.contains(SECRET) && !text.contains(KEY_ID),
        "{what} leaks a credential: {text}"
    );
}

fn head_seq(c: &PersistConfig) -> Option<(u64, u64)> {
    let repo = open_remote(&c.remote, c).unwrap();
    repo.read_head().unwrap().map(|(h, _)| (h.seq, h.epoch))
}

#[test]
fn second_writer_is_refused_with_the_holder_named_until_the_first_releases() {
    let Some((_moto, port)) = start_moto() else {
        return;
    };
    let c = cfg(port, "two", Duration::from_secs(30), Takeover::Refuse);
    let dir = tempfile::tempdir().unwrap();
    let first = acquire_lease(dir.path(), &c, false)
        .unwrap()
        .expect("lease on for s3");
    let info = first.info();
    assert_eq!((info.state, info.epoch), (LeaseState::Held, 1));

    let other = tempfile::tempdir().unwrap();
    let e = acquire_lease(other.path(), &c, false)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains(&info.holder), "holder named: {e}");
    assert!(e.contains("epoch 1"), "{e}");
    assert!(e.contains("in 30 s") || e.contains("in 29 s"), "{e}");
    assert!(
        e.contains("--takeover=wait") && e.contains("--takeover=force"),
        "{e}"
    );
    assert!(!e.contains('\n'), "one line: {e}");
    no_secret("refusal", &e);

    first.release().unwrap();
    let second = acquire_lease(other.path(), &c, false).unwrap().unwrap();
    assert_eq!(second.info().epoch, 2);
    assert_ne!(second.info().holder, info.holder);
    second.release().unwrap();
}

#[test]
fn abandoned_lease_refuse_wait_force_and_the_old_holder_is_fenced() {
    let Some((_moto, port)) = start_moto() else {
        return;
    };
    // Leases long enough that no stall of a loaded machine lets one run out by itself.
    let c = cfg(port, "expiry", Duration::from_secs(30), Takeover::Refuse);
    let dir = tempfile::tempdir().unwrap();

    // Killed without releasing: the lease stays live until it expires.
    let dead_dir = tempfile::tempdir().unwrap();
    let dead = acquire_lease(dead_dir.path(), &c, false).unwrap().unwrap();
    drop(dead);
    let e = acquire_lease(dir.path(), &c, false)
        .err()
        .expect("refused while live");
    assert!(e.to_string().contains("epoch 1"), "{e}");
    // Its last renewal left it 2 s to live (written here, as that renewal would have).
    let ttl = Duration::from_secs(2);
    let remote = open_remote(&c.remote, &c).unwrap();
    let key = remote.lease_key();
    let mut rec: keel::persist::lease::LeaseRecord =
        serde_json::from_slice(&remote.remote.get(&key).unwrap()).unwrap();
    let t_dead = Instant::now();
    rec.expires_ns = keel::time::now_ns() + ttl.as_nanos() as i64;
    rec.ttl_ms = ttl.as_millis() as u64;
    remote
        .remote
        .put(
            &key,
            bytes::Bytes::from(serde_json::to_vec(&rec).unwrap()),
            keel::persist::remote::PutMode::Overwrite,
        )
        .unwrap();
    let waited = acquire_lease(
        dir.path(),
        &PersistConfig {
            takeover: Takeover::Wait,
            ..c.clone()
        },
        false,
    )
    .unwrap()
    .unwrap();
    // The expiry was set after `t_dead` (the slack is the wall clock's granularity).
    assert!(
        t_dead.elapsed() >= ttl - Duration::from_millis(20),
        "wait returned before the lease expired ({:?})",
        t_dead.elapsed()
    );
    assert_eq!(waited.info().epoch, 2);

    // The live holder checkpoints; a forced takeover fences it.
    let fs = open_fs(dir.path());
    write_file(&fs, "a.txt", b"first holder");
    let mut old = waited;
    old.start_renewal().unwrap();
    let repo = open_remote(&c.remote, &c).unwrap();
    let mut p = Persister::open(dir.path(), repo, params()).unwrap();
    p.set_lease(Some(old.handle()));
    let r = p.checkpoint(&CheckpointOptions::default()).unwrap();
    assert_eq!(head_seq(&c), Some((r.seq.unwrap(), 2)));

    let thief_dir = tempfile::tempdir().unwrap();
    let forced = acquire_lease(
        thief_dir.path(),
        &PersistConfig {
            takeover: Takeover::Force,
            ..c.clone()
        },
        false,
    )
    .unwrap()
    .unwrap();
    assert_eq!(forced.info().epoch, 3);
    write_file(&fs, "b.txt", b"written after the takeover");
    let e = p
        .checkpoint(&CheckpointOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("lease lost") && e.contains("epoch 3"), "{e}");
    assert_eq!(head_seq(&c), Some((r.seq.unwrap(), 2)), "head did not move");
    assert_eq!(old.info().state, LeaseState::Lost);
    // Refused from now on, without asking the remote again.
    let e = p.checkpoint(&CheckpointOptions::default()).unwrap_err();
    assert!(e.to_string().contains("lease lost"), "{e}");
    // The new holder's checkpoint builds on the head and carries its epoch.
    let dir2 = tempfile::tempdir().unwrap();
    let mut r2 = open_remote(&c.remote, &c).unwrap();
    restore::restore(&mut r2, None, dir2.path()).unwrap();
    let fs2 = open_fs(dir2.path());
    write_file(&fs2, "c.txt", b"new holder");
    // A clean close: dropping the filesystem alone would be a crash, losing the open
    // metadata group.
    fs2.shutdown().unwrap();
    drop(fs2);
    let mut p2 = Persister::open(dir2.path(), r2, params()).unwrap();
    p2.set_lease(Some(forced.handle()));
    let r = p2.checkpoint(&CheckpointOptions::default()).unwrap();
    assert_eq!(head_seq(&c), Some((r.seq.unwrap(), 3)));
    forced.release().unwrap();
    let theirs = r.seq.unwrap();

    // The old holder restarts on its own state dir (as `LEASE LOST` says to) and takes the
    // lease back: its first checkpoint keeps what the new holder wrote, named, and follows
    // it with a full snapshot; neither side's files are lost.
    drop(p);
    drop(old);
    let back = acquire_lease(dir.path(), &c, false).unwrap().unwrap();
    assert_eq!(back.info().epoch, 4);
    let repo = open_remote(&c.remote, &c).unwrap();
    let mut p3 = Persister::open(dir.path(), repo.clone(), params()).unwrap();
    p3.set_lease(Some(back.handle()));
    let r3 = p3.checkpoint(&CheckpointOptions::default()).unwrap();
    assert!(r3.full, "{r3}");
    let mine = r3.seq.unwrap();
    assert_eq!(head_seq(&c), Some((mine, 4)));
    assert_eq!(repo.read_header(mine).unwrap().prev, Some(theirs));
    let name = format!("diverged-{theirs}");
    assert_eq!(
        keel::persist::snapshots::resolve(&repo, &name).unwrap(),
        theirs
    );
    let names = |seq: u64| -> Vec<String> {
        let t = repo.load_tree(seq).unwrap().0;
        let mut v: Vec<String> = t
            .dirents
            .keys()
            .map(|(_, n)| String::from_utf8_lossy(n).into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(mine), ["a.txt", "b.txt"]);
    assert_eq!(names(theirs), ["a.txt", "c.txt"]);
    // A gc keeping one unnamed snapshot keeps the named one and what it builds on.
    let mut g = repo.clone();
    keel::persist::gc::gc(&mut g, Some(p3.store()), 1, Duration::ZERO).unwrap();
    assert_eq!(names(theirs), ["a.txt", "c.txt"]);
    back.release().unwrap();
}

fn service_cfg(state: &Path) -> WorkspaceConfig {
    WorkspaceConfig {
        state_dir: state.to_path_buf(),
        mount_point: state.join("mnt"),
        chunk_size: CHUNK,
        ..Default::default()
    }
}

#[test]
fn remote_cut_mid_checkpoint_is_retried_and_nothing_is_lost() {
    let Some((_moto, port)) = start_moto() else {
        return;
    };
    let proxy = Proxy::start(port);
    let c = PersistConfig {
        interval: Duration::from_secs(1),
        ..cfg(
            proxy.port(),
            "outage",
            Duration::from_secs(15),
            Takeover::Refuse,
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    build_rich_tree(&fs);
    mkdir(&fs, "big");
    for i in 0..24u64 {
        write_file(&fs, &format!("big/f{i}"), &noise(i, 1 << 20));
    }
    let lease = acquire_lease(dir.path(), &c, false).unwrap();
    let svc = Service::start(
        &service_cfg(dir.path()),
        &c,
        Box::new(|| Ok(())),
        lease,
        None,
    )
    .unwrap()
    .unwrap();
    // The first checkpoint starts at once (nothing was ever uploaded): cut it mid-upload.
    let t0 = Instant::now();
    while proxy.bytes_up() < 4 << 20 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "upload never started"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    proxy.cut();
    let mut errors = Vec::new();
    // Until keel has tried the cut remote (and been refused) a few times; nothing may be
    // checkpointed meanwhile. (A hang guard only.)
    let cut_at = Instant::now();
    while proxy.refused() < 3 {
        let st = svc.published_state();
        assert!(
            st.last_seq.is_none(),
            "checkpoint finished through a cut remote"
        );
        errors.extend(st.last_error);
        assert!(
            cut_at.elapsed() < Duration::from_secs(180),
            "keel did not try the remote while it was cut"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(svc.published_state().last_seq.is_none());
    proxy.restore();
    let t1 = Instant::now();
    let st = loop {
        let st = svc.published_state();
        errors.extend(st.last_error.clone());
        if st.last_seq.is_some() && st.backlog.files == 0 {
            break st;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(180),
            "never recovered: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(st.consecutive_failures, 0, "{st:?}");
    assert_eq!(st.last_error, None);
    assert_eq!(st.lease.as_ref().unwrap().state, LeaseState::Held, "{st:?}");
    for e in &errors {
        no_secret("checkpoint error", e);
    }
    no_secret("state", &format!("{st:?}"));
    println!(
        "outage: {} connections refused while cut, {} errors seen, recovered {:.1}s after restore",
        proxy.refused(),
        errors.len(),
        t1.elapsed().as_secs_f64()
    );
    let mut svc = svc;
    svc.finish().unwrap();
    svc.close(true);

    // Everything reached the remote: a fresh restore (straight to moto) is identical.
    let target = tempfile::tempdir().unwrap();
    let direct = cfg(port, "outage", Duration::ZERO, Takeover::Refuse);
    let mut repo = open_remote(&direct.remote, &direct).unwrap();
    restore::restore(&mut repo, None, target.path()).unwrap();
    assert_eq!(dump(&open_fs(target.path())), dump(&fs));
    // Released at close: the next writer gets it at once.
    let next = acquire_lease(dir.path(), &direct_with_lease(&direct), false)
        .unwrap()
        .unwrap();
    assert_eq!(next.info().epoch, 2);
}

/// Waits (a hang guard only) until `f` holds for the service's published state.
fn wait_state(
    svc: &Service,
    what: &str,
    f: impl Fn(&keel::persist::service::PersistState) -> bool,
) {
    let t0 = Instant::now();
    loop {
        let st = svc.published_state();
        if f(&st) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "{what}: never; {st:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_outage_longer_than_the_lease_pauses_checkpoints_until_the_remote_answers() {
    // Found by the kill-anywhere soak: a remote gone for a minute (longer than the lease's
    // ttl) left the lease lost for good, and no checkpoint ever went through again until
    // keel was restarted.
    let Some((_moto, port)) = start_moto() else {
        return;
    };
    let proxy = Proxy::start(port);
    let c = PersistConfig {
        interval: Duration::from_secs(1),
        ..cfg(
            proxy.port(),
            "lapse",
            Duration::from_secs(5),
            Takeover::Refuse,
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    write_file(&fs, "a", b"before");
    let lease = acquire_lease(dir.path(), &c, false).unwrap();
    let svc = Service::start(
        &service_cfg(dir.path()),
        &c,
        Box::new(|| Ok(())),
        lease,
        None,
    )
    .unwrap()
    .unwrap();
    svc.checkpoint_now().unwrap();
    let before = head_seq(&c).unwrap().0;
    proxy.cut();
    wait_state(&svc, "lapse", |st| {
        st.lease.as_ref().unwrap().state == LeaseState::Lost
    });
    write_file(&fs, "b", b"during the outage");
    let e = svc.checkpoint_now().unwrap_err().to_string();
    assert!(e.contains("lease lapsed"), "{e}");
    proxy.restore();
    // Taken back by the renewal thread, and the periodic checkpoint takes what changed.
    wait_state(&svc, "lease taken back", |st| {
        st.lease.as_ref().unwrap().state == LeaseState::Held
    });
    wait_state(&svc, "checkpoint after the outage", |st| {
        st.last_seq.is_some_and(|s| s > before) && st.backlog.files == 0
    });
    // A new epoch (2, or later if a loaded machine let it lapse again meanwhile).
    assert!(head_seq(&c).unwrap().1 >= 2, "written under a new epoch");
    let mut svc = svc;
    svc.finish().unwrap();
    svc.close(true);
    let target = tempfile::tempdir().unwrap();
    let mut repo = open_remote(&c.remote, &c).unwrap();
    restore::restore(&mut repo, None, target.path()).unwrap();
    assert_eq!(dump(&open_fs(target.path())), dump(&fs));
}

#[test]
fn a_start_while_the_remote_is_gone_runs_on_the_local_workspace_until_it_answers() {
    // keel killed during an outage and started again before the remote is back: it used to
    // exit ("read lease: ... connection refused"); a state dir that holds the workspace
    // starts with the lease pending and takes it once the remote answers.
    let Some((_moto, port)) = start_moto() else {
        return;
    };
    let proxy = Proxy::start(port);
    let c = PersistConfig {
        interval: Duration::from_secs(1),
        ..cfg(
            proxy.port(),
            "pending",
            Duration::from_secs(30),
            Takeover::Refuse,
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    write_file(&fs, "a", b"first");
    {
        // A first run that checkpoints and is killed (its lease left live: a dropped lease
        // stops renewing, as after a crash, and is not released).
        let lease = acquire_lease(dir.path(), &c, true).unwrap().unwrap();
        let mut p =
            Persister::open(dir.path(), open_remote(&c.remote, &c).unwrap(), params()).unwrap();
        p.set_lease(Some(lease.handle()));
        p.checkpoint(&CheckpointOptions::default()).unwrap();
    }
    let before = head_seq(&c).unwrap().0;
    proxy.cut();
    let t0 = Instant::now();
    let lease = keel::persist::acquire_lease_at_start(dir.path(), &c)
        .expect("a start with the remote gone")
        .unwrap();
    println!(
        "started with the lease pending after {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(lease.info().state, LeaseState::Lost);
    let svc = Service::start(
        &service_cfg(dir.path()),
        &c,
        Box::new(|| Ok(())),
        Some(lease),
        None,
    )
    .unwrap()
    .unwrap();
    write_file(&fs, "b", b"while the remote is gone");
    assert!(svc.checkpoint_now().is_err());
    // An empty state dir cannot start without the remote: it has nothing to serve.
    let fresh = tempfile::tempdir().unwrap();
    assert!(keel::persist::acquire_lease_at_start(fresh.path(), &c).is_err());
    proxy.restore();
    wait_state(&svc, "lease acquired", |st| {
        st.lease.as_ref().unwrap().state == LeaseState::Held
    });
    wait_state(&svc, "checkpoint once the remote answers", |st| {
        st.last_seq.is_some_and(|s| s > before) && st.backlog.files == 0
    });
    // Its own previous lease (still live when it started): taken back, a new epoch.
    assert_eq!(head_seq(&c).unwrap().1, 2);
    let mut svc = svc;
    svc.finish().unwrap();
    svc.close(true);
    let target = tempfile::tempdir().unwrap();
    let mut repo = open_remote(&c.remote, &c).unwrap();
    restore::restore(&mut repo, None, target.path()).unwrap();
    assert_eq!(dump(&open_fs(target.path())), dump(&fs));
}

fn direct_with_lease(c: &PersistConfig) -> PersistConfig {
    PersistConfig {
        lease_ttl: Duration::from_secs(30),
        ..c.clone()
    }
}

#[test]
fn errors_are_classified_and_never_carry_credentials() {
    let Some((_moto, port)) = start_moto() else {
        return;
    };
    // Nothing listening: temporary, retried until the deadline, then reported. The port is
    // bound and never listened on, so it stays ours and refuses every connection (a port
    // freed again could be taken by another test meanwhile).
    let (_refusing, closed) = support::sys::refusing_port().unwrap();
    let c = cfg(closed, "nowhere", Duration::from_secs(30), Takeover::Refuse);
    let repo = open_remote(&c.remote, &c).unwrap();
    let t0 = Instant::now();
    let e = {
        let _d = keel::persist::retry::deadline_scope(Some(t0 + Duration::from_secs(2)));
        repo.remote
            .put(
                "k",
                bytes::Bytes::from_static(b"x"),
                keel::persist::remote::PutMode::Overwrite,
            )
            .unwrap_err()
    };
    assert!(e.is_temporary(), "{e}");
    // A hang guard: the deadline is 2 s, the retries without it would go on much longer.
    assert!(t0.elapsed() < Duration::from_secs(60), "deadline ignored");
    no_secret("connection error", &e.to_string());
    no_secret("connection error (debug)", &format!("{e:?}"));
    let le = acquire_lease(Path::new("/nonexistent"), &c, false)
        .err()
        .unwrap();
    no_secret("lease error", &le.to_string());

    // A bucket that does not exist: permanent, not retried.
    let c = PersistConfig {
        remote: "s3://no-such-bucket/x".into(),
        ..cfg(port, "", Duration::from_secs(30), Takeover::Refuse)
    };
    let repo = open_remote(&c.remote, &c).unwrap();
    let e = repo
        .remote
        .put(
            "k",
            bytes::Bytes::from_static(b"x"),
            keel::persist::remote::PutMode::Overwrite,
        )
        .unwrap_err();
    assert!(!e.is_temporary(), "{e}");
    no_secret("missing bucket", &e.to_string());
}

#[test]
fn service_state_reports_failures_and_the_lost_lease() {
    let Some((_moto, port)) = start_moto() else {
        return;
    };
    let c = PersistConfig {
        interval: Duration::ZERO,
        // Long enough that no stall of a loaded machine loses it before the takeover.
        ..cfg(port, "svc", Duration::from_secs(15), Takeover::Refuse)
    };
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    write_file(&fs, "x", b"x");
    let lease = acquire_lease(dir.path(), &c, false).unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let svc = Service::start(
        &service_cfg(dir.path()),
        &c,
        Box::new(|| Ok(())),
        lease,
        None,
    )
    .unwrap()
    .unwrap();
    let s2 = seen.clone();
    svc.set_observer(Arc::new(move |st| s2.lock().unwrap().push(st.clone())));
    svc.checkpoint_now().unwrap();
    let held = svc.published_state();
    assert_eq!(held.lease.as_ref().unwrap().state, LeaseState::Held);
    assert!(held.last_seq.is_some());

    let thief_dir = tempfile::tempdir().unwrap();
    let _thief = acquire_lease(
        thief_dir.path(),
        &PersistConfig {
            takeover: Takeover::Force,
            ..c.clone()
        },
        false,
    )
    .unwrap()
    .unwrap();
    // The renewal (every ttl/3) notices by itself, without a checkpoint.
    let t0 = Instant::now();
    while svc.published_state().lease.unwrap().state != LeaseState::Lost {
        // A hang guard: the renewal runs every ttl/3 (5 s).
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "loss never noticed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let lost = svc.published_state().lease.unwrap();
    assert!(
        lost.error.as_deref().unwrap().contains("epoch 2"),
        "{lost:?}"
    );
    write_file(&fs, "y", b"y");
    let e = svc.checkpoint_now().unwrap_err().to_string();
    assert!(e.contains("lease lost"), "{e}");
    let st = svc.published_state();
    assert_eq!(st.consecutive_failures, 1);
    assert!(st.last_error.unwrap().contains("lease lost"));
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .any(|s| s.lease.as_ref().unwrap().state == LeaseState::Lost),
        "observer told"
    );
    let mut svc = svc;
    let fin = svc.finish().unwrap_err().to_string();
    assert!(fin.contains("lease lost"), "{fin}");
    svc.close(true);
}

/// The lease as `GET /status` on a running `keel mount`'s control socket shows it (up
/// shortly after the mount), in one line: `STATE by HOLDER epoch N`, and the whole answer
/// for `no_secret`.
fn persist_status(state: &Path) -> String {
    let sock = state.join(keel::state::CONTROL_SOCK);
    let t0 = Instant::now();
    loop {
        if let Ok(body) = keel::control::client::status(&sock) {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            let l = &v["persist"]["lease"];
            return format!(
                "lease: {} by {} epoch {}\n{body}",
                l["state"].as_str().unwrap_or("?"),
                l["holder"].as_str().unwrap_or("?"),
                l["epoch"]
            );
        }
        assert!(
            t0.elapsed() < support::mount::READY_TIMEOUT,
            "keel never answered on its control socket"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Through the real binary: a second `keel mount` on the same S3 prefix exits non-zero with
/// the holder named and nothing mounted; once the first stops (and releases) it mounts.
#[test]
fn keel_mount_twice_on_one_prefix() {
    use support::mount::{
        fuse_available, is_fuse_mount, lazy_unmount, spawn_mount, wait_timeout, MountOutcome,
    };

    if !fuse_available() {
        return;
    }
    let Some((_moto, port)) = start_moto() else {
        return;
    };
    creds();
    let tmp = tempfile::tempdir().unwrap();
    let conf = tmp.path().join("config.toml");
    std::fs::write(
        &conf,
        format!(
            "[persist]\nremote = \"s3://keel/bin\"\nendpoint = \"http://127.0.0.1:{port}\"\nregion = \"us-east-1\"\nallow_http = true\nlease_ttl = \"10s\"\n"
        ),
    )
    .unwrap();
    let args = vec!["--config".to_string(), conf.display().to_string()];
    let log = tmp.path().join("keel.log");
    let (s1, m1) = (tmp.path().join("s1"), tmp.path().join("m1"));
    let (s2, m2) = (tmp.path().join("s2"), tmp.path().join("m2"));
    let MountOutcome::Mounted(mut first) = spawn_mount(&s1, &m1, &args, &log) else {
        panic!(
            "first mount failed:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    };
    std::fs::write(m1.join("hello"), b"from the first writer").unwrap();
    let status = persist_status(&s1);
    assert!(
        status.contains("lease: held by holder") && status.contains("epoch 1"),
        "{status}"
    );
    no_secret("status", &status);

    match spawn_mount(&s2, &m2, &args, &log) {
        MountOutcome::Exited { status, stderr } => {
            assert!(!status.success(), "{status}");
            assert!(stderr.contains("in use by another writer"), "{stderr}");
            assert!(
                stderr.contains("epoch 1") && stderr.contains("--takeover"),
                "{stderr}"
            );
            no_secret("stderr", &stderr);
            assert!(!is_fuse_mount(&m2), "refused mount left something mounted");
        }
        MountOutcome::Mounted(mut c) => {
            let _ = c.kill();
            let _ = c.wait();
            lazy_unmount(&m2);
            lazy_unmount(&m1);
            panic!("second writer mounted");
        }
    }
    // An offline gc from another state dir is refused as well: its sweep could take chunks
    // the live writer is about to name again. Even where starts take leases over by force:
    // a gc never fences a live writer.
    let forcing = tmp.path().join("force.toml");
    std::fs::write(
        &forcing,
        format!(
            "{}takeover = \"force\"\n",
            std::fs::read_to_string(&conf).unwrap()
        ),
    )
    .unwrap();
    for c in [&conf, &forcing] {
        let out = std::process::Command::new(support::mount::keel_bin())
            .args(["gc", "--config"])
            .arg(c)
            .arg("--state")
            .arg(tmp.path().join("s3"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "offline gc ran beside a live writer: {stderr}"
        );
        assert!(
            stderr.starts_with("keel: gc: ") && stderr.contains("in use by another writer"),
            "{stderr}"
        );
        no_secret("gc stderr", &stderr);
    }
    let status = persist_status(&s1);
    assert!(status.contains("lease: held by holder"), "{status}");

    // SIGTERM: final checkpoint, release; the second writer gets the lease at once.
    support::sys::kill(first.id(), libc::SIGTERM);
    let st = wait_timeout(&mut first, Duration::from_secs(60));
    lazy_unmount(&m1);
    assert!(st.is_some_and(|s| s.success()), "first keel stop: {st:?}");
    let MountOutcome::Mounted(mut second) = spawn_mount(&s2, &m2, &args, &log) else {
        panic!(
            "second mount after release failed:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    };
    let status = persist_status(&s2);
    assert!(
        status.contains("lease: held") && status.contains("epoch 2"),
        "{status}"
    );
    // Its empty state dir was restored from the remote before mounting.
    assert_eq!(
        std::fs::read(m2.join("hello")).unwrap(),
        b"from the first writer"
    );

    // Killed: the lease stays live. Another state dir is still refused, but a keel restarted
    // on the same state dir takes its own lease back at once (no takeover, no waiting).
    support::sys::kill(second.id(), libc::SIGKILL);
    let _ = wait_timeout(&mut second, Duration::from_secs(30));
    lazy_unmount(&m2);
    let (s3, m3) = (tmp.path().join("s3"), tmp.path().join("m3"));
    match spawn_mount(&s3, &m3, &args, &log) {
        MountOutcome::Exited { status, stderr } => {
            assert!(!status.success(), "{status}");
            assert!(stderr.contains("epoch 2"), "{stderr}");
        }
        MountOutcome::Mounted(mut c) => {
            let _ = c.kill();
            let _ = c.wait();
            lazy_unmount(&m3);
            panic!("a third state dir mounted while the killed keel's lease was live");
        }
    }
    let MountOutcome::Mounted(mut second) = spawn_mount(&s2, &m2, &args, &log) else {
        panic!(
            "restart on the killed keel's state dir failed:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    };
    let status = persist_status(&s2);
    assert!(
        status.contains("lease: held") && status.contains("epoch 3"),
        "{status}"
    );
    support::sys::kill(second.id(), libc::SIGTERM);
    let st = wait_timeout(&mut second, Duration::from_secs(60));
    lazy_unmount(&m2);
    assert!(st.is_some_and(|s| s.success()), "second keel stop: {st:?}");
}

/// A new host (an empty state dir) started while the remote does not answer waits for it
/// (`[persist] start_wait`), saying what it waits for, and comes up with the workspace once
/// the remote answers. Where every start is a new host (Cloudflare-style platforms), a
/// remote blip at start was a failed start: one round of retries (at most ~23 s of backoff,
/// connections refused at once), then exit 1. The remote here is gone for 25 s.
#[test]
fn a_new_host_waits_for_a_remote_that_does_not_answer_yet() {
    use support::mount::{
        fuse_available, is_fuse_mount, lazy_unmount, spawn_mount, wait_timeout, MountOutcome,
    };
    if !fuse_available() {
        return;
    }
    let Some((_moto, port)) = start_moto() else {
        return;
    };
    let proxy = Arc::new(Proxy::start(port));
    // The workspace a host before this one left on the remote (no lease left behind).
    let c = cfg(proxy.port(), "newhost", Duration::ZERO, Takeover::Refuse);
    let old = tempfile::tempdir().unwrap();
    let fs = open_fs(old.path());
    write_file(&fs, "a", b"kept by the host before");
    Persister::open(old.path(), open_remote(&c.remote, &c).unwrap(), params())
        .unwrap()
        .checkpoint(&CheckpointOptions::default())
        .unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let conf = tmp.path().join("config.toml");
    std::fs::write(
        &conf,
        format!(
            "[persist]\nremote = \"s3://keel/newhost\"\nendpoint = \"http://127.0.0.1:{}\"\nregion = \"us-east-1\"\nallow_http = true\nstart_wait = \"100s\"\n",
            proxy.port()
        ),
    )
    .unwrap();
    let args = vec!["--config".to_string(), conf.display().to_string()];
    let (state, mnt, log) = (
        tmp.path().join("state"),
        tmp.path().join("mnt"),
        tmp.path().join("keel.log"),
    );
    proxy.cut();
    let back = {
        let proxy = proxy.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(25));
            proxy.restore();
        })
    };
    let t0 = Instant::now();
    let outcome = spawn_mount(&state, &mnt, &args, &log);
    back.join().unwrap();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let MountOutcome::Mounted(mut keel) = outcome else {
        panic!("the new host gave up on the remote:\n{text}");
    };
    println!("mounted {:.1}s after the start", t0.elapsed().as_secs_f64());
    assert_eq!(
        std::fs::read(mnt.join("a")).unwrap(),
        b"kept by the host before"
    );
    assert!(
        text.contains("the remote does not answer")
            && text.contains("a new host has no workspace without it")
            && text.contains("start_wait = 100s"),
        "{text}"
    );
    assert!(proxy.refused() > 0);
    no_secret("log", &text);
    support::sys::kill(keel.id(), libc::SIGTERM);
    // A hang guard only (a loaded machine's moto can be slow to take the final checkpoint).
    let st = wait_timeout(&mut keel, Duration::from_secs(180));
    lazy_unmount(&mnt);
    assert!(
        st.is_some_and(|s| s.success()),
        "stop: {st:?}\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert!(!is_fuse_mount(&mnt));
}
