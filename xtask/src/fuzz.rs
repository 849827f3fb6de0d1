//! The frame decoder's fuzz target (`msg/fuzz`, cargo-fuzz): a timed run in `cargo xtask test`
//! and `cargo xtask fuzz-merge`.
//!
//! The corpus kept in git (`msg/fuzz/corpus/decode`) only grows by choice: a run reads it as a
//! seed directory but writes what it finds to a working corpus under `target/fuzz` (libFuzzer
//! writes new inputs to the first corpus directory it is given and only reads the others), and
//! failing inputs go to `target/fuzz/artifacts/decode/`. `fuzz-merge` folds the working corpus
//! into the kept one, adding only inputs that reach new coverage.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::SystemTime;

use anyhow::{bail, Context, Result};

use crate::{cargo, repo_root, run, Step};

/// The fuzz target's name in `msg/fuzz/Cargo.toml`.
const TARGET: &str = "decode";

/// Where the fuzz target's inputs live.
#[derive(Debug)]
struct Dirs {
    /// The corpus kept in git, read as a seed directory.
    kept: PathBuf,
    /// The working corpus under `target/`, where a run writes the inputs it finds.
    work: PathBuf,
    /// Where libFuzzer writes inputs that crash, leak or time out.
    artifacts: PathBuf,
}

fn dirs(repo: &Path) -> Dirs {
    Dirs {
        kept: repo.join("msg/fuzz/corpus").join(TARGET),
        work: repo.join("target/fuzz/corpus").join(TARGET),
        artifacts: repo.join("target/fuzz/artifacts").join(TARGET),
    }
}

/// libFuzzer's `-artifact_prefix=`: it concatenates, so a directory needs its trailing slash.
/// cargo-fuzz passes its own (`msg/fuzz/artifacts/decode/`) first; libFuzzer takes the last.
fn artifact_arg(dir: &Path) -> String {
    format!("-artifact_prefix={}/", dir.display())
}

/// `cargo fuzz run decode` in `msg/`; `RUSTC_BOOTSTRAP=1` allows the nightly `-Z` sanitizer
/// flags cargo-fuzz needs on the stable toolchain.
fn fuzz_run(repo: &Path) -> Command {
    let mut c = cargo();
    c.current_dir(repo.join("msg"))
        .env("RUSTC_BOOTSTRAP", "1")
        .args(["fuzz", "run", TARGET]);
    c
}

/// Installs cargo-fuzz if it is missing.
fn ensure_cargo_fuzz() -> Result<()> {
    let has_fuzz = cargo()
        .args(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_fuzz {
        let _s = Step::new("fuzz", "installing cargo-fuzz (first run only)");
        run(cargo().args(["install", "cargo-fuzz", "--locked"]))?;
    }
    Ok(())
}

/// Files in `dir` (none if it does not exist), sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// A path relative to the repository, for messages.
fn rel(repo: &Path, p: &Path) -> String {
    p.strip_prefix(repo).unwrap_or(p).display().to_string()
}

/// Fuzzes the frame decoder for `secs` seconds over the kept corpus (read only) and the working
/// corpus (written). On failure the error names the inputs left in `target/fuzz/artifacts/decode/`
/// and how to replay one.
pub fn fuzz_decoder(secs: u64) -> Result<()> {
    ensure_cargo_fuzz()?;
    let repo = repo_root();
    let d = dirs(&repo);
    std::fs::create_dir_all(&d.work)?;
    std::fs::create_dir_all(&d.artifacts)?;
    let _s = Step::new(
        "fuzz",
        &format!(
            "fuzzing the frame decoder for {secs} s (msg/fuzz; seeds {}, new inputs to {})",
            rel(&repo, &d.kept),
            rel(&repo, &d.work)
        ),
    );
    let started = SystemTime::now();
    let status = fuzz_run(&repo)
        // The written corpus first, then the kept one, which libFuzzer only reads.
        .arg(&d.work)
        .arg(&d.kept)
        .arg("--")
        .arg(format!("-max_total_time={secs}"))
        .arg("-print_final_stats=1")
        .arg(artifact_arg(&d.artifacts))
        .status()
        .context("starting cargo fuzz")?;
    if status.success() {
        return Ok(());
    }
    let found: Vec<PathBuf> = files(&d.artifacts)
        .into_iter()
        .filter(|p| {
            p.metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= started)
        })
        .collect();
    let Some(first) = found.first() else {
        bail!(
            "cargo fuzz failed ({status}) and left no input in {}/: did msg/fuzz build?",
            rel(&repo, &d.artifacts)
        );
    };
    let names: Vec<String> = found.iter().map(|p| rel(&repo, p)).collect();
    bail!(
        "the decoder fuzzer found {} failing input(s) in {}/: {}\n  replay one with: cd msg && RUSTC_BOOTSTRAP=1 cargo fuzz run {TARGET} {}",
        found.len(),
        rel(&repo, &d.artifacts),
        names.join(", "),
        first.display()
    )
}

/// `cargo xtask fuzz-merge`: merges the working corpus into the kept one (`-merge=1`, kept
/// directory first), which gains only the inputs that reach new coverage; lists what it added.
pub fn fuzz_merge() -> Result<ExitCode> {
    ensure_cargo_fuzz()?;
    let repo = repo_root();
    let d = dirs(&repo);
    let work = files(&d.work);
    if work.is_empty() {
        eprintln!(
            "==> [fuzz-merge] {} is empty: nothing to merge (`cargo xtask test` fills it)",
            rel(&repo, &d.work)
        );
        return Ok(ExitCode::SUCCESS);
    }
    std::fs::create_dir_all(&d.artifacts)?;
    let before = files(&d.kept);
    {
        let _s = Step::new(
            "fuzz-merge",
            &format!(
                "merging {} inputs of {} into {} ({} inputs)",
                work.len(),
                rel(&repo, &d.work),
                rel(&repo, &d.kept),
                before.len()
            ),
        );
        run(fuzz_run(&repo)
            .arg(&d.kept)
            .arg(&d.work)
            .arg("--")
            .arg("-merge=1")
            .arg(artifact_arg(&d.artifacts)))
        .context("merging the fuzz corpus")?;
    }
    let added: Vec<PathBuf> = files(&d.kept)
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    if added.is_empty() {
        eprintln!(
            "==> [fuzz-merge] no input of the working corpus adds coverage: {} unchanged",
            rel(&repo, &d.kept)
        );
    } else {
        for p in &added {
            println!("{}", rel(&repo, p));
        }
        eprintln!(
            "==> [fuzz-merge] {} new inputs in {} (listed above): review and commit them",
            added.len(),
            rel(&repo, &d.kept)
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_working_corpus_and_artifacts_live_under_target() {
        let d = dirs(Path::new("/r"));
        assert_eq!(d.kept, Path::new("/r/msg/fuzz/corpus/decode"));
        assert_eq!(d.work, Path::new("/r/target/fuzz/corpus/decode"));
        assert_eq!(
            artifact_arg(&d.artifacts),
            "-artifact_prefix=/r/target/fuzz/artifacts/decode/"
        );
    }
}
