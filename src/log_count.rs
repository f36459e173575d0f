//! Test support: how many warnings a piece of code logs (a remote party must not be able to
//! cause one per message).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tracing_subscriber::layer::{Context, SubscriberExt};

struct Count(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Count {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::WARN {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The WARN events logged while `f` runs on this thread.
pub fn warnings(f: impl FnOnce()) -> usize {
    let n = Arc::new(AtomicUsize::new(0));
    let subscriber = tracing_subscriber::registry().with(Count(n.clone()));
    tracing::subscriber::with_default(subscriber, f);
    n.load(Ordering::Relaxed)
}
