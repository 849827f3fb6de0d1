//! A subscriber that records `tracing` events, for the tests of the layers' `tracing` feature
//! (feature `tracing` of this crate).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};

/// One event as it was emitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// Its level.
    pub level: Level,
    /// Its target (the emitting module's path by default).
    pub target: String,
    /// Its message (the `message` field).
    pub message: String,
    /// Its other fields, as `Debug` prints them.
    pub fields: BTreeMap<String, String>,
}

impl Recorded {
    /// The field `name`, as `Debug` printed it.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields.get(name).map(String::as_str)
    }
}

/// Records every event (and counts spans) while it is the thread's default subscriber.
#[derive(Debug, Default)]
struct Recorder {
    events: Arc<Mutex<Vec<Recorded>>>,
    spans: AtomicU64,
}

#[derive(Default)]
struct Fields {
    message: String,
    fields: BTreeMap<String, String>,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            self.fields
                .insert(field.name().to_owned(), format!("{value:?}"));
        }
    }
}

impl Subscriber for Recorder {
    fn register_callsite(&self, _: &'static Metadata<'static>) -> Interest {
        // Asked at every event: other tests' threads run without this subscriber.
        Interest::sometimes()
    }

    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(self.spans.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut f = Fields::default();
        event.record(&mut f);
        let meta = event.metadata();
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Recorded {
                level: *meta.level(),
                target: meta.target().to_owned(),
                message: f.message,
                fields: f.fields,
            });
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

/// Runs `f` on this thread with a subscriber that records every event: what `f` returned,
/// and the events in the order they came.
pub fn recording<R>(f: impl FnOnce() -> R) -> (R, Vec<Recorded>) {
    let recorder = Recorder::default();
    let events = recorder.events.clone();
    let out = tracing::subscriber::with_default(recorder, f);
    let events = std::mem::take(&mut *events.lock().unwrap_or_else(PoisonError::into_inner));
    (out, events)
}
