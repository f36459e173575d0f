//! The import rules of ARCHITECTURE.md, checked on the source: the top-level modules of `src/`
//! import one way (no cycle), the edge pipeline never imports the fleet tier (only the
//! wiring in `daemon` attaches it), and the ingest core (`src/ingest/core.rs` and its
//! submodules) is pure: it names no runtime, socket, clock or I/O module, and neither does any
//! module it reaches. References are `crate::NAME` paths, `use crate::{..}` groups
//! included; test code (`tests.rs` files and `#[cfg(test)] mod tests` blocks) is left out.
//!
//! `cargo test --test it layers -- --nocapture` prints the modules in layer order.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Modules that may import `fleet`: the wiring, and the fleet tier itself.
const FLEET_IMPORTERS: [&str; 2] = ["daemon", "fleet"];

/// The modules around the ingest core that do I/O: the core reaches none of them.
const SHELL: [&str; 10] = [
    "daemon", "export", "fleet", "http", "ingest", "mqtt", "notify", "source", "store", "writer",
];

/// What no file of the ingest core names: the runtime, threads, sockets, files, the clocks
/// (time comes in with each event) and the I/O crates.
const CORE_NEVER_NAMES: [&str; 12] = [
    "tokio",
    "std::net",
    "std::fs",
    "std::thread",
    "Instant::now",
    "SystemTime::now",
    "Timestamp::now",
    "redb",
    "rumqttc",
    "sd_notify",
    "reqwest",
    "tokio_postgres",
];

/// What no module the core reaches names: the runtime, sockets and the I/O crates (config and
/// a few others read the clock or name an address, as data; the core's own files may not).
const REACHED_NEVER_NAMES: [&str; 5] = ["tokio", "TcpStream", "redb", "rumqttc", "tokio_postgres"];

type Graph = BTreeMap<String, BTreeSet<String>>;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every top-level module with the files that make it up.
fn modules() -> BTreeMap<String, Vec<PathBuf>> {
    let mut out: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in std::fs::read_dir(src()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
        if path.is_dir() {
            out.entry(name).or_default().extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") && name != "lib" && name != "main" {
            out.entry(name).or_default().push(path);
        }
    }
    out
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs")
            && path.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push(path);
        }
    }
    out
}

/// The source without comments and without its trailing `#[cfg(test)] mod tests { .. }`.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests {") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(at) => &l[..at],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level names after each `crate::` in `code`, groups included.
fn crate_refs(code: &str) -> BTreeSet<String> {
    refs_after(code, "crate::")
}

/// The names after each `prefix` (`crate::`, `super::`) in `code`, groups included.
fn refs_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        rest = &rest[at + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level names of the group: those at depth 0, before `::`, `,` or `}`.
            let (mut depth, mut start) = (0, 0);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.extend(first_ident(&group[start..i]));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.extend(first_ident(&group[start..i]));
                        start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.extend(first_ident(rest));
        }
    }
    out
}

fn first_ident(s: &str) -> Option<String> {
    let s = s.trim_start();
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    (end > 0).then(|| s[..end].to_owned())
}

fn graph() -> Graph {
    let modules = modules();
    let mut g = Graph::new();
    for (name, files) in &modules {
        let refs = g.entry(name.clone()).or_default();
        for file in files {
            let text = std::fs::read_to_string(file).unwrap();
            refs.extend(
                crate_refs(&code(&text))
                    .into_iter()
                    .filter(|r| r != name && modules.contains_key(r)),
            );
        }
    }
    g
}

/// The modules in layer order (each after everything it imports), or the modules left in
/// cycles.
fn layers(g: &Graph) -> Result<Vec<Vec<String>>, BTreeSet<String>> {
    let mut placed: BTreeSet<String> = BTreeSet::new();
    let mut out = Vec::new();
    while placed.len() < g.len() {
        let layer: Vec<String> = g
            .iter()
            .filter(|(m, deps)| !placed.contains(*m) && deps.iter().all(|d| placed.contains(d)))
            .map(|(m, _)| m.clone())
            .collect();
        if layer.is_empty() {
            return Err(g.keys().filter(|m| !placed.contains(*m)).cloned().collect());
        }
        placed.extend(layer.iter().cloned());
        out.push(layer);
    }
    Ok(out)
}

#[test]
fn top_level_modules_import_one_way() {
    let g = graph();
    assert!(g.len() > 20, "found the modules: {:?}", g.keys());
    match layers(&g) {
        Ok(layers) => {
            for (i, layer) in layers.iter().enumerate() {
                eprintln!("layer {i}: {}", layer.join(", "));
            }
        }
        Err(stuck) => {
            let edges: Vec<String> = stuck
                .iter()
                .flat_map(|m| {
                    g[m].iter()
                        .filter(|d| stuck.contains(*d))
                        .map(move |d| format!("{m} -> {d}"))
                })
                .collect();
            panic!(
                "modules import each other in a cycle (or depend on one): {stuck:?}; edges \
                 among them: {edges:#?}"
            );
        }
    }
}

/// The files of a directory module (`src/store/*.rs`, ...), as a graph of their `super::`
/// imports of each other (the module's root, `mod.rs` or the file beside the directory, left
/// out: its children may use what it declares).
fn sibling_graphs() -> BTreeMap<String, Graph> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(src()).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.is_dir() {
            continue;
        }
        let files: BTreeMap<String, PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
            .map(|p| (p.file_stem().unwrap().to_str().unwrap().to_owned(), p))
            .filter(|(n, _)| n != "mod" && n != "tests")
            .collect();
        let mut g = Graph::new();
        for (name, path) in &files {
            let code = code(&std::fs::read_to_string(path).unwrap());
            let refs = refs_after(&code, "super::")
                .into_iter()
                .filter(|r| r != name && files.contains_key(r))
                .collect();
            g.insert(name.clone(), refs);
        }
        out.insert(dir.file_name().unwrap().to_str().unwrap().to_owned(), g);
    }
    out
}

#[test]
fn the_files_of_each_module_import_one_way() {
    let graphs = sibling_graphs();
    assert!(graphs["store"].len() > 8, "found store's files: {graphs:?}");
    let cycles: Vec<String> = graphs
        .iter()
        .filter_map(|(dir, g)| layers(g).err().map(|stuck| format!("{dir}: {stuck:?}")))
        .collect();
    assert!(
        cycles.is_empty(),
        "files of a module import each other in a cycle: {cycles:?} (move what both need to a \
         file of its own, as store/records.rs and store/view.rs)"
    );
}

#[test]
fn the_edge_pipeline_does_not_import_the_fleet_tier() {
    let g = graph();
    let importers: Vec<&String> = g
        .iter()
        .filter(|(m, deps)| deps.contains("fleet") && !FLEET_IMPORTERS.contains(&m.as_str()))
        .map(|(m, _)| m)
        .collect();
    assert!(
        importers.is_empty(),
        "edge modules import the fleet tier: {importers:?} (attach it in daemon, through the \
         outbox or admit::DeltaLedger)"
    );
}

/// The ingest core's files: `ingest/core.rs` and its submodules, those it declares under
/// `#[cfg(test)]` (the simulations, like `tests.rs`) left out.
fn core_files() -> Vec<PathBuf> {
    let root = src().join("ingest/core.rs");
    let text = std::fs::read_to_string(&root).unwrap();
    let tests: Vec<String> = text
        .split("#[cfg(test)]\nmod ")
        .skip(1)
        .filter_map(|rest| rest.split_once(';').map(|(name, _)| format!("{name}.rs")))
        .collect();
    assert!(tests.len() >= 2, "found the core's test modules: {tests:?}");
    let mut files = vec![root];
    files.extend(
        rust_files(&src().join("ingest/core"))
            .into_iter()
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| !tests.iter().any(|t| t == n))
            }),
    );
    files
}

/// Every top-level module reached from `from`, through the graph.
fn reached(g: &Graph, from: &BTreeSet<String>) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo: Vec<&String> = from.iter().collect();
    while let Some(m) = todo.pop() {
        if seen.insert(m.clone()) {
            todo.extend(g.get(m).into_iter().flatten());
        }
    }
    seen
}

#[test]
fn the_ingest_core_is_pure() {
    let modules = modules();
    let mut direct = BTreeSet::new();
    let mut named = Vec::new();
    for file in core_files() {
        let code = code(&std::fs::read_to_string(&file).unwrap());
        named.extend(
            CORE_NEVER_NAMES
                .iter()
                .filter(|n| code.contains(*n))
                .map(|n| format!("{}: {n}", file.display())),
        );
        direct.extend(
            crate_refs(&code)
                .into_iter()
                .filter(|r| r != "ingest" && modules.contains_key(r)),
        );
    }
    assert!(direct.len() > 5, "found the core's imports: {direct:?}");
    assert!(
        named.is_empty(),
        "the ingest core names I/O, a runtime or a clock (time comes in with each event, \
         actions go out): {named:#?}"
    );
    let reached = reached(&graph(), &direct);
    let shell: Vec<&String> = reached
        .iter()
        .filter(|m| SHELL.contains(&m.as_str()))
        .collect();
    assert!(
        shell.is_empty(),
        "the ingest core reaches I/O modules {shell:?} (through {direct:?}): move the types it \
         needs down (as `link` holds the client's events)"
    );
    let mut io = Vec::new();
    for m in &reached {
        for file in &modules[m] {
            let code = code(&std::fs::read_to_string(file).unwrap());
            io.extend(
                REACHED_NEVER_NAMES
                    .iter()
                    .filter(|n| code.contains(*n))
                    .map(|n| format!("{}: {n}", file.display())),
            );
        }
    }
    assert!(
        io.is_empty(),
        "modules the ingest core reaches do I/O: {io:#?}"
    );
}

#[test]
fn the_purity_check_sees_a_clock_and_a_reached_shell() {
    let code =
        code("use crate::admit::A;\nlet t = Instant::now(); // Timestamp::now() here is a comment");
    let hits: Vec<&str> = CORE_NEVER_NAMES
        .iter()
        .copied()
        .filter(|n| code.contains(*n))
        .collect();
    assert_eq!(hits, ["Instant::now"]);
    let mut g = Graph::new();
    g.insert("admit".into(), ["decode".into()].into());
    g.insert("decode".into(), ["store".into()].into());
    g.insert("store".into(), BTreeSet::new());
    let from: BTreeSet<String> = ["admit".to_owned()].into();
    assert!(reached(&g, &from).contains("store"));
}

#[test]
fn the_reference_finder_reads_paths_and_groups() {
    let refs = crate_refs(
        "use crate::a::B;\nuse crate::{c, d::{e, f}, g::H as I};\nlet x = crate::j::k();",
    );
    let want: BTreeSet<String> = ["a", "c", "d", "g", "j"].map(String::from).into();
    assert_eq!(refs, want);
    let mut g = Graph::new();
    g.insert("x".into(), ["y".into()].into());
    g.insert("y".into(), ["x".into()].into());
    g.insert("z".into(), BTreeSet::new());
    assert_eq!(layers(&g).unwrap_err(), ["x", "y"].map(String::from).into());
}
