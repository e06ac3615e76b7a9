//! Every TOML file the repository ships in `config/` (the image copies them to /etc/keel/)
//! parses and validates with the current keel: a profile that names a key keel does not know
//! would stop the container at start.

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
    let errors: Vec<String> = files
        .iter()
        .filter_map(|p| keel::config::Config::load(p).err().map(|e| e.to_string()))
        .collect();
    assert!(
        errors.is_empty(),
        "config files that keel rejects:\n{}",
        errors.join("\n")
    );
}
