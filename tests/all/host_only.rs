//! Host-backend specifics: byte views, and checks against what the kernel
//! itself reports (/proc/self/maps, /proc/self/fd), not only our counters.

use crate::common::{host, random_bytes};
use vmmbuf::{Access, BufferDesc, GrowableBuffer, GrowthPolicy, HostBackend};

crate::register! {
    host: [the_kernel_sees_real_mappings_and_gets_them_back, byte_views_see_what_was_written_and_survive_growth, read_only_access_is_enforced_by_the_kernel, buffers_are_send_and_sync],
}

/// The lines of /proc/self/maps inside `[start, end)`: (from, to, perms, path).
fn maps_in(start: u64, end: u64) -> Vec<(u64, u64, String, String)> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (a, b) = f.next()?.split_once('-')?;
            let (a, b) = (
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            );
            let perms = f.next()?.to_string();
            let path = f.nth(3).unwrap_or("").to_string();
            (a < end && b > start).then_some((a, b, perms, path))
        })
        .collect()
}

fn open_memfds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.to_string_lossy().contains("memfd:vmmbuf"))
        .count()
}

fn the_kernel_sees_real_mappings_and_gets_them_back() {
    let fds = open_memfds();
    let mut buf = GrowableBuffer::new(
        host(),
        BufferDesc::new(64 << 20).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    let (start, end) = (buf.base(), buf.base() + buf.reserved() as u64);
    let reserved = maps_in(start, end);
    assert!(
        reserved.iter().all(|m| m.2.starts_with("---")),
        "reservation is PROT_NONE: {reserved:?}"
    );
    buf.grow_to(5 * buf.granularity()).unwrap();
    assert_eq!(open_memfds(), fds + 5);
    let mapped: Vec<_> = maps_in(start, end)
        .into_iter()
        .filter(|m| m.3.contains("memfd:vmmbuf"))
        .collect();
    let bytes: u64 = mapped.iter().map(|m| m.1 - m.0).sum();
    assert_eq!(bytes, 5 * buf.granularity() as u64, "{mapped:?}");
    assert!(mapped.iter().all(|m| m.2 == "rw-s"), "{mapped:?}");

    buf.truncate(buf.granularity());

    buf.shrink_to_fit().unwrap();
    assert_eq!(open_memfds(), fds + 1, "trimmed chunks' memfds are closed");
    let mapped: u64 = maps_in(start, end)
        .iter()
        .filter(|m| m.3.contains("memfd"))
        .map(|m| m.1 - m.0)
        .sum();
    assert_eq!(mapped, buf.granularity() as u64);
    drop(buf);
    assert_eq!(open_memfds(), fds);
    assert!(
        maps_in(start, end).is_empty(),
        "the reservation is gone: {:?}",
        maps_in(start, end)
    );
}

fn byte_views_see_what_was_written_and_survive_growth() {
    let mut buf = GrowableBuffer::new(host(), BufferDesc::new(64 << 20)).unwrap();
    assert_eq!(buf.host_slice(..).unwrap(), &[] as &[u8]);
    buf.grow_to(100_000).unwrap();
    let data = random_bytes(1, 100_000);
    buf.host_slice_mut(..).unwrap().copy_from_slice(&data);
    let ptr = buf.host_slice(..).unwrap().as_ptr();
    // Growing through &self while a view is alive: the view stays valid.
    let view = buf.host_slice(..).unwrap();
    buf.grow_to(5 << 20).unwrap();
    assert!(
        view == &data[..],
        "a view taken before growth still reads the data"
    );
    assert_eq!(buf.host_slice(..).unwrap().as_ptr(), ptr, "same address");
    assert_eq!(buf.host_slice(..).unwrap().len(), 5 << 20);
    let mut back = vec![0u8; 100_000];
    buf.read(0, &mut back).unwrap();
    assert!(back == data);
}

fn read_only_access_is_enforced_by_the_kernel() {
    let mut buf = GrowableBuffer::new(
        HostBackend::new(),
        BufferDesc::new(1 << 20).access(Access::Read),
    )
    .unwrap();
    buf.grow_to(8192).unwrap();
    let (start, end) = (buf.base(), buf.base() + buf.capacity() as u64);
    let perms: Vec<_> = maps_in(start, end).into_iter().map(|m| m.2).collect();
    assert!(
        !perms.is_empty() && perms.iter().all(|p| p == "r--s"),
        "{perms:?}"
    );
    assert!(
        buf.host_slice(..).unwrap().len() == 8192,
        "reading is allowed"
    );
    assert!(matches!(
        buf.host_slice_mut(..),
        Err(vmmbuf::Error::InvalidArgument(_))
    ));
    assert!(matches!(
        buf.write(0, &[1]),
        Err(vmmbuf::Error::InvalidArgument(_))
    ));
    let mut none = GrowableBuffer::new(
        HostBackend::new(),
        BufferDesc::new(1 << 20).access(Access::None),
    )
    .unwrap();
    none.grow_to(1).unwrap();
    let perms: Vec<_> = maps_in(none.base(), none.base() + 4096)
        .into_iter()
        .map(|m| m.2)
        .collect();
    assert_eq!(perms, ["---s"]);
    assert!(
        none.host_slice(..).is_err()
            && none.read(0, &mut [0]).is_err()
            && none.host_slice_mut(..).is_err()
    );
}

fn buffers_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<GrowableBuffer<HostBackend>>();
    check::<GrowableBuffer<vmmbuf::CudaBackend>>();
}
