//! The documentation stays true to the repository (no Redis or RabbitMQ needed):
//!
//! - every relative link of README.md, ARCHITECTURE.md, CHANGELOG.md, bench/JOURNAL.md and
//!   the book (docs/src/**/*.md) points at a file or directory that exists, and a link's
//!   `#anchor` into a Markdown page names one of its headings;
//! - every repository path they name in backticks (`tests/bridge/webhooks.rs`,
//!   `lua/put.lua`: a token with a `/` whose first segment is a top-level directory of the
//!   repository) exists, and so does every file the book `{{#include}}`s;
//! - README keeps its limits (length, line width, no dates, time zones, commit hashes or ❌)
//!   and the book shows no internal goal marks;
//! - the performance page opens with its report table, nothing dated above it, and each row
//!   names its date, commit and command;
//! - the configuration reference names every key of `Config` with its environment variable,
//!   and the docs name no `REDISCHED_*` variable the loader does not know.
//!
//! ARCHITECTURE.md's path of one job names every file by its repository path, so this
//! test holds its file counts to files that exist. (The module docs it points at are
//! checked by `tests/tidy.rs`.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use regex::Regex;
use serde::de::{self, DeserializeOwned, Visitor};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The Markdown files under `dir`, sorted.
fn markdown_under(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|ext| ext == "md") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

fn book_pages() -> Vec<PathBuf> {
    let pages = markdown_under(&repo().join("docs/src"));
    assert!(pages.len() > 10, "the book's pages are in docs/src");
    pages
}

/// The documents whose links and backticked paths are checked.
fn checked_docs() -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = [
        "README.md",
        "ARCHITECTURE.md",
        "CHANGELOG.md",
        "bench/JOURNAL.md",
    ]
    .iter()
    .map(|name| repo().join(name))
    .collect();
    docs.extend(book_pages());
    docs
}

fn rel(path: &Path) -> String {
    path.strip_prefix(repo())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The lines of `text` outside fenced code blocks, numbered from 1.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            lines.push((index + 1, line));
        }
    }
    lines
}

fn code_span() -> Regex {
    Regex::new(r"`+([^`]+)`+").expect("regex")
}

/// The relative link targets of one document's prose, with their line numbers.
fn relative_links(text: &str) -> Vec<(usize, String)> {
    let inline = Regex::new(r#"\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)"#).expect("regex");
    let reference = Regex::new(r"^\s*\[[^\]]+\]:\s*(\S+)").expect("regex");
    let spans = code_span();
    let mut links = Vec::new();
    for (number, line) in prose_lines(text) {
        // A link's text may be code (`[`x`](y)`); code elsewhere is not a link.
        let line = spans.replace_all(line, "code");
        let targets = inline
            .captures_iter(&line)
            .chain(reference.captures_iter(&line))
            .map(|c| c[1].to_string());
        for target in targets {
            let external = target.contains("://") || target.starts_with("mailto:");
            if !external {
                links.push((number, target));
            }
        }
    }
    links
}

/// mdBook's and GitHub's id of a heading: lower case, spaces to `-`, other punctuation
/// dropped, after the Markdown of code, links and emphasis is removed.
fn heading_id(heading: &str) -> String {
    let link = Regex::new(r"\[([^\]]*)\]\([^)]*\)").expect("regex");
    let text = link.replace_all(heading, "$1");
    text.chars()
        .filter_map(|ch| {
            if ch.is_alphanumeric() || ch == '_' || ch == '-' {
                Some(ch.to_lowercase().collect::<String>())
            } else if ch.is_whitespace() {
                Some("-".into())
            } else {
                None
            }
        })
        .collect()
}

/// The heading ids of a Markdown file, its `{{#include}}`d Markdown counted in, numbered
/// for repeats as both renderers do (`x`, `x-1`, ...).
fn anchors(path: &Path) -> BTreeSet<String> {
    let mut text = read(path);
    for include in includes(&text) {
        let included = path.parent().unwrap_or(repo()).join(&include);
        if included.extension().is_some_and(|ext| ext == "md") && included.exists() {
            text.push('\n');
            text.push_str(&read(&included));
        }
    }
    let mut ids = BTreeSet::new();
    for (_, line) in prose_lines(&text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let id = heading_id(heading.trim_start_matches('#').trim());
        let mut unique = id.clone();
        let mut n = 0;
        while ids.contains(&unique) {
            n += 1;
            unique = format!("{id}-{n}");
        }
        ids.insert(unique);
    }
    ids
}

/// The paths of a page's `{{#include path}}` and `{{#rustdoc_include path}}` (line
/// ranges and anchors after a `:` left off), fenced or not.
fn includes(text: &str) -> Vec<String> {
    let include = Regex::new(r"\{\{#(?:rustdoc_)?include\s+([^}\s:]+)[^}]*\}\}").expect("regex");
    include
        .captures_iter(text)
        .map(|c| c[1].to_string())
        .collect()
}

fn check_links(doc: &Path, problems: &mut Vec<String>) {
    let text = read(doc);
    let base = doc.parent().unwrap_or(repo());
    for (line, target) in relative_links(&text) {
        let (file, anchor) = match target.split_once('#') {
            Some((file, anchor)) => (file, Some(anchor)),
            None => (target.as_str(), None),
        };
        let file = file.split('?').next().unwrap_or(file);
        let resolved = if file.is_empty() {
            doc.to_path_buf()
        } else {
            base.join(file)
        };
        if !resolved.exists() {
            problems.push(format!(
                "{}:{line}: link to {target}: no such file",
                rel(doc)
            ));
            continue;
        }
        let is_markdown = resolved.extension().is_some_and(|ext| ext == "md");
        if let (Some(anchor), true) = (anchor, is_markdown) {
            if !anchors(&resolved).contains(anchor) {
                problems.push(format!(
                    "{}:{line}: link to {target}: {} has no heading with that id",
                    rel(doc),
                    rel(&resolved)
                ));
            }
        }
    }
}

#[test]
fn relative_links_point_at_files_and_headings_that_exist() {
    let mut problems = Vec::new();
    for doc in checked_docs() {
        check_links(&doc, &mut problems);
    }
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

/// The repository's top-level directories a backticked path may start with (not build
/// output, which is not in the repository).
fn top_level_dirs() -> BTreeSet<String> {
    std::fs::read_dir(repo())
        .expect("read the repository root")
        .flatten()
        .filter(|entry| entry.path().is_dir())
        .filter_map(|entry| entry.file_name().into_string().ok())
        .filter(|name| !name.starts_with('.') && name != "target" && name != "artifacts")
        .collect()
}

/// A backticked token that names a repository path: `first/…` with `first` a top-level
/// directory, without placeholders (`<topic>`, `*`, `…`, `{`, `$`).
fn repository_path(token: &str, dirs: &BTreeSet<String>) -> Option<String> {
    let token = token.trim_matches(|c: char| "()[],;:.'\"".contains(c));
    let token = token.split(['#', '?']).next().unwrap_or(token);
    // `src/app.rs:42` names a line of a file.
    let token = token.split(':').next().unwrap_or(token);
    let (first, _) = token.split_once('/')?;
    let placeholder =
        token.contains(['<', '>', '*', '{', '}', '$', '…', '|']) || token.contains("...");
    (dirs.contains(first) && !placeholder).then(|| token.to_string())
}

#[test]
fn backticked_repository_paths_and_includes_exist() {
    let dirs = top_level_dirs();
    let spans = code_span();
    let mut problems = Vec::new();
    for doc in checked_docs() {
        let text = read(&doc);
        for (line, prose) in prose_lines(&text) {
            for span in spans.captures_iter(prose) {
                for token in span[1].split_whitespace() {
                    if let Some(path) = repository_path(token, &dirs) {
                        if !repo().join(&path).exists() {
                            problems.push(format!("{}:{line}: `{path}` does not exist", rel(&doc)));
                        }
                    }
                }
            }
        }
        for include in includes(&text) {
            let path = doc.parent().unwrap_or(repo()).join(&include);
            if !path.exists() {
                problems.push(format!(
                    "{}: {{{{#include {include}}}}}: no such file",
                    rel(&doc)
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "paths that do not exist:\n{}",
        problems.join("\n")
    );
}

#[test]
fn readme_stays_short_plain_and_free_of_history() {
    let text = read(&repo().join("README.md"));
    let lines = text.lines().count();
    assert!(
        lines <= 250,
        "README.md has {lines} lines; keep it to 250 and move the rest into the book"
    );
    let hash = Regex::new(r"\b[0-9a-f]{7,40}\b").expect("regex");
    let date = Regex::new(r"\b\d{4}-\d{2}-\d{2}\b").expect("regex");
    let mut problems = Vec::new();
    for (number, line) in prose_lines(&text) {
        let chars = line.chars().count();
        if chars > 200 {
            problems.push(format!(
                "line {number}: {chars} characters (at most 200 outside code blocks)"
            ));
        }
        for found in hash.find_iter(line) {
            let token = found.as_str();
            let looks_like_a_commit = token.chars().any(|c| c.is_ascii_digit())
                && token.chars().any(|c| c.is_ascii_alphabetic());
            if looks_like_a_commit {
                problems.push(format!("line {number}: `{token}` looks like a commit hash"));
            }
        }
    }
    for (index, line) in text.lines().enumerate() {
        for (what, found) in [
            ("a time zone (UTC)", line.contains("UTC")),
            ("a ❌", line.contains('❌')),
            ("a date", date.is_match(line)),
        ] {
            if found {
                problems.push(format!("line {}: {what}: {line}", index + 1));
            }
        }
    }
    assert!(problems.is_empty(), "README.md:\n{}", problems.join("\n"));
}

#[test]
fn the_book_shows_no_internal_goal_marks() {
    for page in book_pages() {
        let text = read(&page);
        assert!(
            !text.contains('❌') && !text.contains('✅'),
            "{}: goals and their ✅/❌ belong in bench/JOURNAL.md, not in the user's docs",
            rel(&page)
        );
    }
}

#[test]
fn the_performance_page_opens_with_its_report_table() {
    let text = read(&repo().join("docs/src/performance.md"));
    let (above, rest) = text
        .split_once("<!-- report:begin -->")
        .expect("docs/src/performance.md has <!-- report:begin -->");
    let (table, _) = rest
        .split_once("<!-- report:end -->")
        .expect("docs/src/performance.md has <!-- report:end -->");
    let date = Regex::new(r"\b\d{4}-\d{2}-\d{2}\b").expect("regex");
    assert!(
        !date.is_match(above),
        "nothing dated may stand above the report table:\n{above}"
    );
    let commit = Regex::new(r"^[0-9a-f]{7,40}$").expect("regex");
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---") && !l.starts_with("| figure"))
        .collect();
    assert!(rows.len() >= 5, "the report table has its rows");
    for row in rows {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(
            cells.len(),
            7,
            "figure, redisched, same run, ratio, date, commit, command: {row}"
        );
        assert!(date.is_match(cells[4]), "a date: {row}");
        assert!(commit.is_match(cells[5]), "a commit: {row}");
        assert!(cells[6].contains("`redisched-bench"), "the command: {row}");
        assert!(
            !cells[2].is_empty() && cells[2] != "–",
            "a same-run ceiling or peer: {row}"
        );
    }
}

/// Records the field names serde asks a struct's deserializer for, so the list cannot
/// drift from the struct (fields skipped when serializing are named too).
struct FieldNames<'a>(&'a mut Vec<&'static str>);

impl<'de> de::Deserializer<'de> for FieldNames<'_> {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a struct"))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.extend_from_slice(fields);
        Err(de::Error::custom("fields recorded"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
        byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
        identifier ignored_any
    }
}

fn field_names<T: DeserializeOwned>() -> Vec<&'static str> {
    let mut names = Vec::new();
    assert!(T::deserialize(FieldNames(&mut names)).is_err(), "a struct");
    assert!(!names.is_empty(), "the struct has fields");
    names
}

/// The text of the configuration reference from its `## …[[name]]…` heading to the next
/// `## `.
fn array_section<'a>(page: &'a str, name: &str) -> &'a str {
    let heading = format!("## `[[{name}]]`");
    let start = page
        .find(&heading)
        .unwrap_or_else(|| panic!("the configuration reference has a section {heading}"));
    let rest = &page[start + heading.len()..];
    &rest[..rest.find("\n## ").unwrap_or(rest.len())]
}

#[test]
fn every_configuration_key_is_in_the_reference_with_its_environment_variable() {
    use redisched::config::{Config, PolicyConfig};
    use redisched::targets::TargetConfig;

    let page = read(&repo().join("docs/src/configuration.md"));
    let loader_names: BTreeSet<String> = Config::default()
        .to_env()
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    let serde_json::Value::Object(sections) =
        serde_json::to_value(Config::default()).expect("Config serializes")
    else {
        panic!("Config serializes as a table of sections");
    };
    assert_eq!(
        sections.keys().map(String::as_str).collect::<BTreeSet<_>>(),
        field_names::<Config>().into_iter().collect::<BTreeSet<_>>(),
        "every section of Config serializes"
    );
    let mut missing = Vec::new();
    for (section, value) in &sections {
        match value {
            serde_json::Value::Object(keys) => {
                for key in keys.keys() {
                    let env = format!("REDISCHED_{section}__{key}").to_uppercase();
                    assert!(
                        loader_names.contains(&env),
                        "{env} is the loader's own name"
                    );
                    let row = format!("| `{section}.{key}` | `{env}` |");
                    if !page.contains(&row) {
                        missing.push(row);
                    }
                }
            }
            serde_json::Value::Array(_) => {
                let fields = match section.as_str() {
                    "policies" => field_names::<PolicyConfig>(),
                    "targets" => field_names::<TargetConfig>(),
                    other => panic!("a new array section [[{other}]]: document it and add it here"),
                };
                let text = array_section(&page, section);
                for field in fields {
                    let row = format!("| `{field}` |");
                    if !text.contains(&row) {
                        missing.push(format!("[[{section}]] {row}"));
                    }
                }
            }
            other => panic!("section {section} is neither a table nor an array: {other}"),
        }
    }
    assert!(
        missing.is_empty(),
        "docs/src/configuration.md lacks these rows (key, then its variable):\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_docs_name_no_environment_variable_the_loader_does_not_know() {
    use redisched::config::Config;

    let known: BTreeSet<String> = Config::default()
        .to_env()
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    // The configuration reference shows what a misspelled key does.
    let deliberate = ["REDISCHED_REDIS__ULR"];
    let variable = Regex::new(r"REDISCHED_[A-Z0-9_]+__[A-Z0-9_]+").expect("regex");
    let mut unknown = Vec::new();
    for doc in checked_docs() {
        for found in variable.find_iter(&read(&doc)) {
            let name = found.as_str();
            if !known.contains(name) && !deliberate.contains(&name) {
                unknown.push(format!("{}: {name}", rel(&doc)));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "variables the loader would refuse:\n{}",
        unknown.join("\n")
    );
}

#[test]
fn the_summary_lists_every_page_of_the_book() {
    let summary = read(&repo().join("docs/src/SUMMARY.md"));
    let listed: BTreeSet<String> = relative_links(&summary)
        .into_iter()
        .map(|(_, target)| target)
        .collect();
    for page in book_pages() {
        let name = page
            .strip_prefix(repo().join("docs/src"))
            .expect("under docs/src")
            .display()
            .to_string();
        assert!(
            name == "SUMMARY.md" || listed.contains(&name),
            "docs/src/{name} is not in SUMMARY.md, so the book never shows it"
        );
    }
}
