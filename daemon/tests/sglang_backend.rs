//! The kvd SGLang HiCache backend (python/pysrc/kvd/sglang_backend.py), built by SGLang
//! 0.5.23's own `StorageBackendFactory` over SGLang's real MHA and MLA host pools on CPU, against a
//! real daemon: python/tests/test_sglang.py moves pages with SGLang's own controller code
//! (zero-copy v1 and the plain variants) in every host layout, checks pages are stored in
//! one canonical block (one layout reads another's), keys are namespaced by layout, MLA
//! pages kept once per node (rank 0 stores, every rank reads), hybrid models' Mamba and
//! SWA pools through SGLang's v2 interface with its hit policies, and the refusals. The test command installs SGLang into `.venv`; without it this fails and
//! says how to get it.

mod common;

#[test]
fn the_sglang_backend_from_sglangs_own_factory() {
    let d = common::Daemon::start(&[]);
    common::python_checks(
        "test_sglang.py",
        "kvd, sglang.srt.mem_cache.storage.backend_factory",
        "run ./scripts/test.sh, which installs sglang 0.5.23 and builds kvd with `maturin develop`",
        &[d.endpoint.clone(), common::kvd_bin().display().to_string()],
    );
    let st = kvd_client::Client::connect(&d.endpoint)
        .and_then(|c| c.stats())
        .expect("daemon still serving");
    assert_eq!(st.pinned_blocks, 0, "pins left behind: {st:?}");
}
