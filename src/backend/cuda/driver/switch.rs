//! The context-switch hook of the driver layer: every place in vmmbuf that
//! may change the calling thread's current CUDA context calls
//! [`before_switch`] first, so that a lazy guard (`probe`'s
//! `KeepCurrentContext::lazy`) can save the caller's context before vmmbuf's
//! first switch. Kept here, beside the calls that switch, so the driver
//! layer depends on nothing above it.

thread_local! {
    /// This thread's lazy guard (see `KeepCurrentContext::lazy` in `probe`): `None`
    /// when none is armed; `Some(None)` armed, nothing switched yet;
    /// `Some(Some(ctx))` the caller's context, saved before vmmbuf's first
    /// switch.
    pub(crate) static LAZY: std::cell::Cell<Option<Option<usize>>> = const { std::cell::Cell::new(None) };
}

/// Called by every place in vmmbuf that may change this thread's current
/// context, before it may: while a lazy guard is armed and has saved
/// nothing yet, the context current now (the caller's, since nothing has
/// switched it) is saved for the guard to put back.
pub(crate) fn before_switch() {
    let _ = LAZY.try_with(|l| {
        if l.get() == Some(None) && super::driver_present() {
            match super::current_raw() {
                Ok(c) => l.set(Some(Some(c as usize))),
                Err(e) => {
                    tracing::warn!(error = %e, "vmmbuf: reading the current CUDA context failed")
                }
            }
        }
    });
}
