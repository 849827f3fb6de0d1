//! RC connections, self-refilling receive pools and credit-based flow control for rdmsg.
//!
//! Not yet implemented beyond this placeholder; see the project's issue tracker.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
