//! Completion-notification policy for rdmsg: when to arm a completion queue, how to drain it.
//!
//! Not yet implemented beyond this placeholder; see the project's issue tracker.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
