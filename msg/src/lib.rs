//! Framed, typed messages for rdmsg, where the sender decides per message who wakes up.
//!
//! Not yet implemented beyond this placeholder; see the project's issue tracker.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
