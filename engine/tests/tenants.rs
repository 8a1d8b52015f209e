//! Tenants (SPEC §18) through the reference engine and the router, real processes on
//! loopback: a request's `x-kvd-tenant` header picks the session its KV is found, stored
//! and handed off in, so one tenant's prompt is never another's hit; the router passes the
//! header to both legs and asks the workers' lookups in the tenant's name.

mod common;

use std::path::PathBuf;

use common::*;
use kvd_engine::local;
use serde_json::{json, Value};

/// The engines' credential: it acts for both tenants.
const ENGINE: &str = "engine-token-0123456789abcdef";

/// A tenants file (two tenants, the engines' token acting for both) in a directory of
/// its own under the target's scratch space.
fn tenants_file() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "tenants-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tenants.toml");
    std::fs::write(
        &path,
        format!(
            "[[tenant]]\nname = \"quiet\"\ntokens = [\"{ENGINE}\"]\n\
             [[tenant]]\nname = \"noisy\"\ntokens = [\"{ENGINE}\"]\n"
        ),
    )
    .unwrap();
    path
}

fn node_with(file: &std::path::Path) -> Node {
    Node::start_with(
        &bins(),
        "128MiB",
        &["--tenants-file", file.to_str().unwrap()],
    )
    .expect("kvd with tenants")
}

/// An engine acting for "quiet" (its own) and serving "noisy" too.
fn engine_of_two(role: &str, node: &Node) -> (Proc, String) {
    local::engine_env(
        &bins(),
        role,
        Some(node),
        &["--kvd-tenant", "noisy"],
        &[("KVD_TENANT_TOKEN", ENGINE), ("KVD_TENANT", "quiet")],
    )
    .expect("kvd-engine")
}

fn body(prompt: &str) -> Value {
    json!({"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "seed": 0})
}

fn as_tenant(url: &str, prompt: &str, tenant: Option<&str>) -> Value {
    let (s, v) = local::complete_as(url, &body(prompt), tenant).expect("request");
    assert_eq!(s, 200, "{v}");
    v
}

fn cached(url: &str, prompt: &str, tenant: Option<&str>) -> u64 {
    let (s, v) = local::lookup_as(url, prompt, tenant).expect("lookup");
    assert_eq!(s, 200, "{v}");
    v["cached_tokens"].as_u64().unwrap()
}

#[test]
fn a_requests_tenant_header_picks_the_namespace_its_kv_lives_in() {
    let file = tenants_file();
    let a = node_with(&file);
    let (_e, url) = engine_of_two("both", &a);
    let prompt =
        "a prompt of several blocks that one tenant's request computes first and only it may find";
    let first = as_tenant(&url, prompt, Some("noisy"));
    assert_eq!(first["kvd"]["source"], "none", "{first}");
    // found again in its own namespace, with the same tokens
    let again = as_tenant(&url, prompt, Some("noisy"));
    assert_eq!(again["kvd"]["source"], "local", "{again}");
    assert!(
        again["kvd"]["cached_tokens"].as_u64().unwrap() >= 16,
        "{again}"
    );
    assert_eq!(tokens(&again), tokens(&first));
    assert!(cached(&url, prompt, Some("noisy")) >= 16);
    // the engine's own tenant (named, or by no header) finds nothing of it
    assert_eq!(cached(&url, prompt, Some("quiet")), 0);
    assert_eq!(cached(&url, prompt, None), 0);
    let quiet = as_tenant(&url, prompt, Some("quiet"));
    assert_eq!(
        quiet["kvd"]["source"], "none",
        "another tenant's prompt: {quiet}"
    );
    assert_eq!(tokens(&quiet), tokens(&first));
    // ... until it stored the prompt itself: no header is the engine's own tenant
    let own = as_tenant(&url, prompt, None);
    assert_eq!(own["kvd"]["source"], "local", "{own}");
    // a tenant the engine does not serve is refused, never served as another's
    let (s, v) = local::complete_as(&url, &body(prompt), Some("nobody")).unwrap();
    assert_eq!(s, 400, "{v}");
    assert!(v.to_string().contains("serves no tenant"), "{v}");
    assert_eq!(cached(&url, prompt, Some("nobody")), 0);
    // an engine that serves one tenant refuses another's header
    let (_one, one) = local::engine_env(
        &bins(),
        "both",
        Some(&a),
        &[],
        &[("KVD_TENANT_TOKEN", ENGINE), ("KVD_TENANT", "quiet")],
    )
    .unwrap();
    let (s, v) = local::complete_as(&one, &body(prompt), Some("noisy")).unwrap();
    assert_eq!(s, 400, "{v}");
    let _ = std::fs::remove_dir_all(file.parent().unwrap());
}

/// Through the router: the header reaches the workers' lookups (the prefill worker that
/// holds the tenant's prefix is chosen) and both legs (the handoff runs in the tenant's
/// namespace on both nodes).
#[test]
fn the_router_passes_the_tenant_to_the_lookups_and_both_legs() {
    let file = tenants_file();
    let (a, b, c) = (node_with(&file), node_with(&file), node_with(&file));
    let (_p1, p1) = engine_of_two("prefill", &a);
    let (_p2, p2) = engine_of_two("prefill", &b);
    let (_d, decode) = engine_of_two("decode", &c);
    let prompt =
        "a prompt whose blocks only the second prefill worker holds, in one tenant's namespace";
    // warm the second worker's node for "noisy"
    as_tenant(&p2, prompt, Some("noisy"));
    assert_eq!(cached(&p2, prompt, Some("quiet")), 0);
    let (_r, url) = router(&[&p1, &p2], &[&decode], "pull");
    for _ in 0..2 {
        let got = as_tenant(&url, prompt, Some("noisy"));
        assert_eq!(
            got["prefill_kvd"]["source"], "local",
            "the router asked the lookups in the tenant's name: {got}"
        );
        assert!(
            got["kvd"]["cached_tokens"].as_u64().unwrap() >= 16,
            "the decode leg loaded the handoff in the tenant's namespace: {got}"
        );
    }
    // the pulled blocks are the tenant's on the decode node
    assert!(cached(&decode, prompt, Some("noisy")) >= 16);
    assert_eq!(cached(&decode, prompt, Some("quiet")), 0);
}

/// The router's KV-event index (SPEC §14): a daemon with tenants publishes each tenant's
/// blocks under its namespaced layout, and the router looks a request's prompt up under
/// its tenant's; it asks no worker.
#[test]
fn the_routers_event_index_finds_a_tenants_prefix_under_its_namespace() {
    let file = tenants_file();
    let events_node = || events_node(&["--tenants-file", file.to_str().unwrap()]);
    let ((a, a_ev), (b, b_ev), c) = (events_node(), events_node(), node_with(&file));
    let (_p1, p1) = engine_of_two("prefill", &a);
    let (_p2, p2) = engine_of_two("prefill", &b);
    let (_d, decode) = engine_of_two("decode", &c);
    let prompt = "a prompt one tenant stored on the second worker's node, as its events say";
    as_tenant(&p2, prompt, Some("noisy"));
    let (_router, url) = local::router_with(
        &bins(),
        &[&p1, &p2],
        &[&decode],
        "pull",
        &["--kv-events".into(), a_ev, b_ev],
    )
    .expect("kvd-router");
    wait_indexed(&url);
    let got = as_tenant(&url, prompt, Some("noisy"));
    assert_eq!(got["prefill_kvd"]["source"], "local", "{got}");
    // another tenant's request finds none of it in the index: the first worker (no
    // prefix anywhere, equal load) computes it
    let other = as_tenant(&url, prompt, Some("quiet"));
    assert_eq!(other["prefill_kvd"]["source"], "none", "{other}");
    let st = router_stats(&url);
    assert_eq!(st["by_lookup"], 0, "no worker was asked: {st}");
    assert_eq!(st["by_events"], 2, "{st}");
}
