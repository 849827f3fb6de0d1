//! `cargo xtask test` leaves the work tree as it found it: `git status` at the start of the run
//! and at its end are compared. Entries already there at the start are the developer's own
//! uncommitted work and never count against the run.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};

/// `git status --porcelain` of the work tree (untracked files listed one by one): status
/// letters by path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot(BTreeMap<String, String>);

impl Snapshot {
    /// The work tree's status, or `None` where `repo` is no git work tree (or git is missing).
    pub fn take(repo: &Path) -> Option<Self> {
        let out = Command::new("git")
            .args([
                "status",
                "--porcelain=v1",
                "-z",
                "--untracked-files=all",
                "--ignore-submodules=none",
            ])
            .current_dir(repo)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| Self::parse(&String::from_utf8_lossy(&out.stdout)))
    }

    /// Parses `git status --porcelain=v1 -z`: `XY path` entries separated by NULs; a rename or
    /// copy is followed by its source path, which is skipped.
    fn parse(z: &str) -> Self {
        let mut entries = BTreeMap::new();
        let mut fields = z.split('\0').filter(|f| !f.is_empty());
        while let Some(field) = fields.next() {
            let (Some(xy), Some(path)) = (field.get(..2), field.get(3..)) else {
                continue;
            };
            if xy.contains('R') || xy.contains('C') {
                fields.next();
            }
            entries.insert(path.to_owned(), xy.to_owned());
        }
        Self(entries)
    }

    /// Nothing uncommitted.
    pub fn is_clean(&self) -> bool {
        self.0.is_empty()
    }
}

/// What a run left in the work tree.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Entries for paths that were clean when the run started (`?? path`, ` M path`): files
    /// the run created or changed. These fail the check.
    pub new: Vec<String>,
    /// Paths already uncommitted at the start whose status differs now (reported only: the
    /// developer may be working on them).
    pub changed: Vec<String>,
}

/// Compares the status at the end of a run with the one at its start.
pub fn compare(before: &Snapshot, after: &Snapshot) -> Changes {
    let mut changes = Changes::default();
    for (path, xy) in &after.0 {
        match before.0.get(path) {
            None => changes.new.push(format!("{xy} {path}")),
            Some(was) if was != xy => changes.changed.push(format!("{xy} {path} (was {was})")),
            Some(_) => {}
        }
    }
    changes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn porcelain_z_is_read_by_path() {
        let s = Snapshot::parse(" M Cargo.lock\0?? a b/c\0R  new.rs\0old.rs\0A  x\0");
        let paths: Vec<&str> = s.0.keys().map(String::as_str).collect();
        assert_eq!(paths, ["Cargo.lock", "a b/c", "new.rs", "x"]);
        assert_eq!(s.0["new.rs"], "R ");
        assert!(Snapshot::parse("").is_clean());
    }

    #[test]
    fn only_paths_clean_at_the_start_count() {
        let before = Snapshot::parse(" M README.md\0?? notes.txt\0");
        let after = Snapshot::parse(
            " M README.md\0MM notes.txt\0?? msg/fuzz/corpus/decode/abc\0 M Cargo.lock\0",
        );
        let c = compare(&before, &after);
        assert_eq!(
            c.new,
            [" M Cargo.lock", "?? msg/fuzz/corpus/decode/abc"].map(String::from)
        );
        assert_eq!(c.changed, ["MM notes.txt (was ??)"].map(String::from));
        assert_eq!(compare(&after, &after), Changes::default());
    }
}
