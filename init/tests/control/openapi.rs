//! `docs/openapi.json` describes the whole control API: every route of the route table
//! (`control::routes::ROUTES`) and `/health`, no operation that is not one, and for each the
//! rights the table asks for (`x-keel-rights`: public, observe, all).

use std::collections::BTreeMap;

use keel::control::api::Rights;
use keel::control::routes::ROUTES;

#[test]
fn the_openapi_description_matches_the_route_table() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/openapi.json");
    let text = std::fs::read_to_string(path).expect("docs/openapi.json");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("docs/openapi.json is JSON");
    assert_eq!(doc["openapi"].as_str().map(|v| &v[..2]), Some("3."));
    let mut described = BTreeMap::new();
    for (p, item) in doc["paths"].as_object().expect("paths") {
        for (m, op) in item.as_object().expect("a path item") {
            let rights = op["x-keel-rights"]
                .as_str()
                .unwrap_or_else(|| panic!("{m} {p}: no x-keel-rights"));
            assert!(op["responses"].is_object(), "{m} {p}: no responses");
            described.insert((m.to_uppercase(), p.clone()), rights.to_string());
        }
    }
    let mut routes = BTreeMap::new();
    routes.insert(
        ("GET".to_string(), "/health".to_string()),
        "public".to_string(),
    );
    for r in ROUTES {
        let rights = match r.rights {
            Rights::Observe => "observe",
            Rights::All => "all",
        };
        routes.insert(
            (r.method.to_string(), r.path.to_string()),
            rights.to_string(),
        );
    }
    let missing: Vec<_> = routes
        .keys()
        .filter(|k| !described.contains_key(k))
        .collect();
    let extra: Vec<_> = described
        .keys()
        .filter(|k| !routes.contains_key(k))
        .collect();
    assert!(
        missing.is_empty(),
        "routes not in docs/openapi.json: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "operations in docs/openapi.json that are no route: {extra:?}"
    );
    for (k, want) in &routes {
        assert_eq!(&described[k], want, "{} {}: rights", k.0, k.1);
    }
}
