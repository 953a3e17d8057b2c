//! Where memory lives and who may touch it.

use std::fmt;

/// A memory location: a GPU by ordinal, or the host.
///
/// As a chunk's *placement* it says where the physical memory lives; in an
/// [`AccessDesc`] it names who is granted access.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Location {
    /// GPU memory of the device with this ordinal.
    Device(u32),
    /// Host memory (pinned host memory for the CUDA backend; the process's
    /// own memory for the host backend).
    Host,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Device(d) => write!(f, "gpu{d}"),
            Location::Host => f.write_str("host"),
        }
    }
}

/// Access rights of one location to a mapped range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Access {
    /// No access: any touch faults.
    None,
    /// Read only: writes fault (on CUDA, copies into it return an error).
    Read,
    /// Read and write.
    #[default]
    ReadWrite,
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::None => "none",
            Access::Read => "r",
            Access::ReadWrite => "rw",
        })
    }
}

/// One entry of an access list: `location` gets `access`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AccessDesc {
    /// Who is granted access.
    pub location: Location,
    /// What they may do.
    pub access: Access,
}

impl AccessDesc {
    /// `location` gets `access`.
    pub const fn new(location: Location, access: Access) -> Self {
        Self { location, access }
    }
}

/// Whether a chunk mapped at `placement`, on a backend whose home is `home`,
/// gets the host's access entry at once (`Entry::cpu`): not for host memory
/// beside a GPU, where the entry costs ~40 ms per GiB and only the CPU needs
/// it (a CPU view or a synchronous copy grants it then).
pub(crate) fn cpu_at_once(home: Location, placement: Location) -> bool {
    placement != Location::Host || home == Location::Host
}

/// `list` as the driver takes it for a chunk placed at `placement`.
pub(crate) fn driver_access(list: &[AccessDesc], placement: Location) -> Vec<AccessDesc> {
    driver_access_for(list, placement, true)
}

/// `list` as the driver takes it for a chunk placed at `placement`, with the
/// host's entry only if `cpu` (and the chunk is in host memory).
pub(crate) fn driver_access_for(
    list: &[AccessDesc],
    placement: Location,
    cpu: bool,
) -> Vec<AccessDesc> {
    list.iter()
        .filter(|d| d.location != Location::Host || (placement == Location::Host && cpu))
        .copied()
        .collect()
}

/// `list` with the entries of `extra` whose location it lacks added.
pub(crate) fn with_entries(list: &[AccessDesc], extra: &[AccessDesc]) -> Vec<AccessDesc> {
    let mut v = list.to_vec();
    v.extend(
        extra
            .iter()
            .filter(|p| !list.iter().any(|a| a.location == p.location)),
    );
    v
}

/// Who may touch the chunks one call maps: what the driver is given for a
/// chunk placed where, and what the chunk table records of it (see
/// `Region::map_batch` and `Region::swap`).
#[derive(Clone, Debug)]
pub(crate) struct Grants {
    /// Every device (and the host) that may touch the chunks.
    list: std::sync::Arc<[AccessDesc]>,
    /// Whether a chunk in host memory gets the host's entry from the driver
    /// at once ([`cpu_at_once`]).
    cpu: bool,
    /// The table records the driver's list of each chunk, not the whole
    /// list.
    record_driver_lists: bool,
}

impl Grants {
    /// `list` for every chunk; the host's entry for a chunk in host memory
    /// given to the driver at once if `cpu`.
    pub(crate) fn new(list: &[AccessDesc], cpu: bool) -> Self {
        Self {
            list: list.into(),
            cpu,
            record_driver_lists: false,
        }
    }

    /// The table records, for each chunk, the list the driver got.
    #[cfg(unix)]
    pub(crate) fn recording_driver_lists(mut self) -> Self {
        self.record_driver_lists = true;
        self
    }

    /// The driver's list for a chunk placed at `placement`.
    pub(crate) fn driver(&self, placement: Location) -> Vec<AccessDesc> {
        driver_access_for(&self.list, placement, self.cpu)
    }

    /// What the table records as a chunk's access, placed at `placement`.
    pub(crate) fn recorded(&self, placement: Location) -> std::sync::Arc<[AccessDesc]> {
        if self.record_driver_lists {
            self.driver(placement).into()
        } else {
            self.list.clone()
        }
    }

    /// Whether the host's entry went to the driver at once.
    pub(crate) fn cpu(&self) -> bool {
        self.cpu
    }
}
