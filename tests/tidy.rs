//! The house rules of ARCHITECTURE.md, checked on the source text (as rust-analyzer's
//! tidy tests do), so a change that breaks one fails `cargo test` instead of waiting for a
//! reviewer: no import circle between files, stages that meet only in the store, Redis
//! known only to the store, faces that never import each other, dispatch's sinks that
//! never import each other, AMQP transport that never decodes a job's meta, and no
//! comment citing an issue number a reader cannot look up.
//!
//! Imports are read from `use` trees and from `crate::`/`super::` paths in code
//! (comments stripped). A file imports a module when a path resolves into it; an edge
//! between a module and its own parent or child is not counted (a parent declares and
//! re-exports its children, children use the parent's items).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every file under `dir` whose name ends with one of `exts`, sorted.
fn files(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                if !path.ends_with("target") && !path.ends_with("node_modules") {
                    stack.push(path);
                }
            } else if exts.iter().any(|ext| path.to_string_lossy().ends_with(ext)) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The module path of a file under `src/` (`src/store/api.rs` -> `store::api`).
fn module_of(file: &Path) -> Vec<String> {
    module_in(&repo().join("src"), file)
}

/// The module path of a file in the crate whose root file is in `root`.
fn module_in(root: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(root).expect("under the crate's root");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_string());
    }
    parts
}

/// The source without comments (line, block and doc comments); string literals kept.
fn strip_comments(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let bytes: Vec<char> = source.chars().collect();
    let (mut i, mut in_string, mut depth) = (0, false, 0usize);
    while i < bytes.len() {
        let (c, next) = (bytes[i], bytes.get(i + 1).copied());
        if depth > 0 {
            if c == '*' && next == Some('/') {
                depth -= 1;
                i += 2;
            } else if c == '/' && next == Some('*') {
                depth += 1;
                i += 2;
            } else {
                if c == '\n' {
                    out.push('\n');
                }
                i += 1;
            }
            continue;
        }
        if in_string {
            out.push(c);
            if c == '\\' {
                if let Some(n) = next {
                    out.push(n);
                }
                i += 2;
                continue;
            }
            in_string = c != '"';
            i += 1;
            continue;
        }
        match (c, next) {
            ('/', Some('/')) => {
                while i < bytes.len() && bytes[i] != '\n' {
                    i += 1;
                }
            }
            ('/', Some('*')) => {
                depth = 1;
                i += 2;
            }
            ('"', _) => {
                // A char literal '"' is not a string.
                let quoted_char = i > 0 && bytes[i - 1] == '\'' && next == Some('\'');
                in_string = !quoted_char;
                out.push(c);
                i += 1;
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// The paths a `use` tree names (`a::{b, c::d}` -> `a::b`, `a::c::d`).
fn expand_use_tree(tree: &str) -> Vec<String> {
    let tree = tree.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = Vec::new();
    expand_into("", &tree, &mut out);
    out
}

fn expand_into(prefix: &str, tree: &str, out: &mut Vec<String>) {
    let join = |rest: &str| {
        if prefix.is_empty() {
            rest.to_string()
        } else if rest.is_empty() {
            prefix.to_string()
        } else {
            format!("{prefix}::{rest}")
        }
    };
    let tree = tree.trim();
    match tree.find('{') {
        None => {
            // `path as alias`: the path is the first word.
            let path = tree.split(' ').next().unwrap_or(tree);
            if !path.is_empty() {
                out.push(join(path.trim_end_matches("::")));
            }
        }
        Some(open) => {
            let head = tree[..open].trim().trim_end_matches("::");
            let close = tree.rfind('}').filter(|&c| c > open).unwrap_or(tree.len());
            let inner = &tree[open + 1..close];
            let base = join(head);
            let mut depth = 0;
            let mut start = 0;
            for (i, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand_into(&base, &inner[start..i], out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            if start < inner.len() {
                expand_into(&base, &inner[start..], out);
            }
        }
    }
}

/// Every path a file names that starts in this crate: `use` trees and inline
/// `crate::`/`super::`/`self::` paths (`redisched::` in the binary's `main.rs`).
fn paths_in(code: &str) -> Vec<String> {
    let mut paths = Vec::new();
    let mut tree: Option<String> = None;
    for line in code.lines() {
        let line = line.trim();
        if tree.is_none() {
            let visibility = ["pub(crate) ", "pub(super) ", "pub "];
            let bare = visibility
                .iter()
                .find_map(|v| line.strip_prefix(v))
                .unwrap_or(line);
            if let Some(rest) = bare.strip_prefix("use ") {
                tree = Some(rest.to_string());
            }
        } else if let Some(t) = tree.as_mut() {
            t.push(' ');
            t.push_str(line);
        }
        if let Some(t) = tree.as_ref() {
            if let Some(end) = t.find(';') {
                paths.extend(expand_use_tree(&t[..end]));
                tree = None;
            }
        }
    }
    let chars: Vec<char> = code.chars().collect();
    let text: String = chars.iter().collect();
    for root in ["crate::", "super::", "self::", "redisched::"] {
        let mut from = 0;
        while let Some(found) = text[from..].find(root) {
            let start = from + found;
            let boundary = start == 0
                || !text[..start]
                    .chars()
                    .last()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':');
            let end = text[start..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .map_or(text.len(), |e| start + e);
            if boundary {
                paths.push(text[start..end].trim_end_matches(':').to_string());
            }
            from = end.max(start + root.len());
        }
    }
    paths
}

struct Source {
    file: PathBuf,
    module: Vec<String>,
    code: String,
}

fn sources() -> Vec<Source> {
    crate_sources(&repo().join("src"))
}

/// Every Rust file of the crate whose root file (`lib.rs`, `main.rs`) is in `root`.
fn crate_sources(root: &Path) -> Vec<Source> {
    files(root, &[".rs"])
        .into_iter()
        .map(|file| {
            let text = std::fs::read_to_string(&file).expect("read source");
            Source {
                module: module_in(root, &file),
                code: strip_comments(&text),
                file,
            }
        })
        .collect()
}

fn rel(file: &Path) -> String {
    file.strip_prefix(repo())
        .unwrap_or(file)
        .to_string_lossy()
        .into_owned()
}

/// The module files (`store::api`, `store`, ...) a file's paths resolve into.
fn imports(source: &Source, modules: &BTreeSet<Vec<String>>) -> BTreeSet<Vec<String>> {
    let is_main = source.file.ends_with("src/main.rs");
    let mut found = BTreeSet::new();
    for path in paths_in(&source.code) {
        let segments: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
        let Some((&first, tail)) = segments.split_first() else {
            continue;
        };
        let mut absolute: Vec<String> = match first {
            "crate" => Vec::new(),
            "redisched" if is_main => Vec::new(),
            "self" => source.module.clone(),
            "super" => {
                let mut base = source.module.clone();
                base.pop();
                base
            }
            // `use child::Item` in the file that declares `mod child`.
            child => {
                let mut candidate = source.module.clone();
                candidate.push(child.to_string());
                if !modules.contains(&candidate) {
                    continue;
                }
                source.module.clone()
            }
        };
        let tail: &[&str] = if matches!(first, "crate" | "redisched" | "self" | "super") {
            tail
        } else {
            &segments
        };
        let mut resolved = None;
        for segment in tail {
            if *segment == "super" {
                absolute.pop();
                continue;
            }
            absolute.push((*segment).to_string());
            if modules.contains(&absolute) {
                resolved = Some(absolute.clone());
            } else {
                break;
            }
        }
        if let Some(module) = resolved {
            if module != source.module {
                found.insert(module);
            }
        }
    }
    found
}

fn related(a: &[String], b: &[String]) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

fn show(module: &[String]) -> String {
    if module.is_empty() {
        "crate".into()
    } else {
        module.join("::")
    }
}

/// Strongly connected components of more than one module (Tarjan).
fn circles(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<Vec<String>>> {
    struct State<'a> {
        graph: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        index: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        on_stack: BTreeSet<&'a Vec<String>>,
        found: Vec<Vec<Vec<String>>>,
    }
    fn visit<'a>(state: &mut State<'a>, node: &'a Vec<String>) {
        let n = state.index.len();
        state.index.insert(node, n);
        state.low.insert(node, n);
        state.stack.push(node);
        state.on_stack.insert(node);
        if let Some(targets) = state.graph.get(node) {
            for target in targets {
                let Some((target, _)) = state.graph.get_key_value(target) else {
                    continue;
                };
                if !state.index.contains_key(target) {
                    visit(state, target);
                    let low = state.low[target].min(state.low[node]);
                    state.low.insert(node, low);
                } else if state.on_stack.contains(target) {
                    let low = state.index[target].min(state.low[node]);
                    state.low.insert(node, low);
                }
            }
        }
        if state.low[node] == state.index[node] {
            let mut component = Vec::new();
            while let Some(top) = state.stack.pop() {
                state.on_stack.remove(top);
                component.push(top.clone());
                if top == node {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                state.found.push(component);
            }
        }
    }
    let mut state = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for node in graph.keys() {
        if !state.index.contains_key(node) {
            visit(&mut state, node);
        }
    }
    state.found
}

fn import_graph(sources: &[Source]) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let modules: BTreeSet<Vec<String>> = sources
        .iter()
        .filter(|s| !s.file.ends_with("src/main.rs"))
        .map(|s| s.module.clone())
        .collect();
    sources
        .iter()
        .filter(|s| !s.file.ends_with("src/main.rs"))
        .map(|s| {
            let edges = imports(s, &modules)
                .into_iter()
                .filter(|m| !related(m, &s.module))
                .collect();
            (s.module.clone(), edges)
        })
        .collect()
}

#[test]
fn no_import_circle_between_files() {
    let graph = import_graph(&sources());
    let found = circles(&graph);
    let described: Vec<String> = found
        .iter()
        .map(|c| c.iter().map(|m| show(m)).collect::<Vec<_>>().join(" <-> "))
        .collect();
    assert!(
        described.is_empty(),
        "import circles (each list imports one another; cut the shared piece into a module of its own):\n  {}",
        described.join("\n  ")
    );
}

/// The other crates of the workspace: the benchmarks, the test kit, and each test binary
/// with modules of its own (a folder of `tests/` with a `main.rs`).
#[test]
fn no_import_circle_in_the_other_crates_of_the_workspace() {
    let mut roots = vec![repo().join("bench/src"), repo().join("testkit/src")];
    let mut binaries: Vec<PathBuf> = std::fs::read_dir(repo().join("tests"))
        .expect("tests/")
        .flatten()
        .map(|entry| entry.path())
        .filter(|dir| dir.join("main.rs").is_file())
        .collect();
    binaries.sort();
    assert!(
        binaries.len() >= 5,
        "the test binaries by boundary: {binaries:?}"
    );
    roots.extend(binaries);
    let mut described = Vec::new();
    for root in &roots {
        let sources = crate_sources(root);
        assert!(!sources.is_empty(), "no Rust file in {}", root.display());
        for circle in circles(&import_graph(&sources)) {
            let names: Vec<String> = circle.iter().map(|m| show(m)).collect();
            described.push(format!("{}: {}", rel(root), names.join(" <-> ")));
        }
    }
    assert!(
        described.is_empty(),
        "import circles (cut the shared piece into a module of its own):\n  {}",
        described.join("\n  ")
    );
}

/// `(file, offending module)` for every file of `from` (a top-level module) importing
/// one of `forbidden`.
fn violations(sources: &[Source], from: &[&str], forbidden: &[&str]) -> Vec<String> {
    let modules: BTreeSet<Vec<String>> = sources.iter().map(|s| s.module.clone()).collect();
    let mut found = Vec::new();
    for source in sources {
        let Some(top) = source.module.first() else {
            continue;
        };
        if !from.contains(&top.as_str()) {
            continue;
        }
        for module in imports(source, &modules) {
            if let Some(target) = module.first() {
                if target != top && forbidden.contains(&target.as_str()) {
                    found.push(format!("{} imports {}", rel(&source.file), show(&module)));
                }
            }
        }
    }
    found
}

#[test]
fn stages_meet_only_in_the_store() {
    let stages = ["ingest", "dispatch", "requeue"];
    let found = violations(&sources(), &stages, &stages);
    assert!(
        found.is_empty(),
        "a stage imports another (they meet only in the store: ARCHITECTURE.md, *Invariants*):\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn the_faces_never_import_each_other() {
    let sources = sources();
    let mut found = violations(&sources, &["cli"], &["http"]);
    found.extend(violations(&sources, &["http"], &["cli"]));
    assert!(
        found.is_empty(),
        "the CLI and the HTTP API share view.rs, never each other:\n  {}",
        found.join("\n  ")
    );
}

/// Ingest's consumers (a lane's session, the router) and what they share (lanes,
/// isolation, decoding, applying, answering) never reach into the partitioned-commands
/// feature (`ingest/partitions.rs`): it is built from them, not the other way round.
#[test]
fn ingest_rooms_never_import_the_partitions_feature() {
    let sources = sources();
    let modules: BTreeSet<Vec<String>> = sources.iter().map(|s| s.module.clone()).collect();
    let feature = vec!["ingest".to_string(), "partitions".to_string()];
    let mut found = Vec::new();
    for source in &sources {
        let in_ingest = source.module.first().is_some_and(|m| m == "ingest");
        if !in_ingest || source.module.len() < 2 || source.module == feature {
            continue;
        }
        if imports(source, &modules).contains(&feature) {
            found.push(rel(&source.file));
        }
    }
    assert!(
        found.is_empty(),
        "these import ingest/partitions.rs (lanes live in lane.rs, isolation in isolation.rs):\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn only_the_store_names_a_redis_client() {
    let mut found = Vec::new();
    for source in sources() {
        let in_store = source.module.first().is_some_and(|m| m == "store");
        // ARCHITECTURE.md's one exception: tls.rs builds the TLS-configured client.
        let tls = source.module == ["tls"];
        if in_store || tls {
            continue;
        }
        for path in paths_in(&source.code)
            .into_iter()
            .chain(redis_paths(&source.code))
        {
            if path == "redis" || path.starts_with("redis::") {
                found.push(format!("{}: {path}", rel(&source.file)));
            }
        }
    }
    found.sort();
    found.dedup();
    assert!(
        found.is_empty(),
        "only src/store/ knows Redis clients, keys and scripts:\n  {}",
        found.join("\n  ")
    );
}

/// `(file, offending module)` for every file in module `from` (a module path, e.g.
/// `["dispatch", "amqp"]`, and everything under it) importing a module under
/// `forbidden`.
fn prefix_violations(sources: &[Source], from: &[&str], forbidden: &[&str]) -> Vec<String> {
    let modules: BTreeSet<Vec<String>> = sources.iter().map(|s| s.module.clone()).collect();
    let under = |module: &[String], prefix: &[&str]| {
        module.len() >= prefix.len() && module.iter().zip(prefix).all(|(m, p)| m == p)
    };
    let mut found = Vec::new();
    for source in sources.iter().filter(|s| under(&s.module, from)) {
        for module in imports(source, &modules) {
            if under(&module, forbidden) {
                found.push(format!("{} imports {}", rel(&source.file), show(&module)));
            }
        }
    }
    found
}

/// Dispatch's sinks: its folders (`src/dispatch/<sink>/mod.rs`); its files are what the
/// sinks share.
fn dispatch_sinks(sources: &[Source]) -> BTreeSet<String> {
    sources
        .iter()
        .filter(|s| s.file.ends_with("mod.rs") && s.module.len() == 2 && s.module[0] == "dispatch")
        .map(|s| s.module[1].clone())
        .collect()
}

/// Every import from one sink's folder into another's.
fn sink_crossings(sources: &[Source]) -> Vec<String> {
    let sinks = dispatch_sinks(sources);
    let mut found = Vec::new();
    for from in &sinks {
        for into in sinks.iter().filter(|into| *into != from) {
            found.extend(prefix_violations(
                sources,
                &["dispatch", from],
                &["dispatch", into],
            ));
        }
    }
    found
}

#[test]
fn the_dispatch_sinks_never_import_each_other() {
    let sources = sources();
    let sinks = dispatch_sinks(&sources);
    assert!(
        sinks.contains("amqp") && sinks.contains("webhook"),
        "the sinks are dispatch's folders: {sinks:?}"
    );
    let found = sink_crossings(&sources);
    assert!(
        found.is_empty(),
        "a sink imports another (what they share lives beside them in src/dispatch/; ARCHITECTURE.md, *Where to add …*):\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn amqp_is_transport_and_never_decodes_a_jobs_meta() {
    let found = prefix_violations(&sources(), &["amqp"], &["job", "meta"]);
    assert!(
        found.is_empty(),
        "src/amqp/ is transport only (connect, topology, channels, errors); a job's stored meta is read in src/job/meta.rs by ingest and dispatch:\n  {}",
        found.join("\n  ")
    );
}

/// `redis::...` paths in code (the crate, not this crate's modules).
fn redis_paths(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("redis::") {
        let start = from + at;
        let boundary = !code[..start]
            .chars()
            .last()
            .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':');
        if boundary {
            let end = code[start..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .map_or(code.len(), |e| start + e);
            found.push(code[start..end].to_string());
        }
        from = start + "redis::".len();
    }
    found
}

/// `issue 12`, `issues 6 and 7`, `issue #3`, `(#12)`: references into a tracker the reader
/// of the code does not have. Other projects' issues (`BullMQ #301`) are fine.
fn cites_an_issue(line: &str) -> bool {
    let lower = line.to_lowercase();
    let mut rest = lower.as_str();
    while let Some(at) = rest.find("issue") {
        let after = rest[at + 5..].trim_start_matches('s').trim_start();
        let after = after.strip_prefix('#').unwrap_or(after);
        if after.chars().next().is_some_and(|c| c.is_ascii_digit()) {
            return true;
        }
        rest = &rest[at + 5..];
    }
    lower.contains("(#") && {
        let after = &lower[lower.find("(#").unwrap_or(0) + 2..];
        after.chars().next().is_some_and(|c| c.is_ascii_digit())
    }
}

#[test]
fn no_comment_cites_an_issue_number() {
    let mut found = Vec::new();
    for dir in ["src", "tests", "testkit", "bench", "lua", "scripts"] {
        let exts = [".rs", ".lua", ".sh", ".mjs", ".html", ".toml"];
        for file in files(&repo().join(dir), &exts) {
            if file.ends_with("tests/tidy.rs") {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&file) else {
                continue;
            };
            for (n, line) in text.lines().enumerate() {
                if cites_an_issue(line) {
                    found.push(format!("{}:{}: {}", rel(&file), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "{} lines cite issue numbers a reader cannot look up; say what the behaviour is instead:\n  {}",
        found.len(),
        found.join("\n  ")
    );
}

/// `(test function, its #[ignore] reason or "")` for every ignored test in `source`.
fn ignored_tests(source: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut reason: Option<String> = None;
    for line in source.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("#[ignore") {
            let text = rest.split_once('"').and_then(|(_, r)| r.rsplit_once('"'));
            reason = Some(text.map(|(r, _)| r.to_string()).unwrap_or_default());
        } else if let Some(open) = reason.as_ref().and(line.find("fn ")) {
            let name = line[open + 3..].split(['(', '<']).next().unwrap_or("");
            found.push((name.to_string(), reason.take().unwrap_or_default()));
        }
    }
    found
}

/// The test tiers: `cargo test` skips the tests ignored as `slow:`, and `scripts/test.sh`
/// runs everything with `--include-ignored` except the tests its `BY_HAND` list skips
/// (measurements and long runs). So every other ignore reason must be on that list, or
/// the full run would start a by-hand test; and a rustdoc `ignore` block would be run too.
#[test]
fn every_ignored_test_is_slow_or_run_by_hand() {
    let script = std::fs::read_to_string(repo().join("scripts/test.sh")).expect("scripts/test.sh");
    let by_hand: BTreeSet<&str> = script
        .lines()
        .find_map(|l| l.trim().strip_prefix("BY_HAND=("))
        .and_then(|l| l.split_once(')'))
        .map(|(names, _)| names.split_whitespace().collect())
        .expect("scripts/test.sh lists BY_HAND=(...)");
    let mut problems = Vec::new();
    let mut listed = BTreeSet::new();
    for dir in ["tests", "src"] {
        for file in files(&repo().join(dir), &[".rs"]) {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            if file.ends_with("tests/tidy.rs") {
                continue;
            }
            for (name, reason) in ignored_tests(&text) {
                if by_hand.contains(name.as_str()) {
                    listed.insert(name);
                } else if !reason.starts_with("slow:") {
                    problems.push(format!(
                        "{}: {name} is ignored ({reason:?}) but neither `slow:` nor in BY_HAND",
                        rel(&file)
                    ));
                }
            }
            for (n, line) in text.lines().enumerate() {
                let doc = line.trim_start().starts_with("//");
                if doc && (line.contains("```ignore") || line.contains("```rust,ignore")) {
                    problems.push(format!("{}:{}: an ignored doc test", rel(&file), n + 1));
                }
            }
        }
    }
    for name in by_hand.iter().filter(|n| !listed.contains(**n)) {
        problems.push(format!(
            "scripts/test.sh BY_HAND names {name}, no such ignored test"
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    let sample =
        "#[tokio::test]\n#[ignore = \"slow: x\"]\nasync fn a() {}\n#[ignore]\nfn b<T>() {}";
    assert_eq!(
        ignored_tests(sample),
        [("a".into(), "slow: x".into()), ("b".into(), String::new())]
    );
}

#[test]
fn the_checker_itself_sees_what_it_must() {
    assert_eq!(
        expand_use_tree("crate::{a::{b, c as d}, e}"),
        ["crate::a::b", "crate::a::c", "crate::e"]
    );
    let code = strip_comments(
        "use crate::x; // crate::y\nlet s = \"http://h\"; /* crate::z */ crate::w::V",
    );
    let paths = paths_in(&code);
    assert!(paths.contains(&"crate::x".to_string()));
    assert!(paths.contains(&"crate::w::V".to_string()));
    assert!(!paths.iter().any(|p| p.contains('y') || p.contains('z')));
    assert!(cites_an_issue("// fixed for issue 12"));
    assert!(cites_an_issue("//! Faults (issue #6): the bridge"));
    assert!(!cites_an_issue("// BullMQ #301 open since 2020"));
    let mut graph = BTreeMap::new();
    let m = |s: &str| vec![s.to_string()];
    graph.insert(m("a"), BTreeSet::from([m("b")]));
    graph.insert(m("b"), BTreeSet::from([m("a")]));
    graph.insert(m("c"), BTreeSet::from([m("a")]));
    assert_eq!(circles(&graph), vec![vec![m("a"), m("b")]]);

    // The sinks' rule and the transport's rule, on a small made-up source tree.
    let source = |file: &str, code: &str| {
        let file = repo().join(file);
        Source {
            module: module_of(&file),
            code: strip_comments(code),
            file,
        }
    };
    let tree = [
        source("src/dispatch/mod.rs", "mod amqp; mod settle; mod webhook;"),
        source("src/dispatch/settle.rs", ""),
        source(
            "src/dispatch/amqp/mod.rs",
            "use crate::dispatch::settle::Settler; use crate::dispatch::webhook::client::Client;",
        ),
        source(
            "src/dispatch/webhook/mod.rs",
            "mod client; use super::settle::Settler;",
        ),
        source(
            "src/dispatch/webhook/client.rs",
            "fn f() { super::super::amqp::AmqpSink::open(); }",
        ),
        source(
            "src/amqp/mod.rs",
            "fn f() { crate::job::meta::decode_meta(b\"\"); }",
        ),
        source("src/amqp/topology.rs", "use crate::job::headers;"),
        source("src/job/mod.rs", "pub mod headers; pub mod meta;"),
        source("src/job/headers.rs", ""),
        source("src/job/meta.rs", ""),
    ];
    assert_eq!(
        dispatch_sinks(&tree),
        BTreeSet::from(["amqp".to_string(), "webhook".to_string()])
    );
    assert_eq!(
        sink_crossings(&tree),
        [
            "src/dispatch/amqp/mod.rs imports dispatch::webhook::client",
            "src/dispatch/webhook/client.rs imports dispatch::amqp",
        ],
        "each crossing seen, the shared settle.rs allowed"
    );
    assert_eq!(
        prefix_violations(&tree, &["amqp"], &["job", "meta"]),
        ["src/amqp/mod.rs imports job::meta"],
        "meta decoding seen, header names allowed"
    );
}

// ---------------------------------------------------------------------------------------
// Module docs name only what exists.
//
// A module's `//!` doc is its map (ARCHITECTURE.md's code map points at them), so a name in
// it that no longer exists sends the reader nowhere. Checked in backticked spans outside
// code blocks:
// - a file or folder (`confirm.rs`, `decode/`, `lua/put.lua`, `src/job/url.rs`: a token
//   ending in a known file extension or in `/`, or starting with a top-level directory of
//   the repository) must exist relative to the module's folder (for `x.rs`, also `x/`), one
//   of its ancestors up to `src/`, or the repository root;
// - a Rust path (`Session::run`, `crate::job::url::forbidden_address`, `amqp::partition_of`):
//   its module segments must be modules of the crate, its first item a name the module's
//   file defines or imports, and a member (`Type::member`) a name some file that defines the
//   type mentions in code (a method, variant, field or constant); a path into another crate
//   (`Span::none()`) needs only its first name in the workspace's code;
// - an intra-doc link's name (`[`Envelope`]`) must be defined in the workspace or named in
//   the file's code;
// - any other identifier-shaped name (`CamelCase`, `snake_case_with_underscores`,
//   `SCREAMING_CASE`, `name()`) must occur in the workspace's code or data (Rust outside
//   comments, Lua, the default configuration, the OpenAPI document, the dashboard), so a
//   renamed function or field cannot linger; single lower-case words (`put`, `every`) and
//   anything with spaces, dots or dashes (commands, keys, headers) are not checked.
// ---------------------------------------------------------------------------------------

/// A backticked span of a module doc: its text, its line (from 1), and whether it is an
/// intra-doc link (`[`X`]`).
#[derive(Debug, PartialEq)]
struct DocSpan {
    text: String,
    line: usize,
    link: bool,
}

/// The backticked spans of a file's `//!` lines, fenced code blocks left out; a span may
/// wrap a line.
fn module_doc_spans(text: &str) -> Vec<DocSpan> {
    let mut doc = String::new();
    let mut line_of = Vec::new();
    let mut fenced = false;
    for (n, line) in text.lines().enumerate() {
        let Some(rest) = line.trim_start().strip_prefix("//!") else {
            continue;
        };
        if rest.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        for c in rest.chars().chain(std::iter::once('\n')) {
            doc.push(c);
            line_of.push(n + 1);
        }
    }
    let chars: Vec<char> = doc.chars().collect();
    let run_at = |i: usize| chars[i..].iter().take_while(|&&c| c == '`').count();
    let mut spans = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            i += 1;
            continue;
        }
        let run = run_at(i);
        let start = i + run;
        let mut j = start;
        let mut end = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let r = run_at(j);
                if r == run {
                    end = Some(j);
                    break;
                }
                j += r;
            } else {
                j += 1;
            }
        }
        let Some(end) = end else { break };
        let text: String = chars[start..end].iter().collect();
        let link = i > 0 && chars[i - 1] == '[' && chars.get(end + run) == Some(&']');
        spans.push(DocSpan {
            text: text.split_whitespace().collect::<Vec<_>>().join(" "),
            line: line_of[start.min(line_of.len() - 1)],
            link,
        });
        i = end + run;
    }
    spans
}

/// The identifiers of a text (`[A-Za-z_][A-Za-z0-9_]*`).
fn identifiers(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| {
            w.chars()
                .next()
                .is_some_and(|c| c.is_alphabetic() || c == '_')
        })
}

/// The names a Rust source defines (`fn x`, `struct X`, `enum`, `trait`, `type`, `const`,
/// `static`, `mod`, `union`, `macro_rules! x`).
fn defined_names(code: &str) -> Vec<String> {
    let keywords = [
        "fn", "struct", "enum", "trait", "type", "const", "static", "mod", "union",
    ];
    let words: Vec<&str> = identifiers(code).collect();
    let mut found = Vec::new();
    for pair in words.windows(2) {
        if keywords.contains(&pair[0]) || pair[0] == "macro_rules" {
            found.push(pair[1].to_string());
        }
    }
    found
}

/// What the workspace defines and names, for the module-doc check.
struct Known {
    /// Name -> the files (index into `files`) that define it.
    defs: BTreeMap<String, BTreeSet<usize>>,
    /// Each Rust file's identifiers in code (comments stripped, strings kept).
    file_words: Vec<BTreeSet<String>>,
    /// Every identifier of the workspace's code and data.
    words: BTreeSet<String>,
    /// The crate's module paths, and the file of each.
    modules: BTreeMap<Vec<String>, usize>,
}

impl Known {
    /// `sources`: the crate's own files (its modules); `others`: the rest of the workspace's
    /// Rust code (tests, testkit, bench, examples); `data`: Lua, TOML, JSON, HTML texts.
    fn new(sources: &[Source], others: &[String], data: &[String]) -> Self {
        let mut known = Known {
            defs: BTreeMap::new(),
            file_words: Vec::new(),
            words: BTreeSet::new(),
            modules: BTreeMap::new(),
        };
        for (index, source) in sources.iter().enumerate() {
            for name in defined_names(&source.code) {
                known.defs.entry(name).or_default().insert(index);
            }
            let words: BTreeSet<String> = identifiers(&source.code).map(str::to_string).collect();
            known.words.extend(words.iter().cloned());
            known.file_words.push(words);
            // `main.rs` is the binary, not the crate root `lib.rs`.
            if !source.file.ends_with("src/main.rs") {
                known.modules.insert(source.module.clone(), index);
            }
        }
        for code in others {
            for name in defined_names(code) {
                known.defs.entry(name).or_default();
            }
            known.words.extend(identifiers(code).map(str::to_string));
        }
        for text in data {
            known.words.extend(identifiers(text).map(str::to_string));
        }
        known
    }

    fn defined(&self, name: &str) -> bool {
        self.defs.contains_key(name)
    }

    /// Whether `member` of `item` exists: a name some file defines (a method, a constant),
    /// or one that a file defining `item` names in its code (a variant, a field).
    fn has_member(&self, item: &str, member: &str) -> bool {
        self.defs.get(member).is_some_and(|files| !files.is_empty())
            || self
                .defs
                .get(item)
                .into_iter()
                .flatten()
                .any(|&file| self.file_words[file].contains(member))
    }
}

fn is_identifier(s: &str) -> bool {
    s.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
        && s.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// A token that names a file or folder: a known extension, a trailing `/`, or a first
/// segment that is a top-level directory of the repository; `None` for placeholders.
fn file_token(token: &str, top_dirs: &BTreeSet<String>) -> Option<String> {
    let token = token.trim_matches(|c: char| "(),;'\"".contains(c));
    let token = token.split(':').next().unwrap_or(token);
    if token.contains(['<', '>', '*', '{', '}', '$', '…', '|', '=']) || token.contains("..") {
        return None;
    }
    let exts = [
        ".rs", ".lua", ".json", ".html", ".toml", ".md", ".sh", ".yml", ".yaml",
    ];
    let segments: Vec<&str> = token.trim_end_matches('/').split('/').collect();
    let plain = segments
        .iter()
        .all(|s| !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || "_-.".contains(c)));
    let file = exts
        .iter()
        .any(|ext| token.ends_with(ext) && token.len() > ext.len());
    let folder = token.ends_with('/') && token.len() > 1;
    let rooted = token.contains('/') && top_dirs.contains(segments[0]);
    (plain && (file || folder || rooted)).then(|| token.to_string())
}

/// Whether `token` (a file or folder) exists for the module doc of `file`.
fn file_exists(file: &Path, token: &str) -> bool {
    let src = repo().join("src");
    let mut bases = Vec::new();
    if let (Some(dir), Some(stem)) = (file.parent(), file.file_stem()) {
        if !matches!(stem.to_str(), Some("mod" | "lib" | "main")) {
            bases.push(dir.join(stem)); // `targets.rs` names `secret.rs` of `targets/`
        }
        let mut dir = Some(dir);
        while let Some(d) = dir.filter(|d| d.starts_with(&src)) {
            bases.push(d.to_path_buf());
            dir = d.parent();
        }
    }
    bases.push(repo().to_path_buf());
    bases.iter().any(|base| base.join(token).exists())
}

/// Why a Rust path named in `source`'s module doc does not resolve, if it does not.
fn path_problem(path: &str, link: bool, source: &Source, known: &Known) -> Option<String> {
    let segments: Vec<&str> = path.split("::").collect();
    let rooted = |first: &str| {
        matches!(first, "crate" | "self" | "super" | "redisched")
            || known.modules.contains_key(&vec![first.to_string()])
    };
    let in_scope = |name: &str| identifiers(&source.code).any(|w| w == name);
    if segments.len() == 1 {
        let name = segments[0];
        if link && known.words.contains(name) && !in_scope(name) {
            return Some(format!(
                "[`{name}`] is a link rustdoc cannot resolve: the file neither defines nor imports it"
            ));
        }
        return (!known.words.contains(name))
            .then(|| format!("`{name}` is named nowhere in the workspace's code"));
    }
    if link && !rooted(segments[0]) && !in_scope(segments[0]) {
        return Some(format!(
            "[`{path}`] is a link rustdoc cannot resolve: the file neither defines nor imports `{}`",
            segments[0]
        ));
    }
    if !rooted(segments[0]) {
        // `Type::member` of this workspace, or a path into another crate.
        let (first, member) = (segments[0], segments[segments.len() - 1]);
        if known.defined(first) {
            return (!known.has_member(first, member))
                .then(|| format!("`{path}`: `{first}` has no `{member}`"));
        }
        return (!known.words.contains(first))
            .then(|| format!("`{path}`: `{first}` is named nowhere in the workspace's code"));
    }
    let mut module: Vec<String> = Vec::new();
    let mut rest = segments.as_slice();
    match rest[0] {
        "crate" | "redisched" => rest = &rest[1..],
        "self" | "super" => {
            module = source.module.clone();
            while let Some((&first, tail)) = rest.split_first() {
                match first {
                    "self" => {}
                    "super" => {
                        module.pop();
                    }
                    _ => break,
                }
                rest = tail;
            }
        }
        _ => {}
    }
    while let Some((&first, tail)) = rest.split_first() {
        let mut deeper = module.clone();
        deeper.push(first.to_string());
        if !known.modules.contains_key(&deeper) {
            break;
        }
        module = deeper;
        rest = tail;
    }
    let Some((&item, members)) = rest.split_first() else {
        return None; // a module
    };
    let file = known.modules[&module];
    if !known.file_words[file].contains(item) {
        return Some(format!(
            "`{path}`: module `{}` neither defines nor imports `{item}`",
            show(&module)
        ));
    }
    match members.last() {
        Some(member) if !known.has_member(item, member) => {
            Some(format!("`{path}`: `{item}` has no `{member}`"))
        }
        _ => None,
    }
}

/// Every name in a module doc of `sources` that does not exist, as `file:line: why`.
fn module_doc_problems(sources: &[Source], texts: &[String], known: &Known) -> Vec<String> {
    let top_dirs: BTreeSet<String> = std::fs::read_dir(repo())
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| !name.starts_with('.') && name != "target")
        .collect();
    let mut found = Vec::new();
    for (source, text) in sources.iter().zip(texts) {
        // `//! [`Label`]: path` defines where a link labelled so resolves.
        let targets: BTreeMap<String, String> = text
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("//! [`")?.split_once("`]: "))
            .map(|(label, target)| (label.to_string(), target.trim().to_string()))
            .collect();
        for span in module_doc_spans(text) {
            if let Some(target) = targets.get(&span.text).filter(|_| span.link) {
                if let Some(why) = path_problem(target, true, source, known) {
                    found.push(format!("{}:{}: {why}", rel(&source.file), span.line));
                }
                continue;
            }
            let at = format!("{}:{}", rel(&source.file), span.line);
            for token in span.text.split(' ') {
                if let Some(file) = file_token(token, &top_dirs) {
                    if !file_exists(&source.file, &file) {
                        found.push(format!("{at}: `{file}` does not exist"));
                    }
                }
            }
            let name = span.text.trim_end_matches("()");
            let checked = name.split("::").all(is_identifier)
                && (span.link
                    || name.contains("::")
                    || span.text.ends_with("()")
                    || name.contains('_')
                    || name.chars().next().is_some_and(char::is_uppercase)
                        && name.chars().any(char::is_lowercase));
            if checked {
                if let Some(why) = path_problem(name, span.link, source, known) {
                    found.push(format!("{at}: {why}"));
                }
            }
        }
    }
    found
}

/// The workspace's Rust code outside `src/` (comments stripped) and its data files.
fn workspace_texts() -> (Vec<String>, Vec<String>) {
    let mut code = Vec::new();
    for dir in ["tests", "testkit", "bench", "examples"] {
        for file in files(&repo().join(dir), &[".rs"]) {
            code.push(strip_comments(
                &std::fs::read_to_string(&file).unwrap_or_default(),
            ));
        }
    }
    let mut data = Vec::new();
    for (dir, exts) in [
        ("lua", &[".lua"][..]),
        ("config", &[".toml"][..]),
        ("src", &[".json", ".html"][..]),
    ] {
        for file in files(&repo().join(dir), exts) {
            data.push(std::fs::read_to_string(&file).unwrap_or_default());
        }
    }
    (code, data)
}

#[test]
fn module_docs_name_only_files_and_items_that_exist() {
    let sources = sources();
    let texts: Vec<String> = sources
        .iter()
        .map(|s| std::fs::read_to_string(&s.file).expect("read source"))
        .collect();
    let (code, data) = workspace_texts();
    let known = Known::new(&sources, &code, &data);
    let found = module_doc_problems(&sources, &texts, &known);
    assert!(
        found.is_empty(),
        "module docs (`//!`) that name a file or item that does not exist (ARCHITECTURE.md's code map points at them):\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn the_module_doc_checker_sees_what_it_must() {
    let doc = "//! Real: `sink.rs`, `amqp/`, `lua/put.lua`, `src/job/url.rs`, [`Dispatcher`],\n\
               //! `Dispatcher::run`, `Route::Amqp`, `crate::dispatch::Dispatcher`, `tokio::spawn`,\n\
               //! `Span::none()`, `x-delay`, `redis.wait_replicas`, `put`, `lua/<name>.lua`,\n\
               //! `redisched put <topic>`, [`crate::feed::Event::Command`], [`Ev`].\n\
               //! [`Ev`]: crate::feed::Event\n\
               //! ```text\n//! `gone.rs` in a code block\n//! ```\n\
               //! Stale: `expiry.rs`, `src/webhook/`, `Dispatcher::run_turns`, [`Sinks`],\n\
               //! `decode_command`, `crate::webhook::client`, `crate::dispatch::Expiry`, `old_name()`,\n\
               //! [`Event::Command`].\n";
    let code = "use tokio::spawn; use tracing::Span;\n\
                pub struct Dispatcher; impl Dispatcher { pub fn run(&self) {} }\n\
                pub enum Route { Amqp }";
    let source = |file: &str, code: &str| {
        let file = repo().join(file);
        Source {
            module: module_of(&file),
            code: strip_comments(code),
            file,
        }
    };
    let sources = [
        source("src/dispatch/mod.rs", code),
        source("src/feed.rs", "pub enum Event { Command }"),
        source("src/lib.rs", "pub mod dispatch; pub mod feed;"),
        source("src/main.rs", "fn main() {}"),
    ];
    let texts = [
        format!("{doc}{code}"),
        String::new(),
        String::new(),
        String::new(),
    ];
    let known = Known::new(&sources, &[], &[]);
    assert_eq!(
        module_doc_problems(&sources, &texts, &known),
        [
            "src/dispatch/mod.rs:9: `expiry.rs` does not exist",
            "src/dispatch/mod.rs:9: `src/webhook/` does not exist",
            "src/dispatch/mod.rs:9: `Dispatcher::run_turns`: `Dispatcher` has no `run_turns`",
            "src/dispatch/mod.rs:9: `Sinks` is named nowhere in the workspace's code",
            "src/dispatch/mod.rs:10: `decode_command` is named nowhere in the workspace's code",
            "src/dispatch/mod.rs:10: `crate::webhook::client`: module `crate` neither defines nor imports `webhook`",
            "src/dispatch/mod.rs:10: `crate::dispatch::Expiry`: module `dispatch` neither defines nor imports `Expiry`",
            "src/dispatch/mod.rs:10: `old_name` is named nowhere in the workspace's code",
            "src/dispatch/mod.rs:11: [`Event::Command`] is a link rustdoc cannot resolve: the file neither defines nor imports `Event`",
        ],
        "every stale name seen, every real one and every non-name left alone"
    );
    let spans = module_doc_spans("//! a `b\n//! c` [`D`] ``e`f``\n");
    assert_eq!(
        spans,
        [
            DocSpan {
                text: "b c".into(),
                line: 1,
                link: false
            },
            DocSpan {
                text: "D".into(),
                line: 2,
                link: true
            },
            DocSpan {
                text: "e`f".into(),
                line: 2,
                link: false
            },
        ]
    );
}
