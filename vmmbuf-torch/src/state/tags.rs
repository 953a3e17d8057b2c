//! Tags: the name each thread's allocations are made under (an arena per
//! tag and device), and the process's default for threads that set none.

#[cfg(feature = "python")]
use super::all_devices;

thread_local! {
    /// The tag this thread's allocations are made under ("" for none): per
    /// thread, as `torch.cuda.use_mem_pool` scopes are; `None` until the
    /// thread sets one, then [`DEFAULT_TAG`] applies.
    static TAG: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// The tag of every thread that set none ("" for none):
/// torch_memory_saver's `TMS_INIT_ENABLE`, where every allocation of the
/// process is pausable, autograd's threads' included.
static DEFAULT_TAG: parking_lot::RwLock<String> = parking_lot::const_rwlock(String::new());

/// Whether [`DEFAULT_TAG`] is not "" (read without its lock on every
/// malloc).
static HAS_DEFAULT_TAG: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Every tag that has memory (an arena) on some device, sorted, once each.
#[cfg(feature = "python")]
pub(crate) fn tags() -> Vec<String> {
    let mut v: Vec<String> = all_devices()
        .into_iter()
        .flat_map(|(_, d)| d.lock().arenas.keys().cloned().collect::<Vec<_>>())
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The tag of this thread's allocations ("" for none).
pub(crate) fn tag() -> String {
    use std::sync::atomic::Ordering::Relaxed;
    // A thread being torn down (its thread-locals destroyed) frees and
    // allocates under no tag.
    match TAG.try_with(|t| t.borrow().clone()) {
        Ok(Some(t)) => t,
        Ok(None) if HAS_DEFAULT_TAG.load(Relaxed) => DEFAULT_TAG.read().clone(),
        _ => String::new(),
    }
}

/// Makes `tag` the tag of every thread that has not set its own ("" for
/// none).
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn set_default_tag(tag: &str) {
    let mut d = DEFAULT_TAG.write();
    tag.clone_into(&mut d);
    HAS_DEFAULT_TAG.store(!tag.is_empty(), std::sync::atomic::Ordering::Relaxed);
}

/// Makes `tag` the tag of this thread's allocations ("" for none).
pub(crate) fn set_tag(tag: &str) {
    // During the thread's teardown there is no tag to set.
    let _ = TAG.try_with(|t| *t.borrow_mut() = Some(tag.to_owned()));
}
