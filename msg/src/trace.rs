//! The events of the `tracing` feature, and the macro that compiles to nothing without it.
//!
//! Rendezvous, where the receiving side reads what the sender lent (`peer/send.rs`,
//! `peer/receive.rs`): a message `lent by rendezvous` (debug), a `rendezvous read started`
//! and `rendezvous read finished` (debug), a `rendezvous read refused` (no memory to read
//! into, more pieces than a send queue holds, a descriptor too large or one too many: warn)
//! and `rendezvous read failed` (the read completed in error: warn). Each names its message
//! (`seq`, `tag`) and its length (`bytes`), except the reads a failed connection abandons,
//! reported once with how many were `waiting` and `reading`. Events do not name a hub's peer:
//! the transport's events about it (connects, closes, failures, credit stalls), which come
//! with the same feature, do.

/// `tracing::event!` at `tracing::Level::$level` with the `tracing` feature; nothing without
/// it (its arguments are not even compiled).
macro_rules! trace_event {
    ($level:ident, $($rest:tt)+) => {{
        #[cfg(feature = "tracing")]
        ::tracing::event!(::tracing::Level::$level, $($rest)+);
    }};
}

pub(crate) use trace_event;
