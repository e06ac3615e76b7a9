//! The steps of `Supervisor::new`: one unit per `[[service]]` (user, environment, working
//! directory, restart policy), their dependencies and start order, the main command last,
//! then the supervisor over them. They share a `Plan`; nothing is started here.

use std::ffi::OsString;
use std::time::Instant;

use super::{
    base_env, caps_to_drop, pass_env, set_env, user_env, Supervisor, SupervisorError, Unit,
};
use crate::boot::Booted;
use crate::config::{signal_name, Config, ServiceConfig};
use crate::sys::process::{self, Ids, Session, SpawnSpec, Stdio};
use crate::sys::signal::Signals;

/// What the steps of `Supervisor::new` share: the config, how keel was started, and the
/// units planned so far.
pub(super) struct Plan<'a> {
    cfg: &'a Config,
    booted: &'a Booted,
    drop_caps: Vec<u32>,
    /// `[sandbox] seccomp`, compiled once for every child.
    seccomp: Option<std::sync::Arc<crate::sys::seccomp::Filter>>,
    now: Instant,
    units: Vec<Unit>,
    /// Start order: services by dependencies, then main.
    order: Vec<usize>,
    main: Option<usize>,
}

impl<'a> Plan<'a> {
    pub(super) fn new(cfg: &'a Config, booted: &'a Booted) -> Self {
        Plan {
            cfg,
            booted,
            drop_caps: caps_to_drop(&cfg.init.drop_capabilities),
            seccomp: seccomp_filter(cfg),
            now: Instant::now(),
            units: Vec::new(),
            order: Vec::new(),
            main: None,
        }
    }

    /// Step 1: one unit per `[[service]]`, each depending on the services it names, in
    /// dependency order.
    pub(super) fn add_services(&mut self) -> Result<(), SupervisorError> {
        let cfg = self.cfg;
        for s in &cfg.service {
            let unit = self.service_unit(s)?;
            self.units.push(unit);
        }
        for (i, s) in cfg.service.iter().enumerate() {
            self.units[i].deps = s
                .depends_on
                .iter()
                .filter_map(|d| cfg.service.iter().position(|t| &t.name == d))
                .collect();
        }
        self.order = crate::config::service::order(&cfg.service).unwrap_or_default();
        Ok(())
    }

    /// A service's unit: its user, environment (keel's, `[init] env`, the user's, its own,
    /// then the secrets it passes) and working directory, which must exist.
    fn service_unit(&self, s: &ServiceConfig) -> Result<Unit, SupervisorError> {
        let label = format!("service {}", s.name);
        let ids = resolve_user(&label, s.user.as_deref(), s.group.as_deref())?;
        let mut env = base_env(self.cfg);
        if let Some(ids) = &ids {
            user_env(&mut env, ids, &s.env);
        }
        for (k, v) in &s.env {
            set_env(&mut env, k, v);
        }
        pass_env(&mut env, &s.pass_env);
        let cwd = s
            .workdir
            .clone()
            .unwrap_or_else(|| self.booted.caller_cwd.clone());
        if !cwd.is_dir() {
            return Err(SupervisorError::Workdir {
                unit: label,
                path: cwd,
            });
        }
        let spec = SpawnSpec {
            argv: s.command.argv().into_iter().map(OsString::from).collect(),
            env,
            cwd,
            ids,
            session: Session::New,
            drop_caps: self.drop_caps.clone(),
            no_new_privs: s.no_new_privs,
            stdio: Stdio::Null,
            mnt_ns: None,
            cgroup: None,
            seccomp: self.seccomp.clone(),
            inherit_fds: false,
        };
        let stop_signal = signal_name(&s.stop_signal).unwrap_or(libc::SIGTERM);
        Ok(Unit {
            restart: s.restart,
            restart_delay: s.restart_delay,
            restart_max_delay: s.restart_max_delay,
            restart_reset: s.restart_reset,
            max_restarts: s.max_restarts,
            readiness: s.ready.clone(),
            delay: s.restart_delay,
            ..Unit::idle(s.name.clone(), spec, false, stop_signal, self.now)
        })
    }

    /// What the main command runs with (its user, environment, capabilities, directory,
    /// terminal), for `argv`; processes started through the API start from the same spec.
    fn main_spec(&self, argv: Vec<OsString>) -> Result<SpawnSpec, SupervisorError> {
        let cfg = self.cfg;
        let ids = resolve_user(
            "main command",
            cfg.init.user.as_deref(),
            cfg.init.group.as_deref(),
        )?;
        let mut env = base_env(cfg);
        if let Some(ids) = &ids {
            user_env(&mut env, ids, &cfg.init.env);
        }
        pass_env(&mut env, &cfg.init.pass_env);
        Ok(SpawnSpec {
            argv,
            env,
            cwd: self.booted.caller_cwd.clone(),
            ids,
            session: if self.booted.tty {
                Session::ForegroundGroup
            } else {
                Session::New
            },
            drop_caps: self.drop_caps.clone(),
            no_new_privs: cfg.init.no_new_privs,
            stdio: Stdio::Inherit,
            mnt_ns: None,
            cgroup: None,
            seccomp: self.seccomp.clone(),
            inherit_fds: true,
        })
    }

    /// Step 2: the main command (when there is one), last in the start order, after every
    /// service; it owns the terminal when keel has one, and never restarts.
    pub(super) fn add_main(&mut self, argv: Vec<OsString>) -> Result<(), SupervisorError> {
        if argv.is_empty() {
            return Ok(());
        }
        let cfg = self.cfg;
        let spec = self.main_spec(argv)?;
        let n = self.units.len();
        let stop_signal = signal_name(&cfg.shutdown.signal).unwrap_or(libc::SIGTERM);
        self.units.push(Unit {
            deps: (0..n).collect(),
            ..Unit::idle("main".into(), spec, true, stop_signal, self.now)
        });
        self.order.push(n);
        self.main = Some(n);
        Ok(())
    }

    /// What processes started through the API start from: the main command's spec
    /// (whether or not there is a main command) in a session of their own, in the workspace
    /// (else the main command's directory).
    pub(super) fn exec_template(&self) -> Result<crate::exec::Template, SupervisorError> {
        let mut spec = self.main_spec(Vec::new())?;
        spec.session = Session::New;
        spec.stdio = Stdio::Null;
        // keel's own inheritance (a jobserver's pipe) is the main command's, not theirs.
        spec.inherit_fds = false;
        let cwd = spec.cwd.clone();
        let workspace = self
            .cfg
            .init
            .workspace
            .then(|| self.cfg.workspace.mount_point.clone());
        let user = match &spec.ids {
            Some(i) => i.name.clone(),
            None => nix::unistd::User::from_uid(nix::unistd::geteuid())
                .ok()
                .flatten()
                .map(|u| u.name)
                .unwrap_or_else(|| nix::unistd::geteuid().to_string()),
        };
        Ok(crate::exec::Template {
            spec,
            user,
            cwd,
            workspace,
            grace: self.cfg.shutdown.grace,
            ns: None,
        })
    }

    /// Step 3: the supervisor over the planned units, with `[shutdown]`'s signals and grace.
    pub(super) fn into_supervisor(
        self,
        signals: Signals,
        exec: Option<crate::exec::Template>,
    ) -> Supervisor {
        let cfg = self.cfg;
        Supervisor {
            units: self.units,
            order: self.order,
            main: self.main,
            signals,
            forward_to: cfg.init.forward_to,
            stop_on: cfg
                .shutdown
                .on
                .iter()
                .filter_map(|s| signal_name(s))
                .collect(),
            main_stop_signal: signal_name(&cfg.shutdown.signal).unwrap_or(libc::SIGTERM),
            grace: cfg.shutdown.grace,
            pid1: self.booted.pid1,
            stop: None,
            stop_signals_seen: 0,
            code: None,
            status: None,
            sandbox_ns: None,
            hold: super::MainHold::new(self.cfg.shutdown.grace),
            exec: None,
            exec_template: exec,
        }
    }
}

/// The uid, gid and groups of `user` (and `group`); `None` runs as keel's own user.
fn resolve_user(
    label: &str,
    user: Option<&str>,
    group: Option<&str>,
) -> Result<Option<Ids>, SupervisorError> {
    let Some(u) = user else {
        return Ok(None);
    };
    process::resolve_ids(u, group)
        .map(Some)
        .map_err(|source| SupervisorError::User {
            unit: label.to_string(),
            source,
        })
}

/// The filter of `[sandbox] seccomp` (None when off, or when it cannot be made here: then
/// keel says so and children start without it).
fn seccomp_filter(cfg: &Config) -> Option<std::sync::Arc<crate::sys::seccomp::Filter>> {
    let allow = cfg.sandbox.seccomp.allowed()?;
    match crate::sys::seccomp::Filter::compile(allow) {
        Ok(f) => f.map(std::sync::Arc::new),
        Err(e) => {
            tracing::warn!(error = %e, "no seccomp filter: processes keel starts may make user namespaces and mounts");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Restart;
    use std::path::Path;
    use std::time::Duration;

    fn config(text: &str) -> Config {
        Config::parse(text, Path::new("test.toml")).unwrap()
    }

    fn booted(tty: bool) -> Booted {
        Booted {
            pid1: false,
            caller_cwd: std::env::temp_dir(),
            tty,
        }
    }

    fn env_of<'u>(u: &'u Unit, k: &str) -> Option<&'u str> {
        u.spec
            .env
            .iter()
            .rev()
            .find(|(ek, _)| ek == k)
            .and_then(|(_, v)| v.to_str())
    }

    const SERVICES: &str = r#"
        [init]
        env = { SHARED = "init", ONLY_INIT = "1" }
        [[service]]
        name = "web"
        command = ["web"]
        depends_on = ["db"]
        env = { SHARED = "web" }
        restart = "always"
        restart_delay = "2s"
        stop_signal = "SIGINT"
        [[service]]
        name = "db"
        command = "db --flag"
    "#;

    #[test]
    fn a_service_gets_its_own_settings_over_inits_and_starts_idle() {
        let (cfg, b) = (config(SERVICES), booted(false));
        let plan = Plan::new(&cfg, &b);
        let web = plan.service_unit(&cfg.service[0]).unwrap();
        assert_eq!(web.name, "web");
        assert!(!web.is_main);
        assert_eq!(web.spec.argv, vec![OsString::from("web")]);
        assert_eq!(env_of(&web, "SHARED"), Some("web"));
        assert_eq!(env_of(&web, "ONLY_INIT"), Some("1"));
        assert_eq!(web.spec.cwd, b.caller_cwd);
        assert_eq!(web.spec.stdio, Stdio::Null);
        assert!(
            !web.spec.inherit_fds,
            "keel's inherited fds are the main command's"
        );
        assert!(matches!(web.spec.session, Session::New));
        assert_eq!(web.restart, Restart::Always);
        assert_eq!(web.restart_delay, Duration::from_secs(2));
        assert_eq!(web.delay, Duration::from_secs(2));
        assert_eq!(web.stop_signal, libc::SIGINT);
        assert!(web.pid.is_none() && !web.started_once && !web.finished);
        assert_eq!((web.restarts, web.restarts_total), (0, 0));
        let db = plan.service_unit(&cfg.service[1]).unwrap();
        assert_eq!(db.stop_signal, libc::SIGTERM);
        assert_eq!(db.spec.argv.len(), 3, "a string command runs under sh -c");
    }

    #[test]
    fn a_service_whose_workdir_is_missing_is_refused() {
        let cfg = config(
            r#"
            [[service]]
            name = "w"
            command = ["true"]
            workdir = "/nonexistent/keel-test-dir"
            "#,
        );
        let b = booted(false);
        let err = Plan::new(&cfg, &b)
            .service_unit(&cfg.service[0])
            .unwrap_err();
        assert!(
            matches!(&err, SupervisorError::Workdir { unit, .. } if unit == "service w"),
            "{err}"
        );
    }

    #[test]
    fn an_unknown_user_is_refused_naming_the_unit() {
        let err = resolve_user("service x", Some("no-such-user-keel-test"), None).unwrap_err();
        assert!(
            matches!(&err, SupervisorError::User { unit, .. } if unit == "service x"),
            "{err}"
        );
        assert!(resolve_user("main command", None, None).unwrap().is_none());
    }

    #[test]
    fn services_depend_on_what_they_name_and_start_in_that_order() {
        let (cfg, b) = (config(SERVICES), booted(false));
        let mut plan = Plan::new(&cfg, &b);
        plan.add_services().unwrap();
        assert_eq!(plan.units.len(), 2);
        assert_eq!(plan.units[0].deps, vec![1], "web depends on db");
        assert!(plan.units[1].deps.is_empty());
        assert_eq!(plan.order, vec![1, 0], "db starts before web");
        assert_eq!(plan.main, None);
    }

    #[test]
    fn main_comes_last_after_every_service_and_never_restarts() {
        let (cfg, b) = (config(SERVICES), booted(true));
        let mut plan = Plan::new(&cfg, &b);
        plan.add_services().unwrap();
        plan.add_main(vec!["sh".into(), "-c".into(), "true".into()])
            .unwrap();
        assert_eq!(plan.main, Some(2));
        assert_eq!(plan.order, vec![1, 0, 2]);
        let main = &plan.units[2];
        assert!(main.is_main);
        assert_eq!(main.name, "main");
        assert_eq!(main.deps, vec![0, 1]);
        assert_eq!(main.restart, Restart::Never);
        assert_eq!(main.spec.stdio, Stdio::Inherit);
        assert!(
            main.spec.inherit_fds,
            "a jobserver's pipe reaches the main command"
        );
        assert!(
            !plan.exec_template().unwrap().spec.inherit_fds,
            "nor a process started through the API"
        );
        assert!(matches!(main.spec.session, Session::ForegroundGroup));
        assert_eq!(env_of(main, "SHARED"), Some("init"));
        assert_eq!(main.stop_signal, libc::SIGTERM);
    }

    #[test]
    fn no_main_command_adds_no_unit() {
        let (cfg, b) = (config(SERVICES), booted(false));
        let mut plan = Plan::new(&cfg, &b);
        plan.add_main(Vec::new()).unwrap();
        assert!(plan.units.is_empty() && plan.order.is_empty() && plan.main.is_none());
    }
}
