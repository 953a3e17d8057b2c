//! The registry's and the capture count's own tests.

use super::Captures;

/// A default tag reaches every thread that set none (a new thread
/// included), not one that set its own ("" too), and goes with "".
#[test]
fn a_default_tag_reaches_threads_that_set_none() {
    super::set_default_tag("default");
    let seen = std::thread::spawn(|| {
        let first = super::tag();
        super::set_tag("");
        (first, super::tag())
    })
    .join()
    .unwrap();
    super::set_default_tag("");
    assert_eq!(seen, ("default".to_owned(), String::new()));
    assert_eq!(std::thread::spawn(super::tag).join().unwrap(), "");
}

/// A free (and a tag, a last error) from a thread-local destructor that
/// runs after the plug-in's own thread-locals were destroyed, as at a
/// torchrun worker's exit: no panic, a typed answer. Without
/// `try_with`, every one of these panicked ("cannot access a Thread
/// Local Storage value during or after destruction").
#[test]
fn calls_from_a_dying_threads_destructors_do_not_panic() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    static PANICS: AtomicUsize = AtomicUsize::new(0);
    struct Late;
    impl Drop for Late {
        fn drop(&mut self) {
            CALLS.fetch_add(1, Ordering::SeqCst);
            let r = std::panic::catch_unwind(|| {
                assert_eq!(super::tag(), "", "no tag during teardown");
                super::set_tag("late");
                let e =
                    super::free(0x1000, 0, std::ptr::null_mut()).expect_err("an unknown pointer");
                assert!(e.to_string().contains("not a live allocation"), "{e}");
                crate::capi::vmmbuf_free(0x1000 as *mut _, 8, 0, std::ptr::null_mut());
                let _ = crate::capi::vmmbuf_last_error();
                let _ = crate::capi::vmmbuf_stats_json(0);
            });
            if r.is_err() {
                PANICS.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    thread_local! {
        static LATE: std::cell::RefCell<Option<Late>> = const { std::cell::RefCell::new(None) };
    }
    std::thread::spawn(|| {
        // Registered first, destroyed after the plug-in's own.
        LATE.with(|l| *l.borrow_mut() = Some(Late));
        super::set_tag("worker");
        assert_eq!(super::tag(), "worker");
        assert!(super::free(0x1000, 0, std::ptr::null_mut()).is_err());
        crate::capi::vmmbuf_free(0x1000 as *mut _, 8, 0, std::ptr::null_mut());
        assert!(!crate::capi::vmmbuf_last_error().is_null());
    })
    .join()
    .unwrap();
    assert_eq!(CALLS.load(Ordering::SeqCst), 1, "the destructor ran");
    assert_eq!(
        PANICS.load(Ordering::SeqCst),
        0,
        "a call panicked in teardown"
    );
}

#[test]
fn captures_are_asked_about_until_announced_and_while_one_is_under_way() {
    // A local instance: the process's own is shared with GPU tests.
    let c = Captures::new();
    assert!(c.may_capture(), "not announced: every call asks");
    c.begins();
    c.ends().unwrap();
    assert!(c.may_capture(), "counting alone does not announce");
    c.announce(true);
    assert!(!c.may_capture());
    assert_eq!(c.state(), (true, 0));
    c.begins();
    c.begins();
    assert!(c.may_capture());
    c.ends().unwrap();
    assert!(c.may_capture(), "one of two still under way");
    c.ends().unwrap();
    assert!(!c.may_capture());
    // An end too many is refused and leaves the count at 0 (not
    // wrapped round to a huge number, which would also ask: refused
    // loudly instead).
    assert!(c.ends().is_err());
    assert_eq!(c.state(), (true, 0));
    c.begins();
    assert_eq!(c.state(), (true, 1));
    assert!(c.may_capture());
    c.ends().unwrap();
    assert!(!c.may_capture());
    c.announce(false);
    assert!(c.may_capture(), "announcing off: every call asks again");
}
