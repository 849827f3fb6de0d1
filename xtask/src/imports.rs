//! The module graph of each library crate, as its source files write it: module `a` depends on
//! module `b` when a file of `a` names `crate::b` (in a `use` or a path). A circle in that graph
//! means two modules that cannot be read, changed or tested apart; `cargo test` fails on one.
//! Names reached through the crate root's re-exports (`crate::Error`) are not edges: the root
//! only gathers what the modules define.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module of a source file under `src/` (`lib` for the root, `main` for a binary's).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap_or(file);
    let first = rel
        .components()
        .next()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .unwrap_or_default();
    first.trim_end_matches(".rs").to_owned()
}

/// Every `crate::name` in `text` outside comments, where `name` starts lowercase (a module;
/// `crate::Error` is a root re-export). `use crate::{a::X, b}` names `a` and `b`.
fn modules_named(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                // A grouped use: the first path segment of each item at the top level. Groups
                // that rustfmt broke over several lines are read by `multiline_groups`.
                let mut depth = 0;
                let mut items = vec![String::new()];
                for ch in group.chars() {
                    match ch {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => items.push(String::new()),
                        c => items.last_mut().expect("one item at least").push(c),
                    }
                }
                for item in items {
                    out.extend(lowercase_head(&item));
                }
                continue;
            }
            out.extend(lowercase_head(rest));
        }
    }
    out
}

/// The identifier `path` starts with, if it names a module (starts lowercase).
fn lowercase_head(path: &str) -> Option<String> {
    let name: String = path
        .trim()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (name.starts_with(|c: char| c.is_ascii_lowercase()) && name != "self").then_some(name)
}

/// `use crate::{` groups that rustfmt broke over several lines: the items on the lines after
/// the opening one, up to the closing brace.
fn multiline_groups(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut inside = 0usize;
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("").trim();
        if inside == 0 {
            if code.starts_with("use crate::{") && !code.contains('}') {
                inside = 1;
            }
            continue;
        }
        if inside == 1 {
            for item in code.split(',') {
                out.extend(lowercase_head(item));
            }
        }
        inside = inside + code.matches('{').count() - code.matches('}').count().min(inside);
        if code.starts_with("};") {
            inside = 0;
        }
    }
    out
}

/// The module graph of the crate whose sources are under `src`.
pub fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let m = module_of(src, &f);
        if m == "lib" || m == "main" || m == "bin" {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        // Test modules may reach anywhere.
        let text = text.split("#[cfg(test)]\nmod tests {").next().unwrap_or("");
        let mut named = modules_named(text);
        named.extend(multiline_groups(text));
        let entry = g.entry(m.clone()).or_default();
        for n in named {
            if n != m && n != "ffi" {
                entry.insert(n);
            }
        }
    }
    g
}

/// Each circle of `g` once, as the modules along it.
pub fn circles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut found: BTreeSet<Vec<String>> = BTreeSet::new();
    for start in g.keys() {
        // Depth-first from `start`, reporting paths back to it through larger names only, so
        // that each circle is found from its smallest module.
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        while let Some((at, path)) = stack.pop() {
            for next in g.get(&at).into_iter().flatten() {
                if next == start {
                    found.insert(path.clone());
                } else if next > start && !path.contains(next) && path.len() < 8 {
                    let mut p = path.clone();
                    p.push(next.clone());
                    stack.push((next.clone(), p));
                }
            }
        }
    }
    found.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_read_from_uses_and_paths() {
        let text = "use crate::a::X;\nuse crate::{b::Y, c, Error};\nlet x = crate::d::f(); // crate::e\nuse crate::Result;\nuse crate::{\n    f::{G, H},\n    Z,\n};\n";
        let mut named = modules_named(text);
        named.extend(multiline_groups(text));
        let got: Vec<_> = named.into_iter().collect();
        assert_eq!(got, ["a", "b", "c", "d", "f"]);
    }

    #[test]
    fn a_circle_is_found_once() {
        let mut g = BTreeMap::new();
        for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
            g.entry(a.to_owned())
                .or_insert_with(BTreeSet::new)
                .insert(b.to_owned());
        }
        assert_eq!(circles(&g), vec![vec!["a", "b", "c"]]);
    }

    #[test]
    fn no_library_crate_has_an_import_circle() {
        let root = crate::repo_root();
        let mut report = Vec::new();
        for krate in ["verbs-core", "notify", "transport", "msg", "tokio", "rdmsg"] {
            let g = graph(&root.join(krate).join("src"));
            for c in circles(&g) {
                report.push(format!("{krate}: {}", c.join(" -> ")));
            }
        }
        assert!(report.is_empty(), "import circles:\n{}", report.join("\n"));
    }
}
