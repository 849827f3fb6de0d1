//! What a user of the published crates gets: the packaging check (`cargo package` of the
//! publishable crates, each verified by building it from its packaged sources) and the scratch
//! project (the README's quick start, built outside the workspace against the facade crate
//! next to an unrelated crates.io crate that is also called `notify`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context, Result};

use crate::{cargo, repo_root, run, Step};

/// The crates published to crates.io, each after the ones it depends on. cargo (1.90 and newer)
/// packages them together, resolving their dependencies on one another through a temporary
/// local registry of the packages just made rather than on crates.io.
pub const PUBLISHED: &[&str] = &[
    "rdmsg-verbs",
    "rdmsg-notify",
    "rdmsg-transport",
    "rdmsg-msg",
    "rdmsg-tokio",
    "rdmsg",
];

/// Runs `cargo package` for [`PUBLISHED`] (no upload) and returns the `.crate` files it wrote,
/// with their sizes. `allow_dirty`: the work tree had uncommitted changes when the run started
/// (a developer's edits); cargo refuses to package those without `--allow-dirty`, and a clean
/// clone (CI) is packaged without it.
pub fn package(allow_dirty: bool) -> Result<Vec<(PathBuf, u64)>> {
    let check_dir = repo_root().join(CHECK_DIR);
    let check_dir_arg = check_dir.to_string_lossy().into_owned();
    let mut args = vec!["package", "--target-dir", &check_dir_arg];
    for p in PUBLISHED {
        args.extend(["-p", p]);
    }
    if allow_dirty {
        args.push("--allow-dirty");
    }
    let _s = Step::new("package", &format!("cargo {}", args.join(" ")));
    if allow_dirty {
        eprintln!("==> [package] the work tree has uncommitted changes: packaged as they are (--allow-dirty)");
    }
    // What this run wrote: older .crate files may lie beside (a second of slack for coarse
    // file-system clocks).
    let started = SystemTime::now() - Duration::from_secs(1);
    forget_stale_local_registry_sources();
    forget_builds_of_ours(&check_dir);
    run(cargo().args(&args)).context("packaging the publishable crates")?;
    let dir = check_dir.join("package");
    let mut crates: Vec<(PathBuf, u64)> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".crate"))
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            (m.modified().ok()? >= started).then(|| (e.path(), m.len()))
        })
        .collect();
    crates.sort();
    if crates.len() != PUBLISHED.len() {
        bail!(
            "cargo package wrote {} .crate files to {}, expected {}",
            crates.len(),
            dir.display(),
            PUBLISHED.len()
        );
    }
    Ok(crates)
}

/// Where `cargo package` builds the crates it verifies, and writes them (`package/`): a target
/// directory of its own, so that [`forget_builds_of_ours`] touches nothing else.
const CHECK_DIR: &str = "target/package-check";

/// Makes `cargo package` rebuild our crates when it verifies them. It builds each from the
/// temporary registry, whose sources all carry one fixed modification time (2006): to cargo
/// an old build of a dependency of ours from there is up to date, and a crate using an API
/// added since fails to compile against it. Forgetting our crates' fingerprints in the
/// verification's own target directory forces that rebuild; the other dependencies stay built.
fn forget_builds_of_ours(target_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(target_dir.join("debug/.fingerprint")) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if PUBLISHED.iter().any(|p| name.starts_with(&format!("{p}-"))) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Removes what cargo extracted from earlier runs' temporary local registries: it keys them by
/// the registry's path (the same `tmp-registry` every run) and by crate name and
/// version (ours stay 0.1.0), and reuses an extracted directory rather than unpacking the new
/// `.crate`. Without this, a crate is verified against a dependency's sources of an earlier run
/// and fails on any API added since. Only local registries (directories named `-<hash>`, no
/// host) are touched.
fn forget_stale_local_registry_sources() {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")));
    let Some(home) = home else { return };
    for kind in ["src", "cache"] {
        let Ok(registries) = std::fs::read_dir(home.join("registry").join(kind)) else {
            continue;
        };
        for reg in registries.flatten() {
            if !reg.file_name().to_string_lossy().starts_with('-') {
                continue;
            }
            let Ok(entries) = std::fs::read_dir(reg.path()) else {
                continue;
            };
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let ours = PUBLISHED.iter().any(|p| name.starts_with(&format!("{p}-")));
                if ours {
                    let path = e.path();
                    let _ = if path.is_dir() {
                        std::fs::remove_dir_all(&path)
                    } else {
                        std::fs::remove_file(&path)
                    };
                }
            }
        }
    }
}

/// `12.3 KiB`.
pub fn kib(bytes: u64) -> String {
    format!("{:.1} KiB", bytes as f64 / 1024.0)
}

/// The README's quick start: the first fenced code block whose info string starts with `rust`
/// (```` ```rust ````, ```` ```rust,no_run ````), verbatim; `None` if there is none or it is not
/// closed.
pub fn quickstart_block(readme: &str) -> Option<String> {
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        let Some((open, info)) = fence(line) else {
            continue;
        };
        let mut body = String::new();
        for l in lines.by_ref() {
            if fence(l).is_some_and(|(f, rest)| {
                f.starts_with(&open[..1]) && f.len() >= open.len() && rest.is_empty()
            }) {
                if info.starts_with("rust") {
                    return Some(body);
                }
                break;
            }
            body.push_str(l);
            body.push('\n');
        }
        if info.starts_with("rust") {
            return None;
        }
    }
    None
}

/// A code fence (up to three spaces, then three or more backticks or tildes): the fence and
/// the info string after it, trimmed.
fn fence(line: &str) -> Option<(&str, &str)> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    if indent > 3 {
        return None;
    }
    let l = &line[indent..];
    let c = l.chars().next().filter(|c| *c == '`' || *c == '~')?;
    let n = l.len() - l.trim_start_matches(c).len();
    (n >= 3).then(|| (&l[..n], l[n..].trim()))
}

/// Where the scratch project lives: `target/scratch/app`, built into `target/scratch/target`.
#[derive(Debug)]
pub struct Scratch {
    pub app: PathBuf,
    pub target_dir: PathBuf,
}

/// The package name, hence the binary's.
const SCRATCH_NAME: &str = "rdmsg-quickstart";

impl Scratch {
    pub fn new(repo: &Path) -> Self {
        Self {
            app: repo.join("target/scratch/app"),
            target_dir: repo.join("target/scratch/target"),
        }
    }

    /// The built program.
    pub fn binary(&self) -> PathBuf {
        self.target_dir.join("debug").join(SCRATCH_NAME)
    }
}

/// A TOML basic string.
fn toml_str(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The scratch project's Cargo.toml: its own workspace (so that cargo does not take it for a
/// member of ours, whose directory it sits in), the facade by path, serde, and crates.io's
/// `notify`.
fn scratch_manifest(facade: &Path) -> String {
    format!(
        r#"# Written by `cargo xtask test`: a user's project, outside the rdmsg workspace, whose
# program is the README's quick start. Rewritten on every run.
[package]
name = "{SCRATCH_NAME}"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
rdmsg = {{ path = {facade} }}
serde = {{ version = "1", features = ["derive"] }}
# The file-system events crate: a name rdmsg also uses for a layer (`rdmsg::notify`).
notify = "8"

# A workspace of its own, not a member of the one around it.
[workspace]
"#,
        facade = toml_str(&facade.to_string_lossy()),
    )
}

/// Appended to the quick start: names crates.io's `notify` (`::notify`: the crate, whatever
/// the quick start imports under that name), so that both crates are used by one program.
const APPENDIX: &str = "
// Appended by `cargo xtask test`: crates.io's `notify` (file-system events) in the same program.
#[allow(dead_code)]
fn file_events_too() -> ::notify::Result<::notify::RecommendedWatcher> {
    ::notify::recommended_watcher(|_res: ::notify::Result<::notify::Event>| {})
}
";

/// Writes the scratch project from `readme` (a fresh lockfile each time: what a new user would
/// resolve) and builds it on the host; returns the binary to run in the VM.
pub fn build_scratch(repo: &Path, readme: &Path) -> Result<PathBuf> {
    let s = Scratch::new(repo);
    let text =
        std::fs::read_to_string(readme).with_context(|| format!("reading {}", readme.display()))?;
    let block = quickstart_block(&text).with_context(|| {
        format!(
            "{} has no fenced code block whose info string starts with `rust` (the quick start)",
            readme.display()
        )
    })?;
    let manifest = scratch_manifest(&repo.join("rdmsg"));
    std::fs::create_dir_all(s.app.join("src"))?;
    std::fs::write(s.app.join("Cargo.toml"), &manifest)?;
    std::fs::write(s.app.join("src/main.rs"), format!("{block}{APPENDIX}"))?;
    let _ = std::fs::remove_file(s.app.join("Cargo.lock"));
    print!("{}", closing_note(&manifest, &block));
    let _s = Step::new(
        "quickstart",
        &format!(
            "building the README's quick start outside the workspace ({}, target dir {})",
            rel(repo, &s.app),
            rel(repo, &s.target_dir)
        ),
    );
    run(cargo()
        .current_dir(&s.app)
        .arg("build")
        .arg("--manifest-path")
        .arg(s.app.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&s.target_dir))
    .with_context(|| {
        format!(
            "building the quick start in {} (its program is the README's first ```rust block)",
            s.app.display()
        )
    })?;
    Ok(s.binary())
}

/// The scratch project's `[dependencies]` and the quick start's `use` lines.
fn closing_note(manifest: &str, main_rs: &str) -> String {
    let mut note = String::from("quickstart project: [dependencies]\n");
    for l in manifest
        .lines()
        .skip_while(|l| l.trim() != "[dependencies]")
        .skip(1)
        .take_while(|l| !l.trim_start().starts_with('['))
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
    {
        let _ = writeln!(note, "  {l}");
    }
    note.push_str("quickstart project: use lines of src/main.rs\n");
    for l in main_rs.lines().filter(|l| {
        let t = l.trim_start();
        t.starts_with("use ") || t.starts_with("pub use ")
    }) {
        let _ = writeln!(note, "  {}", l.trim());
    }
    note
}

fn rel(repo: &Path, p: &Path) -> String {
    p.strip_prefix(repo).unwrap_or(p).display().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_rust_block_is_the_quick_start() {
        let readme = "# x\n\n```sh\ncargo xtask test\n```\n\n```rust,no_run\nuse rdmsg::msg;\n\n    fn main() {}\n```\n\n```rust\nfn other() {}\n```\n";
        assert_eq!(
            quickstart_block(readme).as_deref(),
            Some("use rdmsg::msg;\n\n    fn main() {}\n")
        );
        assert_eq!(
            quickstart_block("````rust\n```\nstill code\n````\n").as_deref(),
            Some("```\nstill code\n")
        );
        assert_eq!(
            quickstart_block("~~~ rust\nfn main() {}\n~~~\n").as_deref(),
            Some("fn main() {}\n")
        );
        assert_eq!(quickstart_block("```sh\nls\n```\n"), None);
        assert_eq!(
            quickstart_block("```rust\nfn main() {}\n"),
            None,
            "unclosed"
        );
        assert_eq!(
            quickstart_block("    ```rust\nindented: code\n    ```\n"),
            None
        );
    }

    #[test]
    fn the_scratch_manifest_is_its_own_workspace() {
        let m = scratch_manifest(Path::new("/r \"q\"/rdmsg"));
        assert!(m.contains(r#"rdmsg = { path = "/r \"q\"/rdmsg" }"#), "{m}");
        assert!(m.contains("\nnotify = \"8\"\n"));
        assert!(m.trim_end().ends_with("[workspace]"));
        let note = closing_note(
            &m,
            "use rdmsg::{msg, transport};\nfn main() {\n    use std::io;\n}\n",
        );
        assert_eq!(
            note,
            "quickstart project: [dependencies]\n  rdmsg = { path = \"/r \\\"q\\\"/rdmsg\" }\n  serde = { version = \"1\", features = [\"derive\"] }\n  notify = \"8\"\nquickstart project: use lines of src/main.rs\n  use rdmsg::{msg, transport};\n  use std::io;\n"
        );
    }

    /// The README's quick start is what the scratch project runs: a whole program.
    #[test]
    fn the_readme_has_a_quick_start_program() {
        let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
        let block = quickstart_block(&readme).expect("a ```rust block in README.md");
        assert!(block.contains("fn main("), "{block}");
    }

    #[test]
    fn the_published_crates_come_after_their_dependencies() {
        assert_eq!(PUBLISHED.first(), Some(&"rdmsg-verbs"));
        assert_eq!(
            PUBLISHED.last(),
            Some(&"rdmsg"),
            "the facade depends on all"
        );
    }
}
