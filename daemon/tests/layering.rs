//! The layers inside a crate hold as the crates between them do (Cargo refuses an arrow
//! that points up between crates; inside one, this test does): in `kvd-store` the base
//! (pool, region, slab, lease, deadlines, hand-offs, the KV-event log, checksums,
//! processes) reaches nothing above it and the block table reaches only the base; in
//! `kvd-transfer` the data plane (transports, grants, the connection gate, remote
//! access, RDMA, the cluster secret) knows no transfer record or flow. Each file's `use`
//! paths (and any other `crate::` / `super::` path outside comments) are resolved to the
//! top-level module they reach and held against what its layer may reach.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// A layer: the files in it (paths under the crate's `src/`, a trailing `/` for a
/// folder) and the top-level modules its code may reach.
struct Layer {
    name: &'static str,
    files: &'static [&'static str],
    may_reach: &'static [&'static str],
}

const STORE_BASE: &[&str] = &[
    "region",
    "pool",
    "alloc",
    "deadline",
    "lease",
    "sync",
    "completions",
    "events",
    "checksum",
    "process",
];

const STORE: &[Layer] = &[
    Layer {
        name: "kvd-store base",
        files: &[
            "region.rs",
            "pool.rs",
            "alloc.rs",
            "deadline.rs",
            "lease.rs",
            "sync.rs",
            "completions.rs",
            "events.rs",
            "checksum.rs",
            "process.rs",
        ],
        may_reach: STORE_BASE,
    },
    Layer {
        name: "kvd-store block table",
        files: &["table/"],
        may_reach: &[
            "region",
            "pool",
            "alloc",
            "deadline",
            "lease",
            "sync",
            "completions",
            "events",
            "checksum",
            "process",
            "table",
        ],
    },
];

const DATA_PLANE: &[&str] = &[
    "dataplane",
    "grants",
    "gate",
    "remote_access",
    "rdma",
    "auth",
];

const TRANSFER: &[Layer] = &[Layer {
    name: "kvd-transfer data plane",
    files: &[
        "dataplane/",
        "grants.rs",
        "gate.rs",
        "remote_access.rs",
        "rdma.rs",
        "auth.rs",
    ],
    may_reach: DATA_PLANE,
}];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the daemon crate sits in the repository")
        .to_path_buf()
}

/// The `.rs` files of `entry` under `src` (a file, or every file below a folder).
fn files_of(src: &Path, entry: &str) -> Vec<PathBuf> {
    let p = src.join(entry.trim_end_matches('/'));
    if !entry.ends_with('/') {
        return vec![p];
    }
    let mut out = Vec::new();
    let mut todo = vec![p];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("a layer's folder") {
            let e = e.expect("a folder entry").path();
            if e.is_dir() {
                todo.push(e);
            } else if e.extension().is_some_and(|x| x == "rs") {
                out.push(e);
            }
        }
    }
    out
}

/// How many `super::` lead from `file` to the crate root: 1 for `src/a.rs` and
/// `src/a/mod.rs`, one more per folder below.
fn depth(src: &Path, file: &Path) -> usize {
    let rel = file.strip_prefix(src).expect("a file under src");
    let folders = rel.components().count() - 1;
    let is_mod = rel.file_name().is_some_and(|n| n == "mod.rs");
    if is_mod {
        folders
    } else {
        folders + 1
    }
}

/// The top-level modules `code` (a file at `depth`) reaches by `crate::` or by enough
/// `super::` to climb to the root, outside comments. `crate::{a, b::c}` reaches a and b.
fn reached(code: &str, depth: usize) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or_default();
        let mut rest = line;
        while let Some(at) = find_path(rest) {
            let (start, climb) = at;
            let tail = &rest[start..];
            let after = match climb {
                Climb::Crate => tail.strip_prefix("crate::"),
                Climb::Supers(n) if n >= depth => Some(&tail[n * "super::".len()..]),
                Climb::Supers(n) => {
                    rest = &tail[n * "super::".len()..];
                    continue;
                }
            };
            let Some(after) = after else { break };
            let names: Vec<&str> = match after.strip_prefix('{') {
                Some(group) => group
                    .split('}')
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .map(|s| s.trim())
                    .collect(),
                None => vec![after],
            };
            for n in names {
                let m: String = n
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !m.is_empty() && m != "self" {
                    out.insert(m);
                }
            }
            rest = &after[after.len().min(1)..];
        }
    }
    out
}

enum Climb {
    Crate,
    Supers(usize),
}

/// The next `crate::` or run of `super::` in `s`: where it starts and how far it climbs.
fn find_path(s: &str) -> Option<(usize, Climb)> {
    let c = s.find("crate::");
    let p = s.find("super::");
    match (c, p) {
        (Some(c), Some(p)) if c < p => Some((c, Climb::Crate)),
        (Some(c), None) => Some((c, Climb::Crate)),
        (_, Some(p)) => {
            let mut n = 0;
            while s[p + n * "super::".len()..].starts_with("super::") {
                n += 1;
            }
            Some((p, Climb::Supers(n)))
        }
        (None, None) => None,
    }
}

/// Every reach of a layer's files outside what it may reach: `file: module`.
fn breaches(src: &Path, layers: &[Layer]) -> Vec<String> {
    let mut out = Vec::new();
    for l in layers {
        for entry in l.files {
            for f in files_of(src, entry) {
                let code = std::fs::read_to_string(&f).expect("a layer's file");
                for m in reached(&code, depth(src, &f)) {
                    if !l.may_reach.contains(&m.as_str()) {
                        out.push(format!("{} ({}): {m}", f.display(), l.name));
                    }
                }
            }
        }
    }
    out
}

#[test]
fn the_store_base_and_block_table_reach_nothing_above_them() {
    let b = breaches(&repo().join("store/src"), STORE);
    assert!(
        b.is_empty(),
        "upward reaches in kvd-store:\n{}",
        b.join("\n")
    );
}

#[test]
fn the_data_plane_knows_no_transfer_record_or_flow() {
    let b = breaches(&repo().join("transfer/src"), TRANSFER);
    assert!(
        b.is_empty(),
        "upward reaches in kvd-transfer:\n{}",
        b.join("\n")
    );
}

/// Negative control: the check finds each way of reaching up (a grouped `crate::` use, a
/// path in an expression, enough `super::` from a nested file) and lets comments and
/// paths inside the layer through.
#[test]
fn negative_control_reaches_up_are_found() {
    let code = "use crate::{pool, index::Index};\n\
                // crate::tiering in a comment\n\
                let x = crate::reclaim::Room::Full;\n\
                use super::super::exporter::ExportAt;\n\
                use super::tcp::TcpTransport;\n";
    let got = reached(code, 2);
    let want: BTreeSet<String> = ["pool", "index", "reclaim", "exporter"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(got, want);
    // A file at the root: one `super::` is the crate.
    assert_eq!(
        reached("use super::records::Records;", 1),
        BTreeSet::from(["records".to_string()])
    );
}
