//! rdmsg's benchmarks: each figure measured side by side with an anchor in the same run
//! (perftest on the same device, a raw verbs-core stream, busy polling, plain bincode), and the
//! report that turns rounds of samples into medians, ratios and goals.
//!
//! `cargo xtask bench` runs [`runner`] inside the Soft-RoCE VM, the codec rounds on the host,
//! then [`report`] and [`chart`] on the host; see DEVELOPING.md (Benchmarks).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod asynch;
pub mod callgrind;
pub mod chart;
pub mod codec;
pub mod collector;
pub mod connect;
pub mod cost;
pub mod fanin;
pub mod large;
pub mod perftest;
pub mod rdmsg;
pub mod report;
pub mod runner;
pub mod sample;
pub mod verbs;

pub use sample::{Bench, Sample};

/// The result of a measuring thread; a panic in it goes on in the caller.
pub(crate) fn join<T>(handle: std::thread::JoinHandle<anyhow::Result<T>>) -> anyhow::Result<T> {
    handle
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// A program built next to this one (the examples, in the same target directory).
pub(crate) fn sibling_program(name: &str) -> anyhow::Result<String> {
    let exe = std::env::current_exe().map_err(|e| anyhow::anyhow!("locating rdmsg-bench: {e}"))?;
    let path = exe.with_file_name(name);
    if !path.exists() {
        anyhow::bail!(
            "{} not found: build it (cargo build --release -p rdmsg-examples --bin {name}; \
             cargo xtask bench does)",
            path.display()
        );
    }
    Ok(path.to_string_lossy().into_owned())
}
