//! Every TOML file the repository ships in `config/` (the image copies them to /etc/keel/)
//! parses and validates with the current keel: a profile that names a key keel does not know
//! would stop the container at start. A profile's `${VAR}`s get the values its platform sets
//! (the Cloudflare Worker sets the instance's id and the R2 endpoint); without them it must
//! stop with the one line that names the key and the variable.

use std::path::Path;

#[test]
fn every_shipped_config_file_loads() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    let names: Vec<_> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in ["config.toml", "docker.toml", "cloudflare.toml", "ci.toml"] {
        assert!(
            names.iter().any(|n| n == want),
            "config/{want} is missing (have {names:?})"
        );
    }
    // What deploy/cloudflare's Worker passes to the container.
    let platform = |name: &str| match name {
        "KEEL_WORKSPACE_ID" => Some("ws-42".to_string()),
        "R2_ENDPOINT" => Some("https://acct.r2.cloudflarestorage.com".to_string()),
        _ => None,
    };
    let errors: Vec<String> = files
        .iter()
        .filter_map(|p| {
            let text = std::fs::read_to_string(p).unwrap();
            keel::config::Config::parse_with_env(&text, p, &platform)
                .err()
                .map(|e| e.to_string())
        })
        .collect();
    assert!(
        errors.is_empty(),
        "config files that keel rejects:\n{}",
        errors.join("\n")
    );
}

#[test]
fn the_cloudflare_profile_needs_the_instance_id() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/cloudflare.toml");
    let text = std::fs::read_to_string(&p).unwrap();
    let e = keel::config::Config::parse_with_env(&text, &p, &|_| None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("persist.remote") && e.contains("${KEEL_WORKSPACE_ID} is not set"),
        "{e}"
    );
    let c = keel::config::Config::parse_with_env(&text, &p, &|n| {
        (n == "KEEL_WORKSPACE_ID" || n == "R2_ENDPOINT").then(|| "https://x.example/ws-7".into())
    })
    .unwrap();
    assert!(
        c.persist.remote.ends_with("/https://x.example/ws-7") || c.persist.remote.contains("ws-7")
    );
}
