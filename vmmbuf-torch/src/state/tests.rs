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
    // A local instance (its count is the process's: no other unit test
    // announces a capture).
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

/// A free under a capture whose fallible steps fail (the graph's release
/// callback, `cuUserObjectCreate`; a fence on the allocation's own stream)
/// changes nothing: the allocation stays live, never freed as an ordinary
/// block that the graph may use; freed again once the steps pass, it is
/// the graph's until CUDA destroys the graph. Needs a GPU (skips with the
/// reason without one, fails then under `VMMBUF_REQUIRE_GPU=1`). Runs in a
/// child process: the plug-in's device is process-wide, and other tests
/// set its budget before its first allocation.
#[test]
fn a_free_whose_capture_steps_fail_leaves_the_allocation_live() {
    in_child("capture_steps_child", "capture steps: checked");
}

/// Runs the ignored test `child` of this module in a child process (the
/// plug-in's device is process-wide, and other tests set its budget
/// before its first allocation) and asserts that it passed, saying
/// `marker`. Needs a GPU: skips with the reason without one, fails then
/// under `VMMBUF_REQUIRE_GPU=1`.
fn in_child(child: &str, marker: &str) {
    if let Err(e) = vmmbuf::CudaBackend::new(0) {
        assert!(
            std::env::var("VMMBUF_REQUIRE_GPU").as_deref() != Ok("1"),
            "no GPU: {e}"
        );
        eprintln!("skipped: needs a GPU ({e})");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &format!("state::tests::{child}"),
            "--ignored",
            "--nocapture",
        ])
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && said.contains(marker),
        "the child failed: {said}"
    );
}

/// Captures that name one PyTorch pool share its blocks, as PyTorch's
/// private pool: a later capture on the same stream takes what an earlier
/// one freed, a capture into another pool does not, and the memory stays
/// the pool's until its last graph is destroyed.
#[test]
fn captures_into_one_pool_share_its_blocks_until_its_last_graph_goes() {
    in_child("shared_pools_child", "shared pools: checked");
}

/// The graph pools the device keeps once `g` is dropped and CUDA has run
/// the destroyed graphs' callbacks (on a thread of its own, soon after the
/// destruction): waits up to 5 s for `want`.
fn graph_pools_after(
    ctx: &cudarc::driver::CudaContext,
    dev: &parking_lot::Mutex<super::Device>,
    g: Option<cudarc::driver::CudaGraph>,
    want: usize,
) -> usize {
    drop(g);
    ctx.synchronize().unwrap();
    let start = std::time::Instant::now();
    loop {
        let mut d = dev.lock();
        d.release_graphs();
        let n = d.graphs.len();
        drop(d);
        if n == want || start.elapsed() > std::time::Duration::from_secs(5) {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// The bytes each graph pool of the device's default arena holds, sorted.
fn graph_pool_bytes(dev: &parking_lot::Mutex<super::Device>) -> Vec<usize> {
    let d = dev.lock();
    let mut v: Vec<usize> = d.arenas[""].graph_pools().iter().map(|p| p.1).collect();
    v.sort_unstable();
    v
}

/// The body of [`captures_into_one_pool_share_its_blocks_until_its_last_graph_goes`].
#[test]
#[ignore = "run by captures_into_one_pool_share_its_blocks_until_its_last_graph_goes in a child process"]
fn shared_pools_child() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let s = ctx.new_stream().unwrap();
    let raw = s.cu_stream().cast::<std::ffi::c_void>();
    let (p, q) = ((0, 9001), (0, 9002));
    // The device made before any capture (making it creates a stream,
    // which CUDA refuses during one).
    let warm = super::malloc(512, 0, raw).unwrap();
    super::free(warm, 0, raw).unwrap();
    // One capture into `pool`: takes `bytes` and frees them at once (a
    // temporary of the graph); the address.
    let capture = |pool, bytes| {
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap();
        assert!(super::pools::capture_pool(0, raw, pool).unwrap());
        let at = super::malloc(bytes, 0, raw).unwrap();
        super::free(at, 0, raw).unwrap();
        let g = s
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
            .unwrap();
        (at, g)
    };
    let (a, g1) = capture(p, 3 << 20);
    let (b, g2) = capture(p, 3 << 20);
    let (c, g3) = capture(q, 3 << 20);
    assert_eq!(
        b, a,
        "the second capture into the pool took the first's block"
    );
    assert_ne!(c, a, "a capture into another pool took the pool's block");
    let dev = super::existing(0).unwrap();
    let pools_after = |g, want| graph_pools_after(&ctx, dev, g, want);
    let held = || graph_pool_bytes(dev);
    assert_eq!(pools_after(None, 2), 2, "two pools");
    assert_eq!(pools_after(g1, 2), 2, "the pool lives while one graph does");
    assert_eq!(
        held(),
        [3 << 20, 3 << 20],
        "each pool holds its one block, one graph of the shared pool gone"
    );
    assert_eq!(pools_after(g2, 1), 1, "the pool went with its last graph");
    assert_eq!(held(), [3 << 20], "the shared pool's block went back");
    assert_eq!(pools_after(g3, 0), 0);
    assert!(held().is_empty());
    eprintln!("shared pools: checked");
}

/// The body of [`a_free_whose_capture_steps_fail_leaves_the_allocation_live`].
#[test]
#[ignore = "run by a_free_whose_capture_steps_fail_leaves_the_allocation_live in a child process"]
fn capture_steps_child() {
    use super::alloc::{FreeStep, FAIL_FREE_STEP};
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let (s1, s2) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let raw =
        |s: &std::sync::Arc<cudarc::driver::CudaStream>| s.cu_stream().cast::<std::ffi::c_void>();
    let a = super::malloc(1 << 20, 0, raw(&s1)).unwrap();
    let b = super::malloc(3 << 20, 0, raw(&s2)).unwrap();
    let live = |p: u64| {
        super::existing(0)
            .unwrap()
            .lock()
            .live
            .contains_key(&(p as usize))
    };
    s1.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    *FAIL_FREE_STEP.lock() = Some(FreeStep::GraphPool);
    let ea = super::free(a, 0, raw(&s1));
    *FAIL_FREE_STEP.lock() = Some(FreeStep::Fence);
    // b's own stream is not captured; the free names the captured one.
    let eb = super::free(b, 0, raw(&s1));
    *FAIL_FREE_STEP.lock() = None;
    let (still_a, still_b) = (live(a), live(b));
    let (fa, fb) = (super::free(a, 0, raw(&s1)), super::free(b, 0, raw(&s1)));
    let graph = s1
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .unwrap();
    let pools = super::existing(0).unwrap().lock().graphs.len();
    drop(graph);
    ctx.synchronize().unwrap();
    assert!(
        ea.is_err() && eb.is_err(),
        "the injected failures: {ea:?} {eb:?}"
    );
    assert!(still_a && still_b, "a failed free left the allocation live");
    assert!(fa.is_ok() && fb.is_ok(), "freed again: {fa:?} {fb:?}");
    assert_eq!(pools, 1, "both blocks went to the capture's graph");
    assert!(!live(a) && !live(b));
    eprintln!("capture steps: checked");
}
